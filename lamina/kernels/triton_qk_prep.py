"""Attention's per-token preparation in one Triton launch: q/k RMSNorm, rotary embedding on the
leading `rotary_dim` features (rotate-half form) and the paged K/V cache write.

The references are `RMSNorm`, `RotaryEmbedding.apply` and `write_kv_cache` (about 35 torch
launches per layer; the attention layer runs this kernel for decode and prefill steps on the
Triton set); this rounds to the activation dtype where they do (after the norm,
after each rotary product and the sum), so it agrees with them up to float32 reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.paged_attention import FP8_DTYPES
from lamina.kernels.pdl import pdl_kwargs, wait_for_producer

__all__ = ["qk_norm_rope_cache"]

# Warps per (token, head) program (a constant: batch invariance); benchmarks/tune_decode_warps.py
# found 1-8 warps within 0.08 us of one another at batch 1 on an H200 (1.51-1.59 us per call).
QK_PREP_WARPS = 4


@triton.jit
def _qk_prep_kernel(
    q_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, q_out_ptr,
    eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
    stride_cs, stride_ch, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr,
    ZERO_CENTRED: tl.constexpr, CACHE_MAX: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    token = tl.program_id(0).to(tl.int64)  # int64 offsets: prefill steps of many tokens
    head = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    half: tl.constexpr = ROT // 2
    is_q = head < NUM_Q_HEADS
    kv_head = tl.maximum(head - NUM_Q_HEADS, 0)
    src = tl.where(is_q, q_ptr + token * stride_qt + head * stride_qh, k_ptr + token * stride_kt + kv_head * stride_kh)
    w_ptr = tl.where(is_q, q_w_ptr, k_w_ptr)
    x = tl.load(src + d, mask=d_ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x) / HEAD_DIM + eps)
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    partner_idx = tl.where(d < half, d + half, d - half)
    in_rot = d < ROT
    x_p = tl.load(src + partner_idx, mask=in_rot, other=0.0).to(tl.float32)
    w_p = tl.load(w_ptr + partner_idx, mask=in_rot, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        w = w + 1.0
        w_p = w_p + 1.0
    normed = (x * r * w).to(dtype).to(tl.float32)
    partner = (x_p * r * w_p).to(dtype).to(tl.float32)
    partner = tl.where(d < half, -partner, partner)
    cos = tl.load(cos_ptr + token * stride_ct + d, mask=in_rot, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_ct + d, mask=in_rot, other=0.0).to(dtype).to(tl.float32)
    rotated = (normed * cos).to(dtype).to(tl.float32) + (partner * sin).to(dtype).to(tl.float32)
    out = tl.where(in_rot, rotated, normed).to(dtype)
    if is_q:
        tl.store(q_out_ptr + token * stride_ot + head * stride_oh + d, out, mask=d_ok)
    else:
        slot = tl.load(slots_ptr + token)
        if slot >= 0:
            dst = slot.to(tl.int64) * stride_cs + kv_head * stride_ch + d
            v = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + d, mask=d_ok, other=0.0)
            if CACHE_MAX > 0:  # an FP8 cache (scale 1.0): clamped to its finite range, then rounded
                k_fp8 = tl.minimum(tl.maximum(out.to(tl.float32), -CACHE_MAX), CACHE_MAX)
                v_fp8 = tl.minimum(tl.maximum(v.to(tl.float32), -CACHE_MAX), CACHE_MAX)
                tl.store(k_cache_ptr + dst, k_fp8.to(k_cache_ptr.dtype.element_ty), mask=d_ok)
                tl.store(v_cache_ptr + dst, v_fp8.to(v_cache_ptr.dtype.element_ty), mask=d_ok)
            else:
                tl.store(k_cache_ptr + dst, out.to(k_cache_ptr.dtype.element_ty), mask=d_ok)
                tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=d_ok)


def qk_norm_rope_cache(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor, eps: float, zero_centred: bool, cos: torch.Tensor, sin: torch.Tensor,
    slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_warps: int | None = None,
) -> torch.Tensor:
    """query `[T, H, D]`, key / value `[T, Hkv, D]` (strided views of one projection are fine);
    cos / sin `[T, rotary_dim]` float32 (same strides); caches `[num_blocks, block_size, Hkv, D]`
    contiguous, written at `slot_mapping [T]` (entries < 0 skipped; the others distinct, as a
    step's slots are); `num_warps` overrides QK_PREP_WARPS (benchmarks). Returns the normed,
    rotated query `[T, H, D]`."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rotary_dim = cos.shape[-1]
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("qk_norm_rope_cache needs contiguous K/V caches")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    _qk_prep_kernel[(num_tokens, num_heads + num_kv_heads)](
        query, key, value, q_norm_weight, k_norm_weight, cos, sin, slot_mapping, k_cache, v_cache, out, eps,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_heads, HEAD_DIM=head_dim, ROT=rotary_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        ZERO_CENTRED=zero_centred, CACHE_MAX=torch.finfo(k_cache.dtype).max if k_cache.dtype in FP8_DTYPES else 0.0,
        **pdl_kwargs(query.device), num_warps=num_warps or QK_PREP_WARPS, **FP_FUSION,
    )
    return out

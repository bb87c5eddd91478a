"""The gated delta rule of short prompt chunks, token by token on the device, in one launch.

fla-core's chunked kernel (`lamina.kernels.fla_prefill`) is the fast way through long chunks, but a
call costs about 10 launches (its l2 norms, chunk kernels, the state gather and scatter around it)
and, on the host, ~1 ms of Python and launch overhead per layer: a 16-token prompt's eager step on
the 40-layer Qwen3.5-35B-A3B preset spent ~70 ms on the host for ~12 ms of GPU work (H100, session
42, docs/PERFORMANCE.md). For chunks of up to a few hundred tokens the recurrence itself is cheap,
so this kernel runs it sequentially instead (`lamina.kernels.selection.gdn_short_prefill_max_tokens`
says up to where): one program per (request, value head, value tile) holds a
`[Dk, BLOCK_V]` float32 state, reads the request's tokens [query_start_loc[b], query_start_loc[b+1])
in order and, per token, l2-normalises q and k, computes the gates from the raw projections (a, b:
as `GatedDeltaNet._gates`), decays, applies the delta rule and writes the output row; the state
after the last token goes back to the request's slot in the pool (read at the slot, zeros where
`keep` is False; slots < 0 are padding: read zeros, write nothing).

The math is `recurrent_gated_delta_rule_step` applied token after token, so it agrees with the
reference (`gated_delta_rule_varlen`) to float32 rounding, as fla's chunked form does (neither is
bitwise: fla reorders the sums into chunks). Launch shapes follow host ints only (the batch size;
the loop bounds are read on the device), nothing syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION

__all__ = ["gated_delta_rule_short_prefill"]


@triton.jit
def _gdr_varlen_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, keep_ptr, qsl_ptr, out_ptr,
    scale, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    k_head = head // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    s_ok = k_ok[:, None] & v_ok[None, :]
    slot = tl.load(slots_ptr + req)
    live = (offs_v * 0 + slot) >= 0  # [V]: padding rows (slot < 0) read zeros and write no state
    keep = tl.load(keep_ptr + req)
    s_ptrs = state_ptr + tl.maximum(slot, 0) * stride_ss + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    state = tl.load(s_ptrs, mask=s_ok & live[None, :], other=0.0).to(tl.float32)  # [K, V]
    state = tl.where(keep != 0, state, 0.0)
    neg_a = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    for t in range(start, end):  # the request's tokens, in order, on the device
        q = tl.load(q_ptr + t * stride_qt + k_head * stride_qh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + k_head * stride_kh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + t * stride_at + head).to(tl.float32) + dt_bias
        b = tl.load(b_ptr + t * stride_bt + head).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k) + eps)
        g = neg_a * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # -exp(A_log) * softplus(a + dt_bias)
        beta = 1.0 / (1.0 + tl.exp(-b))
        state = state * tl.exp(g)
        delta = beta * (v - tl.sum(state * k[:, None], axis=0))  # [V]
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)  # [V]
        tl.store(out_ptr + t * stride_ot + head * stride_oh + offs_v, out.to(out_ptr.dtype.element_ty), mask=v_ok)
    tl.debug_barrier()  # the whole tile was read before any lane writes it back
    tl.store(s_ptrs, state, mask=s_ok & live[None, :])


def gated_delta_rule_short_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, query_start_loc: torch.Tensor,
    *, a_log: torch.Tensor, dt_bias: torch.Tensor,
) -> torch.Tensor:
    """q, k `[T, Hk, Dk]`; v `[T, Hv, Dv]` (unit last strides; q, k the conv output before the l2
    norm, which runs here); a, b `[T, Hv]`: the raw gate projections (g = -exp(a_log) * softplus(a +
    dt_bias), beta = sigmoid(b), computed here); state_pool `[num_slots, Hv, Dk, Dv]` (float32,
    bfloat16 or float16; computed in float32), read at `slots [B]` (zeros where `keep[b]` is False
    or the slot is negative) and updated there with the state after each request's last token;
    query_start_loc `[B+1]`: request b's tokens are rows query_start_loc[b] .. query_start_loc[b+1]-1
    (possibly none). Returns the output `[T, Hv, Dv]` in v's dtype."""
    num_tokens, num_v_heads, head_v_dim = v.shape
    num_k_heads, head_k_dim = k.shape[1], k.shape[2]
    bsz = slots.shape[0]
    if num_v_heads % num_k_heads or q.shape != k.shape or a.shape != (num_tokens, num_v_heads) or b.shape != a.shape:
        raise ValueError(f"gated_delta_rule_short_prefill: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)} do not fit [T, Hk, Dk] / [T, Hv, Dv] / [T, Hv]")
    if query_start_loc.shape != (bsz + 1,) or keep.shape != (bsz,):
        raise ValueError(f"gated_delta_rule_short_prefill: query_start_loc {tuple(query_start_loc.shape)} and keep "
                         f"{tuple(keep.shape)} must be [B+1] and [B] for B = {bsz} slots")
    if state_pool.shape[1:] != (num_v_heads, head_k_dim, head_v_dim) or state_pool.stride(-1) != 1:
        raise ValueError(f"gated_delta_rule_short_prefill: state pool {tuple(state_pool.shape)} does not fit "
                         f"Hv = {num_v_heads}, Dk = {head_k_dim}, Dv = {head_v_dim} with a unit last stride")
    out = torch.empty((num_tokens, num_v_heads, head_v_dim), dtype=v.dtype, device=v.device)
    if bsz == 0:
        return out
    q, k, v, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, a, b))
    block_v = min(32, triton.next_power_of_2(head_v_dim))
    grid = (bsz, num_v_heads, triton.cdiv(head_v_dim, block_v))
    _gdr_varlen_kernel[grid](
        q, k, v, a, b, a_log, dt_bias, state_pool, slots, keep, query_start_loc, out,
        head_k_dim**-0.5, 1e-6,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), out.stride(0), out.stride(1),
        GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        BLOCK_K=triton.next_power_of_2(head_k_dim), BLOCK_V=block_v, **FP_FUSION,
    )
    return out

"""Triton kernel of QSA block scores for one-token decode, reading the indexer's paged raw keys.

`qsa_block_scores` computes, for every request b and index block n < (seq_len_b) // ratio (its
complete blocks), what the torch path computes over the whole block-table capacity
(`QSAIndexer._block_keys` + `lamina.kernels.indexed_attention.block_scores`):

    key_n   = mean of the raw keys at positions n*ratio .. n*ratio+ratio-1   (float32, rounded)
    key_n   = rms_norm(key_n) * (1 + w)  (or * w)                            (float32, rounded)
    key_n   = rope(key_n) at position n*ratio  (rounded where torch rounds)
    score_n = sum_h relu(q_h . key_n) / sqrt(D)                              (float32)

Blocks at or past a request's complete count are not read (their score is 0; the selection never
takes them), so a step reads each request's own context only, while the launch grid (requests x
capacity tiles) depends on host ints alone: graph-safe. Float32 sums run in another order than
torch's, so scores agree to rounding; exact ties (ReLU zeros) stay exact.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION

__all__ = ["qsa_block_scores"]


@triton.jit
def _load_pooled(cache_ptr, table_ptr, req, stride_bt, stride_c, cols, col_ok, offs_n, n_ok,
                 RATIO: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Mean of the RATIO raw keys of blocks offs_n at feature columns `cols` -> [N, C] float32."""
    acc = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    for j in tl.static_range(RATIO):
        pos = offs_n * RATIO + j  # [N]
        page = tl.load(table_ptr + req * stride_bt + pos // PAGE, mask=n_ok, other=0)  # [N]
        slot = page.to(tl.int64) * PAGE + pos % PAGE  # [N]
        acc += tl.load(cache_ptr + slot[:, None] * stride_c + cols[None, :],
                       mask=n_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    return acc / RATIO


@triton.jit
def _scores_against(q_ptr, req, stride_qb, stride_qh, offs_h, h_ok, cols, col_ok, key):
    """sum_d q[h, d] * key[n, d] over the columns `cols` -> [N, H] float32."""
    q = tl.load(q_ptr + req * stride_qb + offs_h[:, None] * stride_qh + cols[None, :],
                mask=h_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # [H, C]
    return tl.sum(key[:, None, :] * q[None, :, :], axis=2)  # [N, H]


@triton.jit
def _qsa_block_scores_kernel(
    q_ptr, cache_ptr, table_ptr, seq_lens_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, eps, sqrt_d, num_blocks,
    stride_qb, stride_qh, stride_c, stride_bt, stride_cs, stride_ob,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_N: tl.constexpr,
    RATIO: tl.constexpr, PAGE: tl.constexpr, ZERO_CENTRED: tl.constexpr,
):
    req = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] index blocks
    complete = tl.load(seq_lens_ptr + req) // RATIO
    n_ok = offs_n < complete
    out_dtype = cache_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < NUM_HEADS
    # Features in three parts: rotary first half [0, HALF), second half [HALF, 2*HALF), the rest.
    lo_cols = tl.arange(0, BLOCK_HALF)
    half_ok = lo_cols < HALF
    hi_cols = HALF + lo_cols
    rest_cols = 2 * HALF + tl.arange(0, BLOCK_REST)
    rest_ok = tl.arange(0, BLOCK_REST) < REST
    # pooled means, rounded to the cache dtype as torch's `.mean().to(dtype)`
    lo = _load_pooled(cache_ptr, table_ptr, req, stride_bt, stride_c, lo_cols, half_ok, offs_n, n_ok, RATIO, PAGE,
                      BLOCK_N, BLOCK_HALF)
    hi = _load_pooled(cache_ptr, table_ptr, req, stride_bt, stride_c, hi_cols, half_ok, offs_n, n_ok, RATIO, PAGE,
                      BLOCK_N, BLOCK_HALF)
    rest = _load_pooled(cache_ptr, table_ptr, req, stride_bt, stride_c, rest_cols, rest_ok, offs_n, n_ok, RATIO, PAGE,
                        BLOCK_N, BLOCK_REST)
    lo = lo.to(out_dtype).to(tl.float32)
    hi = hi.to(out_dtype).to(tl.float32)
    rest = rest.to(out_dtype).to(tl.float32)
    # RMSNorm over all HEAD_DIM features
    sum_sq = tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1) + tl.sum(rest * rest, axis=1)  # [N]
    inv = tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]  # [N, 1]
    w_lo = tl.load(w_ptr + lo_cols, mask=half_ok, other=0.0).to(tl.float32)
    w_hi = tl.load(w_ptr + hi_cols, mask=half_ok, other=0.0).to(tl.float32)
    w_rest = tl.load(w_ptr + rest_cols, mask=rest_ok, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        w_lo = w_lo + 1.0
        w_hi = w_hi + 1.0
        w_rest = w_rest + 1.0
    lo = (lo * inv * w_lo[None, :]).to(out_dtype).to(tl.float32)
    hi = (hi * inv * w_hi[None, :]).to(out_dtype).to(tl.float32)
    rest = (rest * inv * w_rest[None, :]).to(out_dtype).to(tl.float32)
    # RoPE at the block's first position (cos/sin rows per index block, rounded to the dtype)
    cs_off = offs_n[:, None] * stride_cs + lo_cols[None, :]
    cs_ok = n_ok[:, None] & half_ok[None, :]
    cos = tl.load(cos_ptr + cs_off, mask=cs_ok, other=0.0).to(out_dtype).to(tl.float32)
    sin = tl.load(sin_ptr + cs_off, mask=cs_ok, other=0.0).to(out_dtype).to(tl.float32)
    lo_rot = ((lo * cos).to(out_dtype).to(tl.float32) + (-hi * sin).to(out_dtype).to(tl.float32)).to(out_dtype)
    hi_rot = ((hi * cos).to(out_dtype).to(tl.float32) + (lo * sin).to(out_dtype).to(tl.float32)).to(out_dtype)
    per_head = _scores_against(q_ptr, req, stride_qb, stride_qh, offs_h, h_ok, lo_cols, half_ok, lo_rot.to(tl.float32))
    per_head += _scores_against(q_ptr, req, stride_qb, stride_qh, offs_h, h_ok, hi_cols, half_ok, hi_rot.to(tl.float32))
    per_head += _scores_against(q_ptr, req, stride_qb, stride_qh, offs_h, h_ok, rest_cols, rest_ok, rest)
    score = tl.sum(tl.maximum(per_head, 0.0), axis=1) / sqrt_d  # [N]
    tl.store(out_ptr + req * stride_ob + offs_n, tl.where(n_ok, score, 0.0), mask=offs_n < num_blocks)


def qsa_block_scores(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    zero_centred: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ratio: int,
    block_n: int | None = None,
) -> torch.Tensor:
    """Block scores of one decode query per request.

    Args:
        query: `[B, Hi, D]` indexer queries (normed, rotated); key_cache: `[num_pages, page, 1, D]`
            raw keys; block_tables: `[B, max_pages]`; seq_lens: `[B]`; norm_weight: `[D]`
            (`k_layernorm`), eps, zero_centred: its parameters; cos, sin: `[nb, rotary_dim]` float32
            at the index blocks' first positions (nb: the capacity, a host int); ratio: keys per block.

    Returns:
        `[B, nb]` float32; entries at or past a request's complete blocks are 0.
    """
    bsz, num_heads, dim = query.shape
    num_blocks, rotary_dim = cos.shape
    if key_cache.shape[2] != 1 or key_cache.shape[3] != dim:
        raise ValueError(f"indexer key cache {tuple(key_cache.shape)} does not hold one {dim}-wide key per slot")
    if query.stride(-1) != 1 or not key_cache.is_contiguous() or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("qsa_block_scores needs a contiguous key cache and unit-stride query, cos and sin rows")
    half, rest = rotary_dim // 2, dim - rotary_dim
    out = torch.empty(bsz, num_blocks, dtype=torch.float32, device=query.device)
    if bsz == 0 or num_blocks == 0:
        return out.zero_()
    block_h, block_half = triton.next_power_of_2(num_heads), triton.next_power_of_2(max(half, 1))
    if block_n is None:  # index blocks per program: the [N, H, D/2] products stay near 8K elements
        block_n = max(1, min(16, 8192 // (block_h * block_half)))
    grid = (bsz, triton.cdiv(num_blocks, block_n))
    _qsa_block_scores_kernel[grid](
        query, key_cache, block_tables, seq_lens, norm_weight, cos, sin, out, eps, math.sqrt(dim), num_blocks,
        query.stride(0), query.stride(1), key_cache.stride(1), block_tables.stride(0), cos.stride(0), out.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=dim, HALF=half, REST=rest, BLOCK_H=block_h,
        BLOCK_HALF=block_half, BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        BLOCK_N=block_n, RATIO=ratio, PAGE=key_cache.shape[1], ZERO_CENTRED=zero_centred, **FP_FUSION,
    )
    return out

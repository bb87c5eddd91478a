"""Causal attention of a flat varlen step over the paged KV cache in one Triton launch: prompt chunks
with or without cached context, decodes and verification chunks alike, with GQA and the output gate.

The same operation as `lamina.kernels.paged_attention.paged_attention` (its docstring defines it:
query i of request b sits at position seq_lens[b] - q_len_b + i and reads keys 0..that position;
query head h reads KV head h // (Hq // Hkv)), without its padded `[B, Lq, S]` layout, its gathered
context copies or SDPA's backends: SDPA's choice for a mask with GQA on an H200 is cuDNN, which
builds an execution plan for every new shape (70-95 ms, benchmarks/results/bench_sdpa_shapes_gqa_h200.json),
and a mixed step brings new shapes every step.

Grid (query head x request, the head varying fastest; query block of BLOCK_M), launched longest
block first: with `longest_first` the second axis counts query blocks down from the last (at most
65,535 of them: 4M queries at 64 a block), so the blocks that read the most keys (the causal rule's
last rows) start in the first wave and the last wave holds the shortest ones, rather than a tail of
long blocks of the last head; the heads of one block run side by side and share their KV head's
tiles in L2. A block past its request's queries returns at once. Each program streams its request's
keys in BLOCK_N tiles through the block table, with the online softmax in float32, and stops at the
block's last query position (the causal rule skips the rest). A row's result depends on its request
only, never on the step's other requests, nor on the launch order.

Where it runs (`paged_attention(varlen=True)`, the default on the Triton kernel set; off with
`LAMINA_PREFILL_ATTENTION=sdpa`): prompt chunks, fresh (on an H100 a fresh 8k prompt takes 2.07 ms
here against 2.45 on SDPA's causal rule, flash; `LAMINA_FRESH_PROMPT_ATTENTION=sdpa` keeps them
there) or continuing cached context, and verification chunks riding a prefill step. Decodes run
the paged decode kernel of decode steps, so a decode computes the same way whatever shares its
step. Tested against the reference under Triton's interpreter in CI (float32) and on a GPU in
bf16. Untimed design points: one program per query head (K/V read once per head of a GQA group),
no split over long contexts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.triton_decode import _dot_precision

__all__ = ["paged_prefill_attention", "prefill_tiles", "PREFILL_BLOCK_M"]

PREFILL_BLOCK_M = 64  # queries per program at head dims up to 128

# (BLOCK_M, BLOCK_N, warps, stages) by head dim, in order of preference. Head dim 256 (Qwen3.5 /
# Qwen3-Next attention): 128 x 64 tiles on 8 warps, 3 stages, the best of 36 tiles on an H200 at
# 221 / 237 TFLOP/s for a 4k chunk over 4k of context / a fresh 8k prompt, against 104 for the
# earlier 64 x 32 (benchmarks/bench_varlen_attention.py --sweep, results/bench_varlen_tiles_h200.json);
# it takes ~200 KB of shared memory, so a GPU with less falls back to the next tile (decided on a
# device's first call, kept after). Up to 128: 64 x 64 on 4 warps (not swept).
_TILES_WIDE_HEADS = ((128, 64, 8, 3), (PREFILL_BLOCK_M, 32, 8, None))
_TILES = ((PREFILL_BLOCK_M, 64, 4, None),)
_CHOSEN_TILE: dict[tuple, tuple[int, int, int, int | None]] = {}


def prefill_tiles(head_dim: int) -> tuple[tuple[int, int, int, int | None], ...]:
    """The tiles `paged_prefill_attention` tries for this head dim, best first."""
    return _TILES_WIDE_HEADS if head_dim > 128 else _TILES


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, gate_ptr, out_ptr, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_gt, stride_gh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, GATED: tl.constexpr,
    NUM_HEADS: tl.constexpr, LONGEST_FIRST: tl.constexpr,
):
    head = tl.program_id(0) % NUM_HEADS
    req = tl.program_id(0) // NUM_HEADS
    m_block = tl.program_id(1)
    if LONGEST_FIRST:
        m_block = tl.num_programs(1) - 1 - m_block
    kv_head = head // GROUP
    q_start = tl.load(qsl_ptr + req).to(tl.int64)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if m_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        first_pos = seq_len - q_len  # position of the request's query 0
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] query index inside the request
        m_ok = offs_m < q_len
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        rows = q_start + offs_m  # [BM] flat token rows
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
        pos = first_pos + offs_m  # [BM] the queries' positions (padding rows: past the last, harmless)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = block_tables_ptr + req * stride_bt
        end = tl.minimum(seq_len, first_pos + (m_block + 1) * BLOCK_M)  # keys the block's last query reads
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN] key positions
            n_ok = offs_n < end
            page = tl.load(table + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)  # [BN]
            in_page = offs_n % PAGE_SIZE
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + (page * stride_kb + in_page * stride_ks + kv_head * stride_kh)[:, None]
                        + offs_d[None, :], mask=kv_ok, other=0.0).to(q.dtype)  # [BN, BD] (an FP8 cache: converted)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BM, BN]
            s = tl.where((offs_n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row reads key 0 in the first tile
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])  # [BM, BN]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + (page * stride_vb + in_page * stride_vs + kv_head * stride_vh)[:, None]
                        + offs_d[None, :], mask=kv_ok, other=0.0).to(q.dtype)  # [BN, BD] (an FP8 cache: converted)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        dtype = out_ptr.dtype.element_ty
        out = (acc / l_i[:, None]).to(dtype)  # [BM, BD]
        ok = m_ok[:, None] & d_ok[None, :]
        if GATED:  # attn * sigmoid(gate), rounded as the layer's torch ops round (as the decode kernel)
            gate = tl.load(gate_ptr + rows[:, None] * stride_gt + head * stride_gh + offs_d[None, :], mask=ok,
                           other=0.0).to(tl.float32)
            gate = (1.0 / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            out = (out.to(tl.float32) * gate).to(dtype)
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out, mask=ok)


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    gate: torch.Tensor | None = None,
    tile: tuple[int, int, int, int] | None = None,
    longest_first: bool = True,
) -> torch.Tensor:
    """q `[T, Hq, D]` (unit last stride); caches `[num_blocks, block_size, Hkv, D]` holding this
    step's keys; block_tables `[B, >= pages]`; seq_lens `[B]` (each >= its query count);
    query_start_loc `[B+1]`; max_query_len: host int; gate: optional `[T, Hq, D]`, the output
    becomes attn * sigmoid(gate); tile: (BLOCK_M, BLOCK_N, warps, stages), for
    benchmarks/bench_varlen_attention.py's sweep (default: `prefill_tiles(head_dim)`'s first that
    fits the device); longest_first: query blocks launched from the last (default) or the first,
    for the benchmark's comparison (each program's sums are the same either way). Returns
    `[T, Hq, D]` in q's dtype."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    bsz = query_start_loc.shape[0] - 1
    if num_tokens == 0 or bsz == 0:
        return out
    gated = gate is not None
    gate = (gate if gate.stride(-1) == 1 else gate.contiguous()) if gated else q

    def launch(block_m: int, block_n: int, warps: int, stages: int | None) -> None:
        grid = (num_q_heads * bsz, triton.cdiv(max(1, max_query_len), block_m))  # (head, request) fastest
        _paged_prefill_attention_kernel[grid](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, gate, out, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), gate.stride(0),
            gate.stride(1), out.stride(0), out.stride(1),
            GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_dot_precision(q.dtype),
            GATED=gated, NUM_HEADS=num_q_heads, LONGEST_FIRST=longest_first, num_warps=warps,
            **({} if stages is None else {"num_stages": stages}), **FP_FUSION,
        )

    key = (q.device, head_dim, q.dtype)
    chosen = tile or _CHOSEN_TILE.get(key)
    if chosen is not None:
        launch(*chosen)
        return out
    *fallible, last = prefill_tiles(head_dim)
    for candidate in fallible:
        try:
            launch(*candidate)
        except OutOfResources:  # shared memory: raised at compile time, before the launch
            continue
        _CHOSEN_TILE[key] = candidate  # the same tile for every later call: a row's sums never change order
        return out
    launch(*last)  # nothing smaller to fall back to: its error, if any, goes to the caller
    _CHOSEN_TILE[key] = last
    return out

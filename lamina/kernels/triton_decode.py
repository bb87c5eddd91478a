"""Triton kernels of the one-token decode step, reading the caches and state pools in place.

Each kernel has a torch reference in this package (CPU, CI, the oracle) and is tested against it,
on CUDA and under Triton's CPU interpreter (`TRITON_INTERPRET=1`) at tiny shapes:

- `paged_decode_attention`: one query per request (or Q consecutive ones, causal inside the Q:
  MTP verification) over its paged K/V (block tables, `seq_lens` read on the device), all query
  heads of a KV head in one program (GQA; Q queries past ROW_TILE rows: in row tiles, see ROW_TILE), online
  softmax, the key blocks split over ATTENTION_SPLITS programs (INTERPRETER_ATTENTION_SPLITS under
  Triton's interpreter) whose partials the last one combines. Reference: `paged_attention` with `max_query_len == Q`.
- `gated_delta_rule_decode`: one delta-rule step per request, the `[Dk, Dv]` state read from and
  written back to the state pool at the request's slot (float32, or `mamba_ssm_cache_dtype`'s
  dtype: read into float32, rounded on store). Reference: `recurrent_gated_delta_rule_step`.
- `causal_conv1d_decode`: the depthwise causal conv of one token with the rolling input state
  in the conv-state pool. Reference: `causal_conv1d_varlen` with one token per request.

Nothing here reads a tensor value on the host, and every launch shape depends on host ints only
(batch size, head counts, dims), so a decode step built from them can be captured in a CUDA graph.
Padded rows of a captured batch point at a spare state slot and have `seq_len >= 1`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.paged_attention import FP8_DTYPES
from lamina.kernels.pdl import pdl_kwargs, wait_for_producer
from lamina.kernels.selection import triton_interpreted

__all__ = ["paged_decode_attention", "gated_delta_rule_decode", "causal_conv1d_decode"]


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- paged attention, one query per request ------------------------------------------------------


# Every (request, KV head) is split over this many programs, program p taking the key blocks p,
# p + SPLITS, p + 2 * SPLITS, ... of BLOCK_N positions (flash-decoding): a short context still
# spreads over several SMs, a long one runs SPLITS loops in parallel instead of one. The count is
# a constant, so what a request computes (which blocks each program visits and the order the
# partials are combined in) depends on its own sequence length only, never on the batch.
ATTENTION_SPLITS = 16
# Triton's interpreter (CI) runs the programs one after another, and a program past its request's
# last key block still costs its launch before it returns: there the default is 2 programs. Up to
# 2 * BLOCK_N keys (128) both counts give each block a program of its
# own and combine the same partials in the same order (the absent ones add exactly 0), so the
# result is the same bit for bit; longer contexts group their partial sums differently. Either way
# the split path (partials, ticket, combine) runs.
INTERPRETER_ATTENTION_SPLITS = 2

# Warps per program of the one-token kernels (a constant, never chosen by the batch: a row's
# reductions run in the same order whatever the batch). benchmarks/tune_decode_warps.py timed them
# at batch 1 on an H200 (tune_decode_warps_h200.json, us per call in a graph of 40 with PDL, for
# 1 / 2 / 4 / 8 warps): attention 13.5 / 12.2 / 8.7 / 7.7, conv 2.15 / 1.49 / 1.34 / 1.28, delta
# rule 3.11 / 2.96 / 2.96 / 3.10.
ATTENTION_WARPS = 8
GDR_WARPS = 4
CONV_WARPS = 8

# Query rows (query token x query head of the KV head) past which Q queries (MTP verification) no
# longer share one plain 2D dot. The one-token kernel holds GROUP rows (padded to 16); on Hopper a
# dot of up to 32 rows runs the one-token kernel's mma.sync instructions with the same warp layout
# (8 warps across the keys), so each row sums in the same order, while from 64 rows Triton takes
# Hopper's wgmma path, whose rounding differs (up to 1e-3, session 40). Past ROW_TILE rows, a
# (request, KV head) takes ceil(Q / (ROW_TILE // GROUP)) programs (row tiles) of whole query tokens,
# each at most 32 rows, with its own partials and ticket; each tile reads the keys (an H100 measured
# every row equal to plain decode, GROUP 8 at Q = 5 and GROUP 16 at Q = 3 / 4, bf16 and FP8 caches;
# faster than one 64-row tile at batch 1, slower at batch 16: docs/PERFORMANCE.md, session 41). One
# program with every row in `[1, R, D] x [1, D, N]` batched dots (mma.sync, the keys read once) was
# 57-97x slower on an H100 (session 42) and is gone. A GROUP above 32 (no Qwen model) takes one
# query token a tile: the one-token kernel's own GROUP-row tile (equal on an H100 at GROUP 64, bf16).
ROW_TILE = 32


# The block table's row stride follows the width of the table it is given: the decode graphs' fixed
# one, or a mixed step's (paged_attention's groups of decodes). Unspecialised, one compile serves
# both (triton_moe.COUNT_ARGS says why).
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, gate_ptr, out_ptr, scale,
    part_acc_ptr, part_ml_ptr, ticket_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_gt, stride_gh, stride_ot, stride_oh,
    QUERIES: tl.constexpr, GROUP: tl.constexpr, ROWS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    GATED: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr, TILE_Q: tl.constexpr, TILES: tl.constexpr,
):
    wait_for_producer(PDL)
    req = tl.program_id(0)
    if TILES == 1:  # every query row in one program (the one-token kernel; Q x GROUP <= ROW_TILE)
        kv_head = tl.program_id(1)
        first_tok = 0
    else:  # program_id(1) = kv_head * TILES + tile; the tile holds query tokens tile * TILE_Q ..
        kv_head = tl.program_id(1) // TILES
        first_tok = (tl.program_id(1) % TILES) * TILE_Q
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    num_blocks = tl.cdiv(seq_len, BLOCK_N)
    num_parts = tl.minimum(num_blocks, SPLITS)  # programs with at least one key block
    if split >= num_parts:
        return
    offs_r = tl.arange(0, ROWS_PAD)  # row r: query token first_tok + r // GROUP of the request, head r % GROUP of this KV head
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = first_tok + offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    tokens = req * QUERIES + tok  # [R] flat token of each row
    if TILES == 1:
        r_ok = offs_r < QUERIES * GROUP
    else:  # the tile's own tokens (the last tile may hold fewer)
        r_ok = (offs_r < TILE_Q * GROUP) & (tok < QUERIES)
    d_ok = offs_d < HEAD_DIM
    rd_ok = r_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=rd_ok, other=0.0)  # [R, D]
    q_pos = seq_len - QUERIES + tok  # [R]: the query's position; it reads keys 0..q_pos
    m_i = tl.full([ROWS_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS_PAD], tl.float32)
    acc = tl.zeros([ROWS_PAD, BLOCK_D], tl.float32)
    for block_index in range(split, num_blocks, SPLITS):
        pos = block_index * BLOCK_N + offs_n  # [N]
        n_ok = pos < seq_len
        block = tl.load(block_tables_ptr + req * stride_bt + pos // PAGE_SIZE, mask=n_ok, other=0)
        row = pos % PAGE_SIZE
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + row[:, None] * stride_ks + kv_head * stride_kh
                    + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # [N, D] (an FP8 cache: converted)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [R, N]
        if QUERIES == 1:
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = m_new  # finite: a program's first block holds a key of every row
        else:  # causal inside the Q: an early query's keys may all lie past it in this program's blocks
            s = tl.where(n_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # such a row keeps l = 0, acc = 0, m = -inf
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + row[:, None] * stride_vs + kv_head * stride_vh
                    + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # [N, D] (an FP8 cache: converted)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLITS > 1:
        # This program's partial (running max, sum, unnormalised output) for the last program of the
        # (request, KV head, row tile) to combine, in split order: deterministic. Each row tile has
        # its own partials and ticket, and combines its own rows.
        head_index = req * tl.num_programs(1) + tl.program_id(1)
        acc_base = part_acc_ptr + head_index * SPLITS * ROWS_PAD * BLOCK_D  # [SPLITS, R, D] float32
        ml_base = part_ml_ptr + head_index * SPLITS * 2 * ROWS_PAD  # [SPLITS, 2, R] float32
        tl.store(acc_base + split * ROWS_PAD * BLOCK_D + offs_r[:, None] * BLOCK_D + offs_d[None, :], acc,
                 mask=r_ok[:, None])  # the padding rows are never read
        tl.store(ml_base + split * 2 * ROWS_PAD + offs_r, m_i)
        tl.store(ml_base + split * 2 * ROWS_PAD + ROWS_PAD + offs_r, l_i)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        done = tl.atomic_add(ticket_ptr + head_index, 1, sem="acq_rel")  # release ours, acquire the others'
        if done != num_parts - 1:
            return
        tl.atomic_xchg(ticket_ptr + head_index, 0)  # ready for the next call (and the next graph replay)
        offs_s = tl.arange(0, SPLITS)
        s_ok = offs_s < num_parts
        m_all = tl.load(ml_base + offs_s[:, None] * 2 * ROWS_PAD + offs_r[None, :], mask=s_ok[:, None],
                        other=float("-inf"), cache_modifier=".cg")  # [S, R]
        m_i = tl.max(m_all, axis=0)  # [R]: finite, split 0 holds key 0
        l_i = tl.zeros([ROWS_PAD], tl.float32)
        acc = tl.zeros([ROWS_PAD, BLOCK_D], tl.float32)
        # Unrolled over every split, the absent ones masked off (they add exactly 0, as does a split
        # whose keys all lie past a row: m = -inf there): straight-line code whose loads the
        # compiler may issue ahead of the sums, in split order as before.
        for j in tl.static_range(SPLITS):
            live = r_ok & ((offs_r * 0 + j) < num_parts)  # [R]
            m_j = tl.load(ml_base + j * 2 * ROWS_PAD + offs_r, mask=live, other=0.0, cache_modifier=".cg")
            l_j = tl.load(ml_base + j * 2 * ROWS_PAD + ROWS_PAD + offs_r, mask=live, other=0.0, cache_modifier=".cg")
            w_j = tl.where(live, tl.exp(m_j - m_i), 0.0)  # [R]
            l_i += w_j * l_j
            acc += w_j[:, None] * tl.load(acc_base + j * ROWS_PAD * BLOCK_D + offs_r[:, None] * BLOCK_D + offs_d[None, :],
                                          mask=live[:, None], other=0.0, cache_modifier=".cg")
    dtype = out_ptr.dtype.element_ty
    l_i = tl.where(r_ok, l_i, 1.0)
    out = (acc / l_i[:, None]).to(dtype)
    if GATED:  # the output gate: attn * sigmoid(gate), rounded as the layer's torch ops round
        gate = tl.load(gate_ptr + tokens[:, None] * stride_gt + heads[:, None] * stride_gh + offs_d[None, :],
                       mask=rd_ok, other=0.0).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = (out.to(tl.float32) * gate).to(dtype)
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out, mask=rd_ok)


# Keys a program's loop iteration takes, and Triton's pipeline stages over an FP8 cache (None: Triton's
# default; neither changes what is computed in which order beyond BLOCK_N's own grouping, and neither
# depends on the batch). An H100 timed them at head dim 256, 16 splits, 8 warps, per layer (session 39,
# benchmarks/results/decode_attention_kv_h100_s39.json): 64 keys against 32 took bf16 batch 1 at 4k /
# 16k context from 23.8 / 69.4 to 18.9 / 50.5 us and batch 32 from 116.2 / 389.6 to 114.4 / 369.3 us;
# over an FP8 cache 2 stages took batch 32 from 111.9 / 383.0 us (32 keys) to 90.2 / 286.2 us, for
# 0.5-2.4 us more at batch 1 (19.7 / 54.0 against 19.2 / 51.6 us).
DECODE_ATTENTION_BLOCK_N = 64
FP8_CACHE_STAGES = 2


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, gate: torch.Tensor | None = None, splits: int | None = None,
    num_warps: int | None = None, block_n: int | None = None, num_stages: int | None = None, queries: int = 1,
) -> torch.Tensor:
    """q `[B*Q, Hq, D]` (Q = `queries` consecutive query tokens per request, request-major, at
    positions seq_lens[b] - Q .. seq_lens[b] - 1, causal inside the Q; unit last stride); caches
    `[num_blocks, block_size, Hkv, D]` holding this step's keys; block_tables `[B, >= pages]`;
    seq_lens `[B]` (>= Q); gate: optional `[B*Q, Hq, D]`, the output becomes attn * sigmoid(gate);
    `splits` (a power of two): programs per (request, KV head), by default ATTENTION_SPLITS
    (INTERPRETER_ATTENTION_SPLITS under Triton's interpreter); `num_warps`, `block_n` (keys a loop
    iteration) and `num_stages` override ATTENTION_WARPS, DECODE_ATTENTION_BLOCK_N and the stages
    (FP8_CACHE_STAGES over an FP8 cache, else Triton's default).
    Each query row runs the one-token computation at its own position: the same blocks in the same
    programs, the keys past it adding exactly zero, its dots in the one-token kernel's MMA
    instructions past ROW_TILE rows too (row tiles), so every row equals the one-token kernel's bit
    for bit (measured on an H100 at 8 and 16 query heads a KV head, Q up to 5).
    Returns `[B*Q, Hq, D]` in q's dtype."""
    num_tokens, num_q_heads, head_dim = q.shape
    bsz = num_tokens // queries
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if splits is None:
        splits = INTERPRETER_ATTENTION_SPLITS if triton_interpreted() else ATTENTION_SPLITS
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"paged_decode_attention: splits = {splits} must be a power of two")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    gated = gate is not None
    gate = gate if gated else q
    tile_q = min(queries, max(1, ROW_TILE // group))  # query tokens a row tile (all of them up to ROW_TILE rows)
    tiles = triton.cdiv(queries, tile_q)
    rows_pad, block_d = max(16, triton.next_power_of_2(tile_q * group)), triton.next_power_of_2(head_dim)
    programs = bsz * num_kv_heads * tiles  # (request, KV head, row tile)s, each over `splits` programs
    if splits > 1:
        from lamina.kernels.triton_moe_gemv import _tickets

        part_acc = torch.empty(programs * splits * rows_pad * block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(programs * splits * 2 * rows_pad, dtype=torch.float32, device=q.device)
        tickets = _tickets(q.device, programs)
    else:
        part_acc = part_ml = tickets = out  # unused
    if num_stages is None and k_cache.dtype in FP8_DTYPES:
        num_stages = FP8_CACHE_STAGES
    _paged_decode_attention_kernel[(bsz, num_kv_heads * tiles, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, gate, out, scale, part_acc, part_ml, tickets,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), gate.stride(0), gate.stride(1),
        out.stride(0), out.stride(1),
        QUERIES=queries, GROUP=group, ROWS_PAD=rows_pad, HEAD_DIM=head_dim,
        BLOCK_D=block_d, PAGE_SIZE=page_size, BLOCK_N=block_n or DECODE_ATTENTION_BLOCK_N,
        PRECISION=_dot_precision(q.dtype), GATED=gated, SPLITS=splits, TILE_Q=tile_q, TILES=tiles,
        **pdl_kwargs(q.device), num_warps=num_warps or ATTENTION_WARPS, **FP_FUSION,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return out


# ---- gated delta rule, one token per request ---------------------------------------------------------


@triton.jit
def _gdr_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, keep_ptr, out_ptr,
    scale, eps,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_bb,
    stride_ss, stride_sh, stride_sk, stride_ob, stride_oh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr, RAW_GATES: tl.constexpr, PDL: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    k_head = head // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    # The state tile is read before the wait for the producer (lamina.kernels.pdl): the slots are
    # step metadata and the state was last written by this layer's previous step, never by the
    # kernel just before this one (the causal conv).
    slot = tl.load(slots_ptr + req)
    keep = tl.load(keep_ptr + req)
    s_ptrs = state_ptr + slot * stride_ss + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    s_ok = k_ok[:, None] & v_ok[None, :]
    state = tl.load(s_ptrs, mask=s_ok, other=0.0).to(tl.float32)  # [K, V]
    wait_for_producer(PDL)
    q = tl.load(q_ptr + req * stride_qb + k_head * stride_qh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + req * stride_kb + k_head * stride_kh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q) + eps)
        k = k * tl.rsqrt(tl.sum(k * k) + eps)
    q = q * scale
    v = tl.load(v_ptr + req * stride_vb + head * stride_vh + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + req * stride_gb + head).to(tl.float32)
    beta = tl.load(beta_ptr + req * stride_bb + head).to(tl.float32)
    if RAW_GATES:  # g holds `a`, beta holds `b` of the projection: the layer's gate math, fused
        a = g + tl.load(dt_bias_ptr + head).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus
        beta = 1.0 / (1.0 + tl.exp(-beta))
    state = tl.where(keep != 0, state, 0.0) * tl.exp(g)
    delta = beta * (v - tl.sum(state * k[:, None], axis=0))  # [V]
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], axis=0)  # [V]
    tl.debug_barrier()  # the whole tile was read before any lane writes it back
    tl.store(s_ptrs, state, mask=s_ok)
    tl.store(out_ptr + req * stride_ob + head * stride_oh + offs_v, out.to(out_ptr.dtype.element_ty), mask=v_ok)


def gated_delta_rule_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, use_qk_l2norm: bool = True,
    *, a_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, num_warps: int | None = None,
) -> torch.Tensor:
    """q, k `[B, Hk, Dk]`; v `[B, Hv, Dv]` (any strides with a unit last one); g, beta `[B, Hv]`;
    state_pool `[num_slots, Hv, Dk, Dv]` (float32, bfloat16 or float16; computed in float32), updated in place
    at `slots [B]` (a row with `keep[b]` False starts from zeros). With `a_log` and `dt_bias` `[Hv]`, g and beta
    are the raw projections `a` and `b`, and the gates g = -exp(A_log) * softplus(a + dt_bias), beta =
    sigmoid(b) are computed in the kernel; `num_warps` overrides GDR_WARPS (benchmarks). Returns the output
    `[B, Hv, Dv]` in v's dtype."""
    bsz, num_v_heads, head_v_dim = v.shape
    num_k_heads, head_k_dim = k.shape[1], k.shape[2]
    out = torch.empty((bsz, num_v_heads, head_v_dim), dtype=v.dtype, device=v.device)
    if bsz == 0:
        return out
    raw = a_log is not None
    block_v = min(32, triton.next_power_of_2(head_v_dim))
    grid = (bsz, num_v_heads, triton.cdiv(head_v_dim, block_v))
    _gdr_decode_kernel[grid](
        q, k, v, g, beta, a_log if raw else g, dt_bias if raw else g, state_pool, slots, keep, out,
        head_k_dim**-0.5, 1e-6,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), out.stride(0), out.stride(1),
        GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        BLOCK_K=triton.next_power_of_2(head_k_dim), BLOCK_V=block_v, L2NORM=use_qk_l2norm, RAW_GATES=raw,
        **pdl_kwargs(v.device), num_warps=num_warps or GDR_WARPS, **FP_FUSION,
    )
    return out


# ---- causal conv1d, one token per request ---------------------------------------------------------


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, keep_ptr, out_ptr, channels,
    stride_xb, stride_wc, stride_ss, stride_sc, stride_ob,
    KERNEL: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr,
):
    req = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, BLOCK_J)
    c_ok = offs_c < channels
    # The weights and the state rows are read before the wait for the producer of x
    # (lamina.kernels.pdl): the slots are step metadata and the state was last written by this
    # layer's previous step, never by the kernel just before this one (the in_proj GEMV).
    slot = tl.load(slots_ptr + req)
    keep = tl.load(keep_ptr + req)
    row = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
    # seq = [state (K-1 inputs), x]; tap j reads seq[j].
    from_state = c_ok[:, None] & (offs_j[None, :] < KERNEL - 1)
    seq = tl.load(row + offs_j[None, :], mask=from_state, other=0.0)
    # New state: seq[1:K], read as shifted loads (registers cannot be shifted across lanes).
    shifted = tl.load(row + offs_j[None, :] + 1, mask=c_ok[:, None] & (offs_j[None, :] + 1 < KERNEL - 1), other=0.0)
    w = tl.load(w_ptr + offs_c[:, None] * stride_wc + offs_j[None, :],
                mask=c_ok[:, None] & (offs_j[None, :] < KERNEL), other=0.0).to(tl.float32)
    wait_for_producer(PDL)
    x = tl.load(x_ptr + req * stride_xb + offs_c, mask=c_ok, other=0.0)  # [C]
    seq = tl.where(keep != 0, seq, 0.0).to(tl.float32)
    seq = tl.where(offs_j[None, :] == KERNEL - 1, x[:, None].to(tl.float32), seq)  # [C, J]
    y = tl.sum(seq * w, axis=1)  # [C]
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    shifted = tl.where(keep != 0, shifted, 0.0)
    shifted = tl.where(offs_j[None, :] + 1 == KERNEL - 1, x[:, None].to(shifted.dtype), shifted)
    tl.debug_barrier()  # every lane has read the old state before any writes it
    tl.store(row + offs_j[None, :], shifted, mask=c_ok[:, None] & (offs_j[None, :] < KERNEL - 1))
    tl.store(out_ptr + req * stride_ob + offs_c, y.to(out_ptr.dtype.element_ty), mask=c_ok)


def causal_conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
    activation: str | None = "silu", num_warps: int | None = None,
) -> torch.Tensor:
    """x `[B, C]` (one token per request, rows may be strided); weight `[C, K]`; state_pool `[num_slots, C, K-1]`,
    updated in place at `slots [B]` (`keep[b]` False: the request starts from zeros); `num_warps`
    overrides CONV_WARPS (benchmarks). Returns `[B, C]` in x's dtype."""
    bsz, channels = x.shape
    kernel = weight.shape[1]
    out = torch.empty((bsz, channels), dtype=x.dtype, device=x.device)
    if bsz == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    block_c = 256
    _conv_decode_kernel[(bsz, triton.cdiv(channels, block_c))](
        x, weight, state_pool, slots, keep, out, channels,
        x.stride(0), weight.stride(0), state_pool.stride(0), state_pool.stride(1), out.stride(0),
        KERNEL=kernel, BLOCK_J=triton.next_power_of_2(kernel), BLOCK_C=block_c, SILU=activation in ("silu", "swish"),
        **pdl_kwargs(x.device), num_warps=num_warps or CONV_WARPS, **FP_FUSION,
    )
    return out

"""MoE pair alignment: `align_pairs` sorts a step's (token, expert) pairs by local expert, stable,
each expert's rows padded to whole row blocks, for the grouped MoE kernels (`triton_moe`).

Up to 4,096 pairs one program does it (`_align_kernel`: a bitonic sort of (expert, pair) keys in
registers and lane shuffles). Beyond that the torch form (`_align_torch`, the reference) took ~50
launches per MoE layer (an int64 radix sort of 8 passes, scans, fills, memsets): in a 2,048-token
prompt chunk of the Qwen3.5-35B-A3B shape more than half of the step's 3,800 launches
(benchmarks/results/profile_prefill_16k_chunked_h200.json), 410 us per call eagerly on an H200 at
16,384 pairs and 142 us in a CUDA graph (bench_align_prefill_h200.json; 72 and 46 us here with
512-pair blocks, 19 us in a graph with the 256-pair blocks now used: bench_align_block_p_h200.json).
So long chunks take `align_pairs_blocked`, three launches of many programs.
Here, with the pairs cut into blocks of BLOCK_P:

1. `_align_count_kernel`, one program per block: the block's pairs per local expert
   `counts [B, E_PAD]`; the program also fills its share of the rows with the padding value.
2. `_align_offsets_kernel`, one program: the experts' totals, padded to BLOCK_M rows, their
   exclusive scan (each expert's first row) and, per block, where its pairs of each expert start:
   `base[b, e]` = first row of e + e's pairs in the blocks before b (`padded_end [E_PAD]` too).
3. `_align_scatter_kernel`, one program per block: each local pair's row is `base[b, e]` plus the
   number of earlier pairs of its block with the same expert (pair order: the stable order); then
   the expert of each of its share of row blocks (how many experts' padded rows end at or before
   the block's first row; -1 past the last real block).

Every shape comes from host ints, nothing syncs, and the result is `_align_torch`'s, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.pdl import pdl_kwargs, wait_for_producer
from lamina.kernels.selection import moe_align_blocked

__all__ = ["BLOCK_P", "MAX_EXPERTS", "align_pairs", "align_pairs_blocked"]

BLOCK_P = 256  # pairs per program of the count and scatter kernels (bench_align_block_p_h200.json: 19 / 44 us at 16k / 64k pairs, 46 / 57 at 512)
MAX_EXPERTS = 1024  # local experts: up to this the [E_PAD] histogram and scans stay in one program's registers
_SUB = 32  # pairs per compare tile of the scatter
_FILL = 1024  # rows per store of the padding fill
_SCAN_TILE = 4096  # elements of a [blocks, E_PAD] tile of the offsets scan (16 blocks at 256 experts)
_SEARCH_TILE = 8192  # elements of a [row blocks, E_PAD] tile of the block-expert search (32 row blocks at 256 experts)


# Counts that vary with the step's size are left unspecialised: one compile for every size
# (triton_moe.COUNT_ARGS says why).
@triton.jit(do_not_specialize=["num_pairs", "max_rows", "rows_per_program"])
def _align_count_kernel(ids_ptr, counts_ptr, sorted_pairs_ptr, num_pairs, max_rows, rows_per_program,
                        expert_start, num_experts,
                        BLOCK_P: tl.constexpr, E_PAD: tl.constexpr, FILL: tl.constexpr,
                        PDL: tl.constexpr):
    wait_for_producer(PDL)
    pid = tl.program_id(0)
    # This program's rows get the padding value (the scatter overwrites the real ones later).
    fill = tl.arange(0, FILL)
    first_row = pid * rows_per_program
    for r0 in range(0, rows_per_program, FILL):
        rows = first_row + r0 + fill  # [FILL]
        ok = (rows < max_rows) & (r0 + fill < rows_per_program)
        tl.store(sorted_pairs_ptr + rows, tl.zeros([FILL], tl.int32) + num_pairs, mask=ok)
    # The block's pairs per local expert: the other pairs (non-local, past the end) are counted in
    # bin 0 (a histogram's values must lie in [0, E_PAD)) and taken out again.
    experts = tl.arange(0, E_PAD)  # [E_PAD]
    pairs = pid * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    valid = pairs < num_pairs
    e = tl.load(ids_ptr + pairs, mask=valid, other=0).to(tl.int32) - expert_start  # [BLOCK_P]
    local = valid & (e >= 0) & (e < num_experts)
    not_local = BLOCK_P - tl.sum(local.to(tl.int32), axis=0)
    counts = tl.histogram(tl.where(local, e, 0), E_PAD) - tl.where(experts == 0, not_local, 0)  # [E_PAD]
    tl.store(counts_ptr + pid * E_PAD + experts, counts)


@triton.jit(do_not_specialize=["num_blocks"])
def _align_offsets_kernel(counts_ptr, base_ptr, padded_end_ptr, num_blocks,
                          BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, NB_TILE: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    experts = tl.arange(0, E_PAD)  # [E_PAD]
    lanes = tl.arange(0, NB_TILE)  # [NB_TILE]
    total = tl.zeros([E_PAD], tl.int32)
    for b0 in range(0, num_blocks, NB_TILE):
        blocks = b0 + lanes  # [NB_TILE]
        c = tl.load(counts_ptr + blocks[:, None] * E_PAD + experts[None, :], mask=(blocks < num_blocks)[:, None],
                    other=0)  # [NB_TILE, E_PAD]
        total += tl.sum(c, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]: 0 for lanes past the experts
    padded_end = tl.cumsum(padded, axis=0)  # [E_PAD]
    tl.store(padded_end_ptr + experts, padded_end)
    run = padded_end - padded  # [E_PAD]: each expert's first row, then past the blocks so far
    for b0 in range(0, num_blocks, NB_TILE):
        blocks = b0 + lanes  # [NB_TILE]
        ok = (blocks < num_blocks)[:, None]
        c = tl.load(counts_ptr + blocks[:, None] * E_PAD + experts[None, :], mask=ok, other=0)  # [NB_TILE, E_PAD]
        tl.store(base_ptr + blocks[:, None] * E_PAD + experts[None, :], tl.cumsum(c, axis=0) - c + run[None, :], mask=ok)
        run += tl.sum(c, axis=0)


@triton.jit(do_not_specialize=["num_pairs", "row_blocks_per_program", "num_row_blocks"])
def _align_scatter_kernel(ids_ptr, base_ptr, padded_end_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs,
                          row_blocks_per_program, num_row_blocks, expert_start, num_experts,
                          BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, SUB: tl.constexpr,
                          JB_TILE: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    pid = tl.program_id(0)
    pairs = pid * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    valid = pairs < num_pairs
    e = tl.load(ids_ptr + pairs, mask=valid, other=0).to(tl.int32) - expert_start  # [BLOCK_P]
    local = valid & (e >= 0) & (e < num_experts)
    key = tl.where(local, e, -1)  # [BLOCK_P]
    rank = tl.zeros([BLOCK_P], tl.int32)  # earlier pairs of this block with the same expert
    for s in range(0, BLOCK_P, SUB):
        other = pid * BLOCK_P + s + tl.arange(0, SUB)  # [SUB]
        other_ok = other < num_pairs
        oe = tl.load(ids_ptr + other, mask=other_ok, other=0).to(tl.int32) - expert_start  # [SUB]
        okey = tl.where(other_ok & (oe >= 0) & (oe < num_experts), oe, -2)  # [SUB]: never a local key
        same = (okey[None, :] == key[:, None]) & (other[None, :] < pairs[:, None])  # [BLOCK_P, SUB]
        rank += tl.sum(same.to(tl.int32), axis=1)
    row = tl.load(base_ptr + pid * E_PAD + tl.where(local, e, 0), mask=local, other=0) + rank  # [BLOCK_P]
    tl.store(sorted_pairs_ptr + row, pairs, mask=local)
    # The expert of this program's row blocks: searchsorted(padded_end, first row, right=True).
    experts = tl.arange(0, E_PAD)
    ends = tl.load(padded_end_ptr + experts)  # [E_PAD]; lanes past the experts repeat the last end
    lanes = tl.arange(0, JB_TILE)
    for j0 in range(0, row_blocks_per_program, JB_TILE):
        jb = pid * row_blocks_per_program + j0 + lanes  # [JB_TILE]
        ok = (jb < num_row_blocks) & (j0 + lanes < row_blocks_per_program)
        before = tl.sum((ends[None, :] <= (jb * BLOCK_M)[:, None]).to(tl.int32), axis=1)  # [JB_TILE]
        tl.store(block_expert_ptr + jb, tl.where(before < num_experts, before, -1), mask=ok)


def align_pairs_blocked(topk_ids: torch.Tensor, num_local_experts: int, expert_start: int, block_m: int,
                        max_rows: int, block_p: int = BLOCK_P) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` for any pair count (1 <= E_local <= MAX_EXPERTS): three launches,
    `max_rows` = R from `_max_rows`. Returns (sorted_pairs `[R]` int32, block_expert
    `[R / block_m]` int32)."""
    if not 0 < num_local_experts <= MAX_EXPERTS:
        raise ValueError(f"align_pairs_blocked: {num_local_experts} local experts, at most {MAX_EXPERTS}")
    device = topk_ids.device
    ids = topk_ids.reshape(-1)  # [P]
    num_pairs = ids.numel()
    num_blocks = max(1, triton.cdiv(num_pairs, block_p))
    num_row_blocks = max_rows // block_m
    e_pad = triton.next_power_of_2(num_local_experts)
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=device)  # [R]
    block_expert = torch.empty(num_row_blocks, dtype=torch.int32, device=device)  # [R / block_m]
    counts = torch.empty(num_blocks, e_pad, dtype=torch.int32, device=device)  # [B, E_PAD]
    base = torch.empty(num_blocks, e_pad, dtype=torch.int32, device=device)  # [B, E_PAD]
    padded_end = torch.empty(e_pad, dtype=torch.int32, device=device)  # [E_PAD]
    pdl = pdl_kwargs(device)
    _align_count_kernel[(num_blocks,)](
        ids, counts, sorted_pairs, num_pairs, max_rows, triton.cdiv(max_rows, num_blocks),
        expert_start, num_local_experts, BLOCK_P=block_p, E_PAD=e_pad, FILL=_FILL, **pdl, num_warps=4, **FP_FUSION,
    )
    _align_offsets_kernel[(1,)](counts, base, padded_end, num_blocks, BLOCK_M=block_m, E_PAD=e_pad,
                                NB_TILE=max(1, min(16, _SCAN_TILE // e_pad)), **pdl, num_warps=4, **FP_FUSION)
    _align_scatter_kernel[(num_blocks,)](
        ids, base, padded_end, sorted_pairs, block_expert, num_pairs,
        triton.cdiv(num_row_blocks, num_blocks), num_row_blocks, expert_start, num_local_experts,
        BLOCK_P=block_p, BLOCK_M=block_m, E_PAD=e_pad, SUB=_SUB, JB_TILE=max(1, min(32, _SEARCH_TILE // e_pad)),
        **pdl, num_warps=4, **FP_FUSION,
    )
    return sorted_pairs, block_expert


# ---- the dispatch, the one-program sort and the torch form ---------------------------------------

# Up to this many (token, expert) pairs the alignment runs as one Triton program (one launch);
# beyond it (prefill chunks) as three launches of many programs (`align_pairs_blocked`), or
# with LAMINA_MOE_ALIGN=torch as ~50 torch launches (`_align_torch`, also the tests' reference).
ALIGN_IN_ONE_PROGRAM_MAX_PAIRS = 4096


def _max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    return -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m) * block_m


def align_pairs(topk_ids: torch.Tensor, num_local_experts: int, expert_start: int, block_m: int):
    """Sort the `P = T*k` pairs by local expert (stable: pair order inside an expert), padded per
    expert to whole row blocks.

    Returns:
        sorted_pairs `[R]` int32: pair index per row (P on padding rows); block_expert
        `[R / block_m]` int32: the local expert of each row block, -1 past the last real block.
        R = P + min(P, E_local) * (block_m - 1), rounded up to block_m (host ints only).
    """
    num_pairs = topk_ids.numel()
    if 0 < num_pairs <= ALIGN_IN_ONE_PROGRAM_MAX_PAIRS and num_local_experts <= 1024:
        return _align_one_program(topk_ids, num_local_experts, expert_start, block_m)
    if 0 < num_pairs and num_local_experts <= MAX_EXPERTS and moe_align_blocked():
        return align_pairs_blocked(topk_ids, num_local_experts, expert_start, block_m,
                                   _max_rows(num_pairs, num_local_experts, block_m))
    return _align_torch(topk_ids, num_local_experts, expert_start, block_m)


@triton.jit
def _add_combine(a, b):
    return a + b


# The combine function of `tl.sum` where Triton has it under this name (3.9 does): the same IR as
# ours on a GPU, but TRITON_INTERPRET recognises it and reduces with NumPy instead of calling the
# combine function element by element in Python.
_ADD = getattr(tl.standard, "_sum_combine", _add_combine)


@triton.jit
def _sort_unique(x, LOG_N: tl.constexpr, REG_BITS: tl.constexpr):
    """Ascending bitonic sort of `x` `[2**LOG_N]` (int32, every |value| < 2**30), as `tl.sort`
    does it: `x` as a `[2] * LOG_N` hypercube, one compare-and-swap step per (stage, bit), each a
    reduction over the size-2 axis of that bit. Two differences:

    - the reduction is a sum (partner = sum - self; `tl.sort` xors): the same work on a GPU, but
      NumPy-fast under TRITON_INTERPRET, where the xor reduction runs element by element in
      Python (seconds for 512 keys); `tl.reduce`, not `tl.sum`, because the interpreter spends
      ~5 ms on each call of a jitted helper;
    - sorted position p is not the flat index f but f rotated left by REG_BITS bits. Triton's
      default layout here (one element per thread, checked in the sm_90 TTGIR of Triton 3.9) puts
      f's low 5 bits on lanes, the next log2(warps) on warps and the top REG_BITS = LOG_N - 5 -
      log2(warps) bits in registers; rotated, p's low bits, which the network compares most often
      (bit b in LOG_N - b steps), are the in-register ones and p's top bits the cross-warp ones
      (through shared memory, with barriers). At 512 keys on 4 warps: 17 in-register, 25 shuffle
      and 3 cross-warp steps instead of 3, 35 and 7 (sm_90 SASS: 122 shuffles and 21 barriers
      instead of 178 and 37). Any REG_BITS sorts correctly; it only moves work between registers,
      lanes and warps.

    Returns (keys, p), both `[2**LOG_N]` in the flat order: keys[i] is the p[i]-th smallest."""
    h = tl.reshape(x, [2] * LOG_N)
    flat = tl.reshape(tl.arange(0, x.shape[0]), [2] * LOG_N)  # flat index of each hypercube element
    pos = ((flat << REG_BITS) | (flat >> (LOG_N - REG_BITS))) & (x.shape[0] - 1)  # its sorted position
    for stage in tl.static_range(1, LOG_N + 1):  # sorted runs of 2**stage; runs with bit `stage` set
        for step in tl.static_range(stage):  # descend (none in the last stage: pos < 2**LOG_N)
            # Compare-and-swap the elements whose positions differ in bit b = stage - 1 - step: flat
            # bit b - REG_BITS (axis LOG_N - 1 - b + REG_BITS) or, for b < REG_BITS, flat bit
            # LOG_N - REG_BITS + b (axis REG_BITS - 1 - b). Inline: a constexpr assigned to a local
            # becomes a tensor.
            if stage - 1 - step < REG_BITS:
                partner = tl.reduce(h, REG_BITS - stage + step, _ADD, keep_dims=True) - h
            else:
                partner = tl.reduce(h, LOG_N + REG_BITS - stage + step, _ADD, keep_dims=True) - h
            take_hi = (((pos >> (stage - 1 - step)) ^ (pos >> stage)) & 1) != 0  # the larger one
            h = tl.where(take_hi, tl.maximum(h, partner), tl.minimum(h, partner))
    return tl.reshape(h, x.shape), tl.reshape(pos, x.shape)


@triton.jit(do_not_specialize=["num_pairs", "max_rows"])  # one compile for every pair count (see COUNT_ARGS)
def _align_kernel(ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, expert_start, num_experts, max_rows,
                  BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, LOG_P: tl.constexpr, REG_BITS: tl.constexpr,
                  E_PAD: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr):
    """`align_pairs` in one program (one launch, no host sync; every shape from host ints), for
    P <= P_PAD pairs and E <= E_PAD local experts. No [pairs, experts] tile: each step works on at
    most max(P_PAD, E_PAD, FILL) lanes.

    1. Fill: every row gets `num_pairs` (padding), every row block -1, FILL lanes per iteration
       (at most 2048: 3 iterations at 512 pairs over 256 experts, BLOCK_M 16: R = 4352 rows).
    2. Count: pairs per local expert (`tl.histogram`), the padding to a multiple of BLOCK_M of
       each, and one exclusive scan over experts: shift[e] = padding rows of the experts before e
       = (padded start of e's rows) - (local pairs of experts before e).
    3. Sort the keys `local_expert << LOG_P | pair` (non-local pairs and lanes >= P get expert E,
       after every local one; keys are distinct, so the order is fully determined). The pair in
       sorted position p with expert e is e's rank-th pair, p = (local pairs of experts before
       e) + rank, and rank follows pair order (the pair index is the key's low bits: the stable
       order `_align_torch` has): its row is p + shift[e] (a `tl.gather` of shift).
    4. After a barrier (the fill of step 1 lands first: same addresses, other threads), scatter
       each local pair to its row and its expert to its row's block. Every real block holds at
       least one real row (an expert pads fewer than BLOCK_M rows), so every real block is
       written; the pairs of one block write the same value.
    """
    wait_for_producer(PDL)
    # 1. Padding everywhere; real rows and blocks are overwritten in step 4.
    fill = tl.arange(0, FILL)
    for r0 in range(0, max_rows, FILL):
        rows = r0 + fill  # [FILL]
        tl.store(sorted_pairs_ptr + rows, tl.zeros([FILL], tl.int32) + num_pairs, mask=rows < max_rows)
    num_blocks = max_rows // BLOCK_M
    for b0 in range(0, num_blocks, FILL):
        blocks = b0 + fill  # [FILL]
        tl.store(block_expert_ptr + blocks, tl.full([FILL], -1, tl.int32), mask=blocks < num_blocks)
    # 2. Pairs per local expert; padding lanes and non-local pairs are counted in bin 0 (every
    # value must be in [0, E_PAD): the GPU histogram keeps only the low bits) and taken out again.
    lanes = tl.arange(0, P_PAD)  # [P_PAD] pair index
    valid = lanes < num_pairs
    e = tl.load(ids_ptr + lanes, mask=valid, other=0).to(tl.int32) - expert_start  # [P_PAD]
    local = valid & (e >= 0) & (e < num_experts)  # [P_PAD]
    experts = tl.arange(0, E_PAD)  # [E_PAD]
    not_local = P_PAD - tl.sum(local.to(tl.int32), axis=0)
    counts = tl.histogram(tl.where(local, e, 0), E_PAD) - tl.where(experts == 0, not_local, 0)  # [E_PAD]
    pad = (BLOCK_M - counts % BLOCK_M) % BLOCK_M  # [E_PAD] padding rows after each expert (0 past E)
    shift = tl.cumsum(pad, axis=0) - pad  # [E_PAD] padding rows of the experts before e
    # 3. Sort by (expert, pair); position = each sorted key's place in the sorted order.
    key, position = _sort_unique((tl.where(local, e, num_experts) << LOG_P) | lanes, LOG_P, REG_BITS)  # [P_PAD]
    sorted_expert = key >> LOG_P  # [P_PAD]
    sorted_pair = key & (P_PAD - 1)  # [P_PAD]
    is_local = sorted_expert < num_experts  # [P_PAD]: the local pairs are the first ones
    dest = position + tl.gather(shift, tl.minimum(sorted_expert, E_PAD - 1), axis=0)  # [P_PAD] row
    # 4. Scatter (after the fill: same addresses, other threads).
    tl.debug_barrier()
    tl.store(sorted_pairs_ptr + dest, sorted_pair, mask=is_local)
    tl.store(block_expert_ptr + dest // BLOCK_M, sorted_expert, mask=is_local)


def _align_warps(p_pad: int) -> int:
    """Warps of the align program for a sort of `p_pad` keys: one warp up to 128 (the whole sort in
    registers and lane shuffles, no barrier), more for longer sorts. From a count of in-register,
    shuffle and cross-warp sort steps (see `_sort_unique`), not yet from a GPU timing:
    benchmarks/bench_align.py --sweep times 1, 2, 4 and 8 warps."""
    return 1 if p_pad <= 128 else 2 if p_pad <= 256 else 4 if p_pad <= 2048 else 8


def _align_one_program(topk_ids: torch.Tensor, num_local_experts: int, expert_start: int, block_m: int,
                       num_warps: int | None = None):
    """`align_pairs` as one launch of `_align_kernel` (1 <= P <= 4096 pairs, E_local <= 1024)."""
    num_pairs = topk_ids.numel()
    max_rows = _max_rows(num_pairs, num_local_experts, block_m)
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=topk_ids.device)
    p_pad = max(32, triton.next_power_of_2(num_pairs))
    num_warps = num_warps or _align_warps(p_pad)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_pairs, block_expert, num_pairs, expert_start, num_local_experts, max_rows,
        BLOCK_M=block_m, P_PAD=p_pad, LOG_P=p_pad.bit_length() - 1,
        REG_BITS=max(0, p_pad.bit_length() - 1 - 5 - (num_warps.bit_length() - 1)),
        E_PAD=max(32, triton.next_power_of_2(num_local_experts)),
        # from P_PAD, not from this P: every constexpr follows the pair count's power-of-two bucket
        FILL=min(2048, max(128, triton.next_power_of_2(_max_rows(p_pad, num_local_experts, block_m)))),
        **pdl_kwargs(topk_ids.device), num_warps=num_warps, **FP_FUSION,
    )
    return sorted_pairs, block_expert


def _align_torch(topk_ids: torch.Tensor, num_local_experts: int, expert_start: int, block_m: int):
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    num_experts = num_local_experts
    max_rows = _max_rows(num_pairs, num_experts, block_m)
    local = topk_ids.reshape(-1).long() - expert_start  # [P]
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # [P]: E = not on this rank
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded  # [E]
    order = torch.argsort(key, stable=True)  # [P]
    sorted_key = key[order]  # [P]
    start_in_sorted = torch.cumsum(counts, 0) - counts  # [E+1]
    rank = torch.arange(num_pairs, device=device) - start_in_sorted[sorted_key]  # [P]
    dest = torch.where(
        sorted_key < num_experts, padded_start[sorted_key.clamp(max=num_experts - 1)] + rank, max_rows
    )  # [P]: non-local pairs go to a spare row that is cut off
    sorted_pairs = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.index_copy_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_rows, block_m, device=device)  # [R / block_m]
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)  # [R / block_m]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs[:max_rows], block_expert

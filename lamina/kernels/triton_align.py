"""MoE pair alignment for long prefill chunks: `align_pairs` in three launches of many programs.

`triton_moe.align_pairs` sorts a step's (token, expert) pairs by local expert, stable, each
expert's rows padded to whole row blocks. Up to 4,096 pairs one program does it
(`triton_moe._align_kernel`); beyond that the torch form (`triton_moe._align_torch`) took ~50
launches per MoE layer (an int64 radix sort of 8 passes, scans, fills, memsets): in a 2,048-token
prompt chunk of the Qwen3.5-35B-A3B shape more than half of the step's 3,800 launches
(benchmarks/results/profile_prefill_16k_chunked_h200.json), 410 us per call eagerly on an H200 at
16,384 pairs and 142 us in a CUDA graph (bench_align_prefill_h200.json; 72 and 46 us here with
512-pair blocks, 19 us in a graph with the 256-pair blocks now used: bench_align_block_p_h200.json).
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

from lamina.kernels.pdl import pdl_kwargs, wait_for_producer

__all__ = ["BLOCK_P", "MAX_EXPERTS", "align_pairs_blocked"]

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
    """`triton_moe.align_pairs` for any pair count (1 <= E_local <= MAX_EXPERTS): three launches,
    `max_rows` = R from `triton_moe._max_rows`. Returns (sorted_pairs `[R]` int32, block_expert
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
        expert_start, num_local_experts, BLOCK_P=block_p, E_PAD=e_pad, FILL=_FILL, **pdl, num_warps=4,
    )
    _align_offsets_kernel[(1,)](counts, base, padded_end, num_blocks, BLOCK_M=block_m, E_PAD=e_pad,
                                NB_TILE=max(1, min(16, _SCAN_TILE // e_pad)), **pdl, num_warps=4)
    _align_scatter_kernel[(num_blocks,)](
        ids, base, padded_end, sorted_pairs, block_expert, num_pairs,
        triton.cdiv(num_row_blocks, num_blocks), num_row_blocks, expert_start, num_local_experts,
        BLOCK_P=block_p, BLOCK_M=block_m, E_PAD=e_pad, SUB=_SUB, JB_TILE=max(1, min(32, _SEARCH_TILE // e_pad)),
        **pdl, num_warps=4,
    )
    return sorted_pairs, block_expert

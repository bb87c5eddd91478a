"""Fused MoE for a handful of tokens (decode): two GEMV launches, no sort, no separate k-slot sum.

At batch 1 the routed experts are a GEMV over 8 of 256 weight matrices. The grouped-GEMM path of
`lamina.kernels.triton_moe` sorts the (token, expert) pairs by expert first (one launch), runs
16-row `tl.dot` tiles of which one row is real, writes `[T, slots, H]` unweighted parts and sums
them, weighted, in one more launch. Here, for `T <= GEMV_MAX_TOKENS`:

1. gate/up: one program per (token, slot, tile of BLOCK_N intermediate rows) reads its expert id
   straight from `topk_ids` (slot k = the shared expert when it rides along) and writes
   `act[t, slot] = silu(x_t @ gate_e^T) * (x_t @ up_e^T)`; with `up_split` > 1 the hidden dim is
   split over that many programs whose float32 partials the last of them sums in split order;
2. down: one program per (token, tile of `down_n` output rows, group of `down_slots` slots)
   stepping through its slots' weights `down_k` intermediate columns at a time in one flat loop,
   with the group's expert ids read before it, so `down_stages` - 1 steps of loads stay in flight
   (the next slot's too). Each slot's product is weighted (routing weight, or the shared expert's
   sigmoid gate) in float32; with several groups the last program of a (token, tile) sums the
   groups' float32 partials in group order (an atomic ticket only decides who sums, the order is
   fixed: deterministic) and writes `[T, H]` in the output dtype once. (A slot loop with the
   whole intermediate dim per step, and one program per slot without a K loop, were the earlier
   kernels; they lost to this one at 1, 2 and 4 tokens on an H200 and are gone.)

The products are `tl.dot`s of a 16-row tile whose row 0 is the token (the rest zero): Triton
pipelines the weight loads that feed a dot (async copies into shared memory), which a plain
elementwise GEMV loop does not get; compute is free here, the weights' bytes are the cost.
`fma` configs (`GEMV_CONFIG_FMA`: the default at every token count) take two kernels without
`tl.dot` instead: gate/up one program per ((token, slot), up_n intermediate rows), down one program
per (token, down_n output rows) over every slot in slot order into one float32 accumulator (no
partials, no ticket), plain loads unrolled over the whole input, float32 products summed once per
row (the form of `lamina.kernels.triton_gemv`'s default GEMV). On an H200 faster at 1-4 tokens
since the down kernel stopped summing each slot on its own (a reduction, and its barrier, between
one slot's loads and the next's): 2.35 / 3.07 / 4.09 ms a step at batch 1 / 2 / 4 against 2.43 /
3.22 / 4.23 (session 17, docs/PERFORMANCE.md).
Experts of other EP ranks (ids outside this rank's range) contribute zero. Nothing syncs and every
shape is fixed by `T` and the weights: capturable in a CUDA graph.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from lamina.kernels.expert_scales import ExpertScales
from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.pdl import pdl_kwargs, wait_for_producer
from lamina.kernels.selection import moe_gemv_fma_max_tokens, triton_interpreted
from lamina.kernels.tile_fit import SM90_SHARED_MEMORY, shared_memory_limit

__all__ = ["GEMV_CONFIG", "GEMV_CONFIG_FMA", "GEMV_CONFIG_FMA_FP8", "GEMV_CONFIG_ONE_TOKEN", "GEMV_MAX_INTER", "GEMV_MAX_TOKENS",
           "fused_moe_gemv"]

# Up to this many tokens the GEMV kernels run (each (token, slot) reads its expert's weights; the
# shared expert is read once per token); beyond, the grouped GEMM reads each expert once per tile.
GEMV_MAX_TOKENS = 4


@triton.jit
def _slot_weights(slot, token, ids_ptr, w_ptr, shared_w_ptr, expert_start, num_local_experts, stride_we,
                  TOP_K: tl.constexpr):
    """(weight matrix base of this (token, slot), whether it holds a local expert). Slot TOP_K
    (when present) is the shared expert."""
    slot = tl.full([], 0, tl.int32) + slot  # a tensor in compiled and interpreted runs alike
    is_shared = slot == TOP_K
    expert = tl.load(ids_ptr + token * TOP_K + tl.minimum(slot, TOP_K - 1)).to(tl.int32) - expert_start
    local = (expert >= 0) & (expert < num_local_experts)
    base = tl.where(is_shared, shared_w_ptr, w_ptr + tl.where(local, expert, 0).to(tl.int64) * stride_we)
    return base, local | is_shared


@triton.jit
def _slot_scales(slot, token, ids_ptr, s_ptr, shared_s_ptr, expert_start, num_local_experts, stride_se,
                 TOP_K: tl.constexpr):
    """FP8 experts: the base of this (token, slot)'s block-scale matrix (as `_slot_weights`)."""
    slot = tl.full([], 0, tl.int32) + slot
    is_shared = slot == TOP_K
    expert = tl.load(ids_ptr + token * TOP_K + tl.minimum(slot, TOP_K - 1)).to(tl.int32) - expert_start
    local = (expert >= 0) & (expert < num_local_experts)
    return tl.where(is_shared, shared_s_ptr, s_ptr + tl.where(local, expert, 0).to(tl.int64) * stride_se)


@triton.jit
def _gate_up_row(ids_ptr, w_ptr, shared_w_ptr, expert_start, num_local_experts, stride_we,
                 TOP_K: tl.constexpr, SLOTS: tl.constexpr):
    """A gate/up program's (row = token * SLOTS + slot, token, slot, weight base, whether it holds
    a local expert): its row is program_id(0)."""
    row = tl.program_id(0)
    token = row // SLOTS
    slot = row % SLOTS
    base, ok = _slot_weights(slot, token, ids_ptr, w_ptr, shared_w_ptr, expert_start, num_local_experts,
                             stride_we, TOP_K)
    return row, token, slot, base, ok


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, shared_w_ptr, act_ptr, partial_ptr, counter_ptr,
    hidden, inter, expert_start, num_local_experts, k_per_split,
    stride_xt, stride_we, stride_wn, stride_swn,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """One program per ((token, slot), tile of BLOCK_N intermediate rows, part of the hidden dim):
    SPLIT parts of `k_per_split` columns (a multiple of BLOCK_K). With SPLIT > 1 each program
    writes its float32 gate and up partials and the last of a (row, tile) (an atomic ticket, as in
    the split down kernel) sums them in part order before the activation: deterministic."""
    wait_for_producer(PDL)
    row, token, slot, base, ok = _gate_up_row(ids_ptr, w_ptr, shared_w_ptr, expert_start, num_local_experts, stride_we,
                                              TOP_K, SLOTS)
    if ok:  # the same for every program of a row: a row of another rank's expert takes no ticket
        stride_n = tl.where(slot == TOP_K, stride_swn, stride_wn)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        first = tl.arange(0, 16)[:, None] == 0  # the token sits in row 0 of a 16-row tl.dot tile
        acc_gate = tl.zeros([16, BLOCK_N], tl.float32)
        acc_up = tl.zeros([16, BLOCK_N], tl.float32)
        if SPLIT == 1:
            k_begin = 0
            k_end = hidden
        else:
            k_begin = tl.program_id(2) * k_per_split
            k_end = tl.minimum(k_begin + k_per_split, hidden)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < hidden
            a = tl.load(x_ptr + token * stride_xt + k[None, :] + tl.zeros([16, 1], tl.int32), mask=first & k_ok[None, :],
                        other=0.0)  # [16, K]
            mask = k_ok[:, None] & n_ok[None, :]
            gate_w = tl.load(base + offs_n[None, :] * stride_n + k[:, None], mask=mask, other=0.0)  # [K, N]
            up_w = tl.load(base + (offs_n[None, :] + inter) * stride_n + k[:, None], mask=mask, other=0.0)
            acc_gate += tl.dot(a, gate_w, input_precision=PRECISION)
            acc_up += tl.dot(a, up_w, input_precision=PRECISION)
        gate = tl.sum(acc_gate, axis=0)  # [N]: rows 1..15 are zero
        up = tl.sum(acc_up, axis=0)
        if SPLIT > 1:
            parts_row = partial_ptr + row * (SPLIT * 2 * inter)  # partials [T*SLOTS, SPLIT, 2, I]
            tl.store(parts_row + tl.program_id(2) * (2 * inter) + offs_n, gate, mask=n_ok)
            tl.store(parts_row + tl.program_id(2) * (2 * inter) + inter + offs_n, up, mask=n_ok)
            tl.debug_barrier()  # every thread's partial is written before the ticket releases them
            ticket = counter_ptr + row * tl.num_programs(1) + tl.program_id(1)
            done = tl.atomic_add(ticket, 1, sem="acq_rel")
            if done == SPLIT - 1:
                offs_s = tl.arange(0, SPLIT_P2)
                at = parts_row + offs_s[:, None] * (2 * inter) + offs_n[None, :]  # [S, N]
                mask = (offs_s[:, None] < SPLIT) & n_ok[None, :]
                gate = tl.sum(tl.load(at, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
                up = tl.sum(tl.load(at + inter, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
                act = gate / (1.0 + tl.exp(-gate)) * up
                tl.store(act_ptr + row * inter + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_ok)
                tl.atomic_xchg(ticket, 0)  # ready for the next call (and the next graph replay)
        else:
            act = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(act_ptr + row * inter + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_down_pipelined_kernel(
    act_ptr, ids_ptr, topk_weights_ptr, w_ptr, shared_w_ptr, shared_logit_ptr, partial_ptr, counter_ptr, out_ptr,
    hidden, inter, expert_start, num_local_experts,
    stride_we, stride_wn, stride_swn, stride_sl, stride_ot,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (token, tile of BLOCK_N output rows, group of GROUP consecutive slots),
    stepping through its slots' [BLOCK_N, I] weight blocks BLOCK_K columns at a time in one flat
    loop of GROUP * K_STEPS steps, so the pipeliner (num_stages >= 2) keeps the next steps' loads,
    the next slot's included, in flight behind the current dot. The group's expert ids and weights
    are read once before the loop: no weight address in the loop waits on a load. The slots of a
    group accumulate in slot order in float32; with GROUPS > 1 the groups' partials are summed in
    group order by the last program of a (token, tile) (atomic ticket, reset after): deterministic."""
    wait_for_producer(PDL)
    token = tl.program_id(0)
    tile = tl.program_id(1)
    group = tl.program_id(2)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    first = tl.arange(0, 16)[:, None] == 0  # the token sits in row 0 of a 16-row tl.dot tile
    offs_j = tl.arange(0, GROUP_P2)
    slots = group * GROUP + offs_j  # [G]: this program's slots (slot TOP_K = the shared expert)
    ids_at = token * TOP_K + tl.minimum(slots, TOP_K - 1)
    experts = tl.load(ids_ptr + ids_at).to(tl.int32) - expert_start  # [G]
    is_shared = slots == TOP_K
    ok = (offs_j < GROUP) & (slots < SLOTS) & (is_shared | ((experts >= 0) & (experts < num_local_experts)))
    shared_logit = tl.load(shared_logit_ptr + token * stride_sl).to(tl.float32)
    routed = tl.load(topk_weights_ptr + ids_at).to(tl.float32)
    weights = tl.where(is_shared, 1.0 / (1.0 + tl.exp(-shared_logit)), routed)
    weights = tl.where(ok, weights, 0.0)  # [G]: a slot of another EP rank's expert adds nothing
    experts = tl.where(ok & ~is_shared, experts, 0)
    rows = tl.where(ok, 1, 0)  # [G]: 0 masks the slot's loads off (no bytes read)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for step in range(0, GROUP * K_STEPS):
        j = step // K_STEPS  # the slot within the group
        pick = offs_j == j
        slot = group * GROUP + j
        expert = tl.sum(tl.where(pick, experts, 0))  # register picks, no load
        weight = tl.sum(tl.where(pick, weights, 0.0))
        slot_ok = tl.sum(tl.where(pick, rows, 0)) > 0
        shared_slot = slot == TOP_K
        base = tl.where(shared_slot, shared_w_ptr, w_ptr + expert.to(tl.int64) * stride_we)
        stride_n = tl.where(shared_slot, stride_swn, stride_wn)
        k = (step % K_STEPS) * BLOCK_K + offs_k
        k_ok = k < tl.where(slot_ok, inter, 0)  # (keeps inter's divisibility: vectorized loads)
        a = tl.load(act_ptr + (token * SLOTS + slot) * inter + k[None, :] + tl.zeros([16, 1], tl.int32),
                    mask=first & k_ok[None, :], other=0.0)  # [16, K]
        w = tl.load(base + offs_n[None, :] * stride_n + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # [K, N]
        acc += weight * tl.dot(a, w, input_precision=PRECISION)
    part = tl.sum(acc, axis=0)  # [N]: rows 1..15 are zero
    if GROUPS == 1:
        tl.store(out_ptr + token * stride_ot + offs_n, part.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        row = partial_ptr + (token * GROUPS) * hidden  # partials [T, GROUPS, H]
        tl.store(row + group * hidden + offs_n, part, mask=n_ok)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        ticket = counter_ptr + token * tl.num_programs(1) + tile
        done = tl.atomic_add(ticket, 1, sem="acq_rel")  # release our partial, acquire the others'
        if done == GROUPS - 1:
            offs_g = tl.arange(0, GROUPS_P2)
            parts = tl.load(row + offs_g[:, None] * hidden + offs_n[None, :],
                            mask=(offs_g[:, None] < GROUPS) & n_ok[None, :], other=0.0, cache_modifier=".cg")  # [G, N]
            tl.store(out_ptr + token * stride_ot + offs_n, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(ticket, 0)  # ready for the next call (and the next graph replay)


@triton.jit
def _gemv_gate_up_fma_kernel(
    x_ptr, ids_ptr, w_ptr, shared_w_ptr, act_ptr, s_ptr, shared_s_ptr,
    hidden, inter, expert_start, num_local_experts,
    stride_xt, stride_we, stride_wn, stride_swn, stride_se, stride_sn, stride_ssn,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):
    """Gate/up without `tl.dot` (`fma` configs): one program per ((token, slot), BLOCK_N
    intermediate rows), the whole hidden dim in K_STEPS unrolled steps of plain [BLOCK_N, BLOCK_K]
    loads (K contiguous), products accumulated elementwise in float32 and each row summed once at
    the end. Few rows per program: many programs, each with all its loads issued up front.
    FP8: the weights are float8 e4m3 with one float32 scale per BN x BK block (`s_ptr`
    `[E, 2I/BN, ceil(H/BK)]`); a program's rows lie in one row block (BLOCK_N divides BN, I a
    multiple of BN), so the scale multiplies the token's activations once per column."""
    wait_for_producer(PDL)
    row, token, slot, base, ok = _gate_up_row(ids_ptr, w_ptr, shared_w_ptr, expert_start, num_local_experts, stride_we,
                                              TOP_K, SLOTS)
    if ok:
        stride_n = tl.where(slot == TOP_K, stride_swn, stride_wn)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        if FP8:
            s_base = _slot_scales(slot, token, ids_ptr, s_ptr, shared_s_ptr, expert_start, num_local_experts,
                                  stride_se, TOP_K)
            s_stride = tl.where(slot == TOP_K, stride_ssn, stride_sn)
            gate_scales = s_base + (tl.program_id(1) * BLOCK_N // BN) * s_stride  # this row block's scales
            up_scales = gate_scales + (inter // BN) * s_stride
        acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for step in tl.static_range(K_STEPS):
            k = step * BLOCK_K + offs_k
            k_ok = k < hidden
            a = tl.load(x_ptr + token * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)  # [K]
            if FP8:
                a_gate = a * tl.load(gate_scales + k // BK, mask=k_ok, other=0.0)
                a_up = a * tl.load(up_scales + k // BK, mask=k_ok, other=0.0)
            else:
                a_gate = a
                a_up = a
            mask = n_ok[:, None] & k_ok[None, :]
            gate_w = tl.load(base + offs_n[:, None] * stride_n + k[None, :], mask=mask, other=0.0)  # [N, K]
            up_w = tl.load(base + (offs_n[:, None] + inter) * stride_n + k[None, :], mask=mask, other=0.0)
            acc_gate += gate_w.to(tl.float32) * a_gate[None, :]
            acc_up += up_w.to(tl.float32) * a_up[None, :]
        gate = tl.sum(acc_gate, axis=1)  # [N]
        up = tl.sum(acc_up, axis=1)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + row * inter + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_down_fma_kernel(
    act_ptr, ids_ptr, topk_weights_ptr, w_ptr, shared_w_ptr, shared_logit_ptr, out_ptr, s_ptr, shared_s_ptr,
    hidden, inter, expert_start, num_local_experts,
    stride_we, stride_wn, stride_swn, stride_sl, stride_ot, stride_se, stride_sn, stride_ssn,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):
    """Down without `tl.dot` (`fma` configs): one program per (token, BLOCK_N output rows) over
    every slot, unrolled: each slot's activation row is scaled by its weight (routing weight, or
    the shared expert's sigmoid gate) and multiplied elementwise with its weight tile into one
    float32 [BLOCK_N, BLOCK_K] accumulator, in slot order, and each row summed once at the end: no
    reduction between the slots, so every slot's loads can be in flight at once (a sum per slot
    put a cross-warp reduction, and its barrier, between one slot's loads and the next's). No
    partials, no ticket. FP8: as the gate/up kernel, the row block's scales (`s_ptr`
    `[E, ceil(H/BN), I/BK]`) multiply each slot's activations."""
    wait_for_producer(PDL)
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    shared_gate = 1.0 / (1.0 + tl.exp(-tl.load(shared_logit_ptr + token * stride_sl).to(tl.float32)))
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for slot in tl.static_range(SLOTS):
        base, ok = _slot_weights(slot, token, ids_ptr, w_ptr, shared_w_ptr, expert_start, num_local_experts,
                                 stride_we, TOP_K)
        if slot == TOP_K:
            weight = shared_gate
            stride_n = stride_swn
        else:
            weight = tl.load(topk_weights_ptr + token * TOP_K + slot).to(tl.float32)
            stride_n = stride_wn
        if FP8:
            s_base = _slot_scales(slot, token, ids_ptr, s_ptr, shared_s_ptr, expert_start, num_local_experts,
                                  stride_se, TOP_K)
            row_scales = s_base + (tl.program_id(1) * BLOCK_N // BN) * (stride_ssn if slot == TOP_K else stride_sn)
        weight = tl.where(ok, weight, 0.0)  # a slot of another EP rank's expert adds nothing
        k_end = tl.where(ok, inter, 0)  # 0 masks its loads off (no bytes read)
        for step in tl.static_range(K_STEPS):
            k = step * BLOCK_K + offs_k
            k_ok = k < k_end
            a = tl.load(act_ptr + (token * SLOTS + slot) * inter + k, mask=k_ok, other=0.0).to(tl.float32)  # [K]
            if FP8:
                a = a * tl.load(row_scales + k // BK, mask=k_ok, other=0.0)
            w = tl.load(base + offs_n[:, None] * stride_n + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [N, K]
            acc += w.to(tl.float32) * (weight * a)[None, :]
    total = tl.sum(acc, axis=1)  # [N]
    tl.store(out_ptr + token * stride_ot + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


_TICKETS: dict[torch.device, list[torch.Tensor]] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 tickets of the kernels that sum partials (one per (row, output tile)), kept
    per device: each call leaves them zero again, so a captured graph replays on the same buffer.
    Sized on the first (eager, warm-up) call of a shape; not grown during a graph capture, and a
    buffer outgrown later stays allocated (an earlier graph may still point at it)."""
    buffers = _TICKETS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused_moe_gemv: run one eager call of this shape before capturing a graph")
        buffers.append(torch.zeros(max(count, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


# Tile sizes at the Qwen3.5-35B-A3B shape, chosen by benchmarks/tune_gemv.py on an H200, L2-cold
# (benchmarks/results/tune_gemv_pipelined_h200.json): 22.3 / 37.9 / 59.9 us at 1 / 2 / 4 tokens,
# against 26.9 / 43.8 / 64.2 us for the earlier down kernels and 33.4 / 48.4 / 69.0 for the
# grouped GEMM. The same down config at every T: a token's down projection sums in one order
# whatever the batch. The split gate/up (up_split > 1) did not win there.
#   up_n, up_k, up_warps, up_stages: gate/up tile (intermediate rows x hidden columns per step);
#   up_split: programs per (row, tile) along the hidden dim (1 = one program reads all of it);
#   down_n, down_k, down_slots, down_warps, down_stages: down tile (output rows x intermediate
#     columns per step), slots per program.
GEMV_CONFIG = dict(up_n=32, up_k=256, up_warps=4, up_stages=3, up_split=1,
                   down_n=64, down_k=128, down_slots=1, down_warps=2, down_stages=3, fma=0)
GEMV_CONFIG_ONE_TOKEN = dict(GEMV_CONFIG, up_n=64, up_stages=4)
# fma = 1: the kernels without `tl.dot` (`_gemv_gate_up_fma_kernel`, `_gemv_down_fma_kernel`), few
# rows per program, the same tiles at every T; up_n / up_k / down_n / down_k / *_warps are theirs
# (stages, up_split and down_slots do not apply). The default at every token count, never with
# LAMINA_MOE_GEMV_FMA=0 (`lamina.kernels.selection.moe_gemv_fma_max_tokens`: on an H200 faster end
# to end at batch 1-4). One program per token (and slot, in gate/up): a token's sums are the same
# whatever the other tokens of its step (ARCHITECTURE.md, "Batch invariance").
GEMV_CONFIG_FMA = dict(GEMV_CONFIG, fma=1, up_n=2, up_k=2048, up_warps=8, down_n=2, down_k=512, down_warps=4)
# FP8 experts (`scales`): a program of the FMA tiles reads half the bytes, and four times the gate/up
# rows made up for it: benchmarks/tune_moe_fp8.py on an H100, L2-cold, at the Qwen3.5-35B-A3B shape
# (tune_moe_fp8_h100_s32.json): 19.5 -> 16.1 / 35.5 -> 27.8 / 66.0 -> 48.9 us at 1 / 2 / 4 tokens
# (bf16 weights on GEMV_CONFIG_FMA: 23.6 / 42.8 / 70.7 us); the down tile stayed.
GEMV_CONFIG_FMA_FP8 = dict(GEMV_CONFIG_FMA, up_n=8)
# Rows a program of the default FMA tiles under Triton's interpreter (CI), which runs programs one
# after another: fewer, wider ones. NumPy sums each row the same whatever the tile.
INTERPRETER_FMA_ROWS = 32


# Experts wider than this take the grouped-GEMM path (the GEMV tiles were tuned at I = 512; TP
# splits make experts narrower).
GEMV_MAX_INTER = 1024


# Shared memory of the pipelined tiles, (stages - 1) buffers of each loaded tile (what Triton asked
# for on an H200: 288 KiB for the one-token gate/up tiles in float32, over the 227 KiB there;
# 144 KiB in bf16; the pipelined down tile's formula checked against sm_90 compiles):
# gate/up: the gate and up weight tiles [up_k, up_n] and the 16-row token tile [16, up_k];
# down: the weight tile [down_k, down_n] and the 16-row activation tile [16, down_k].
def _shared_memory(cfg: dict, element_size: int) -> tuple[int, int]:
    """(gate/up, down) shared memory in bytes of a config's pipelined tiles."""
    up = (cfg["up_stages"] - 1) * (2 * cfg["up_n"] + 16) * cfg["up_k"] * element_size
    down = (cfg["down_stages"] - 1) * (cfg["down_n"] + 16) * cfg["down_k"] * element_size
    return up, down


def _fit_shared_memory(cfg: dict, element_size: int, limit: int = SM90_SHARED_MEMORY) -> None:
    """Narrow each pipelined tile (then cut its stages) until it fits `limit` bytes of shared memory
    (the GPU's: `lamina.kernels.tile_fit.shared_memory_limit`)."""
    for n, stages, which in (("up_n", "up_stages", 0), ("down_n", "down_stages", 1)):
        while _shared_memory(cfg, element_size)[which] > limit and cfg[n] > 16:
            cfg[n] //= 2
        while _shared_memory(cfg, element_size)[which] > limit and cfg[stages] > 2:
            cfg[stages] -= 1


def _check_config(cfg: dict) -> None:
    unknown = sorted(set(cfg) - set(GEMV_CONFIG))
    if unknown:
        raise ValueError(f"fused_moe_gemv: unknown config keys {unknown} (known: {sorted(GEMV_CONFIG)})")
    smallest = 1 if cfg["fma"] else 8  # a tl.dot tile side is >= 8 (16 rows of it hold the tokens)
    for key in ("up_n", "up_k", "down_n", "down_k"):
        if cfg[key] < smallest or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"fused_moe_gemv: {key} = {cfg[key]} must be a power of two >= {smallest} (a Triton tile side)")
    for key in ("up_split", "down_slots", "up_warps", "down_warps", "up_stages", "down_stages"):
        if cfg[key] < 1:
            raise ValueError(f"fused_moe_gemv: {key} = {cfg[key]} must be >= 1")


def fused_moe_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    config: dict | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """`lamina.kernels.triton_moe.fused_moe`'s contract for a few tokens: x `[T, H]`; w13
    `[E_local, 2I, H]`; w2 `[E_local, H, I]`; topk_weights / topk_ids `[T, k]` (global ids);
    `shared = (w13_shared [2I, H], w2_shared [H, I], gate_logit [T])`. Returns `[T, H]` in x's dtype.
    `scales`: the weights (the shared expert's too) are block FP8 with these scales; they run on
    the FMA kernels, whose row tiles are cut to the block height.
    `config` overrides keys of GEMV_CONFIG(_ONE_TOKEN), or of GEMV_CONFIG_FMA when it holds fma=1
    (tuning: the tiles are then taken as given, the token count and LAMINA_MOE_GEMV_FMA do not
    apply); without one, up to `moe_gemv_fma_max_tokens()` tokens take the FMA kernels."""
    num_tokens, top_k = topk_ids.shape
    num_local_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    # A given config's `fma` (0 if absent) picks the kernels; without one, the token count does
    # (FP8 weights: always the FMA kernels).
    fma = config.get("fma", 0) if config else int(scales is not None or num_tokens <= moe_gemv_fma_max_tokens())
    if scales is not None and not fma:
        raise ValueError("fused_moe_gemv: FP8 experts run on the FMA kernels (a config with fma=1)")
    fma_config = GEMV_CONFIG_FMA_FP8 if scales is not None else GEMV_CONFIG_FMA
    cfg = dict(fma_config if fma else GEMV_CONFIG_ONE_TOKEN if num_tokens == 1 else GEMV_CONFIG)
    cfg.update(config or {})
    if fma and not config and triton_interpreted():
        cfg.update(up_n=INTERPRETER_FMA_ROWS, down_n=INTERPRETER_FMA_ROWS)
    if scales is not None:  # a program's rows lie in one block row
        scales.check(w13, w2, shared)
        cfg.update(up_n=min(cfg["up_n"], scales.block[0]), down_n=min(cfg["down_n"], scales.block[0]))
    _check_config(cfg)
    if shared is not None and shared[0].shape != (two_inter, hidden):
        raise ValueError(f"shared expert gate_up {tuple(shared[0].shape)} does not match the experts' {(two_inter, hidden)}")
    if not config and not fma:  # (the FMA kernels hold no shared-memory pipeline)
        _fit_shared_memory(cfg, x.element_size(), shared_memory_limit(x.device))
    x = x if x.stride(-1) == 1 else x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    slots = top_k + (shared is not None)
    shared_w13, shared_w2, shared_logit = shared if shared is not None else (w13, w2, topk_weights)
    if cfg["fma"]:
        return _fused_moe_fma(x, w13, w2, topk_weights, topk_ids, expert_start, shared_w13, shared_w2, shared_logit,
                              slots, cfg, scales)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    up_tiles = triton.cdiv(inter, cfg["up_n"])
    k_per_split = triton.cdiv(triton.cdiv(hidden, cfg["up_split"]), cfg["up_k"]) * cfg["up_k"]
    up_split = triton.cdiv(hidden, k_per_split)  # no empty parts: 48 columns in 32-column steps split twice at most
    tiles = triton.cdiv(hidden, cfg["down_n"])
    groups = triton.cdiv(slots, cfg["down_slots"])
    # Tickets of the kernels that sum partials: the split gate/up's first, the down kernel's after.
    up_tickets = num_tokens * slots * up_tiles if up_split > 1 else 0
    down_tickets = num_tokens * tiles if groups > 1 else 0
    tickets = _tickets(x.device, up_tickets + down_tickets) if up_tickets + down_tickets else topk_ids  # (unused)

    act = torch.empty(num_tokens * slots, inter, dtype=x.dtype, device=x.device)  # [T*slots, I]
    up_partial = act  # unused unless split
    if up_split > 1:
        up_partial = torch.empty(num_tokens * slots, up_split, 2, inter, dtype=torch.float32, device=x.device)
    _gemv_gate_up_kernel[(num_tokens * slots, up_tiles, up_split)](
        x, topk_ids, w13, shared_w13, act, up_partial, tickets, hidden, inter, expert_start, num_local_experts,
        k_per_split, x.stride(0), w13.stride(0), w13.stride(1), shared_w13.stride(-2),
        TOP_K=top_k, SLOTS=slots, BLOCK_N=cfg["up_n"], BLOCK_K=cfg["up_k"], SPLIT=up_split,
        SPLIT_P2=max(2, triton.next_power_of_2(up_split)), PRECISION=precision,
        **pdl_kwargs(x.device), num_warps=cfg["up_warps"], num_stages=cfg["up_stages"], **FP_FUSION,
    )

    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)  # [T, H]
    down_args = (act, topk_ids, topk_weights, w2, shared_w2, shared_logit)
    down_sizes = (hidden, inter, expert_start, num_local_experts,
                  w2.stride(0), w2.stride(1), shared_w2.stride(-2), shared_logit.stride(0), out.stride(0))
    group = min(cfg["down_slots"], slots)
    partial = out  # unused when one program covers every slot
    if groups > 1:
        partial = torch.empty(num_tokens, groups, hidden, dtype=torch.float32, device=x.device)  # [T, groups, H]
    _gemv_down_pipelined_kernel[(num_tokens, tiles, groups)](
        *down_args, partial, tickets[up_tickets:], out, *down_sizes,
        TOP_K=top_k, SLOTS=slots, GROUP=group, GROUP_P2=max(2, triton.next_power_of_2(group)), GROUPS=groups,
        GROUPS_P2=max(2, triton.next_power_of_2(groups)), BLOCK_N=cfg["down_n"], BLOCK_K=cfg["down_k"],
        K_STEPS=triton.cdiv(inter, cfg["down_k"]), PRECISION=precision,
        **pdl_kwargs(x.device), num_warps=cfg["down_warps"], num_stages=cfg["down_stages"], **FP_FUSION,
    )
    return out


def _fused_moe_fma(x, w13, w2, topk_weights, topk_ids, expert_start, shared_w13, shared_w2, shared_logit, slots, cfg,
                   scales: ExpertScales | None = None):
    """`fused_moe_gemv` on the FMA kernels (cfg["fma"]): gate/up then down, two launches."""
    num_tokens, top_k = topk_ids.shape
    num_local_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    up_k, down_k = min(cfg["up_k"], triton.next_power_of_2(hidden)), min(cfg["down_k"], triton.next_power_of_2(inter))
    s13, s2, shared_s13, shared_s2 = scales.pointers() if scales is not None else (x, x, x, x)  # (unused without FP8)
    bn, bk = scales.block if scales is not None else (1, 1)
    act = torch.empty(num_tokens * slots, inter, dtype=x.dtype, device=x.device)  # [T*slots, I]
    _gemv_gate_up_fma_kernel[(num_tokens * slots, triton.cdiv(inter, cfg["up_n"]))](
        x, topk_ids, w13, shared_w13, act, s13, shared_s13, hidden, inter, expert_start, num_local_experts,
        x.stride(0), w13.stride(0), w13.stride(1), shared_w13.stride(-2),
        s13.stride(0), s13.stride(-2), shared_s13.stride(-2),
        TOP_K=top_k, SLOTS=slots, BLOCK_N=cfg["up_n"], BLOCK_K=up_k, K_STEPS=triton.cdiv(hidden, up_k),
        FP8=scales is not None, BN=bn, BK=bk, **pdl_kwargs(x.device), num_warps=cfg["up_warps"], **FP_FUSION,
    )
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)  # [T, H]
    _gemv_down_fma_kernel[(num_tokens, triton.cdiv(hidden, cfg["down_n"]))](
        act, topk_ids, topk_weights, w2, shared_w2, shared_logit, out, s2, shared_s2,
        hidden, inter, expert_start, num_local_experts,
        w2.stride(0), w2.stride(1), shared_w2.stride(-2), shared_logit.stride(0), out.stride(0),
        s2.stride(0), s2.stride(-2), shared_s2.stride(-2),
        TOP_K=top_k, SLOTS=slots, BLOCK_N=cfg["down_n"], BLOCK_K=down_k, K_STEPS=triton.cdiv(inter, down_k),
        FP8=scales is not None, BN=bn, BK=bk, **pdl_kwargs(x.device), num_warps=cfg["down_warps"], **FP_FUSION,
    )
    return out

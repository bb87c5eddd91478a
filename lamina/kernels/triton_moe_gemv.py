"""Fused MoE for a handful of tokens (decode): two GEMV launches, no sort, no separate k-slot sum.

At batch 1 the routed experts are a GEMV over 8 of 256 weight matrices. The grouped-GEMM path of
`lamina.kernels.triton_moe` sorts the (token, expert) pairs by expert first (one launch), runs
16-row `tl.dot` tiles of which one row is real, writes `[T, slots, H]` in float32 and sums the
slots in torch (two more launches). Here, for `T <= GEMV_MAX_TOKENS`:

1. gate/up: one program per (token, slot, tile of BLOCK_N intermediate rows) reads its expert id
   straight from `topk_ids` (slot k = the shared expert when it rides along) and writes
   `act[t, slot] = silu(x_t @ gate_e^T) * (x_t @ up_e^T)`;
2. down (`down_split`, the one-token default): one program per (token, tile of BLOCK_N output rows, slot)
   computes `weight_slot * (act[t, slot] @ down_e^T)` in float32 over the whole intermediate dim;
   the last program of a (token, tile) sums the slots' partials in slot order and writes `[T, H]`
   in the output dtype (one rounding; an atomic ticket only decides who sums, the order is
   fixed: deterministic). The looping variant (`down_split=False`, the default for 2-4 tokens: one program per (token, tile)
   stepping through the slots) keeps the sum in registers but waits on each slot's expert id
   before its weight load, which profiled at ~1 TB/s on an H200.

The products are `tl.dot`s of a 16-row tile whose row 0 is the token (the rest zero): Triton
pipelines the weight loads that feed a dot (async copies into shared memory), which a plain
elementwise GEMV loop does not get; compute is free here, the weights' bytes are the cost.
Experts of other EP ranks (ids outside this rank's range) contribute zero. Nothing syncs and every
shape is fixed by `T` and the weights: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["GEMV_CONFIG", "GEMV_CONFIG_ONE_TOKEN", "GEMV_MAX_INTER", "GEMV_MAX_TOKENS", "fused_moe_gemv"]

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
def _gemv_gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, shared_w_ptr, act_ptr,
    hidden, inter, expert_start, num_local_experts,
    stride_xt, stride_we, stride_wn, stride_swn,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)  # token * SLOTS + slot
    token = row // SLOTS
    slot = row % SLOTS
    base, ok = _slot_weights(slot, token, ids_ptr, w_ptr, shared_w_ptr, expert_start, num_local_experts,
                             stride_we, TOP_K)
    if ok:
        stride_n = tl.where(slot == TOP_K, stride_swn, stride_wn)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        first = tl.arange(0, 16)[:, None] == 0  # the token sits in row 0 of a 16-row tl.dot tile
        acc_gate = tl.zeros([16, BLOCK_N], tl.float32)
        acc_up = tl.zeros([16, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
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
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + row * inter + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_down_kernel(
    act_ptr, ids_ptr, topk_weights_ptr, w_ptr, shared_w_ptr, shared_logit_ptr, out_ptr,
    hidden, inter, expert_start, num_local_experts,
    stride_we, stride_wn, stride_swn, stride_sl, stride_ot,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
    PRECISION: tl.constexpr,
):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_i = tl.arange(0, BLOCK_I)  # the whole intermediate dim: one loop step per slot
    first = tl.arange(0, 16)[:, None] == 0
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    # One loop over the slots, so the next expert's rows stream in behind the current one's; each
    # slot's product is weighted (routing weight, or the shared expert's sigmoid gate) in float32
    # and summed in the same accumulator: the k-slot sum never leaves registers.
    for slot in range(0, SLOTS):
        base, ok = _slot_weights(slot, token, ids_ptr, w_ptr, shared_w_ptr, expert_start, num_local_experts,
                                 stride_we, TOP_K)
        is_shared = (tl.full([], 0, tl.int32) + slot) == TOP_K
        stride_n = tl.where(is_shared, stride_swn, stride_wn)
        routed_weight = tl.load(topk_weights_ptr + token * TOP_K + tl.minimum(slot, TOP_K - 1)).to(tl.float32)
        shared_logit = tl.load(shared_logit_ptr + token * stride_sl).to(tl.float32)
        weight = tl.where(is_shared, 1.0 / (1.0 + tl.exp(-shared_logit)), routed_weight)
        i_ok = offs_i < tl.where(ok, inter, 0)  # a slot of another EP rank's expert reads nothing
        a = tl.load(act_ptr + (token * SLOTS + slot) * inter + offs_i[None, :] + tl.zeros([16, 1], tl.int32),
                    mask=first & i_ok[None, :], other=0.0)  # [16, I]
        w = tl.load(base + offs_n[None, :] * stride_n + offs_i[:, None], mask=i_ok[:, None] & n_ok[None, :],
                    other=0.0)  # [I, N]
        acc += tl.where(ok, weight, 0.0) * tl.dot(a, w, input_precision=PRECISION)
    out = tl.sum(acc, axis=0)  # [N]: rows 1..15 are zero
    tl.store(out_ptr + token * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_down_split_kernel(
    act_ptr, ids_ptr, topk_weights_ptr, w_ptr, shared_w_ptr, shared_logit_ptr, partial_ptr, counter_ptr, out_ptr,
    hidden, inter, expert_start, num_local_experts,
    stride_we, stride_wn, stride_swn, stride_sl, stride_ot,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (token, tile of BLOCK_N output rows, slot): every slot's rows load at once
    (the looping kernel above waits on each slot's expert id before its weight load). Each program
    writes its weighted float32 partial; the last program of a (token, tile) to finish (an atomic
    ticket) sums the SLOTS partials in slot order and writes the output, then resets the ticket.
    The sum's order is fixed whichever program comes last: deterministic."""
    token = tl.program_id(0)
    tile = tl.program_id(1)
    slot = tl.program_id(2)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_i = tl.arange(0, BLOCK_I)
    first = tl.arange(0, 16)[:, None] == 0
    base, ok = _slot_weights(slot, token, ids_ptr, w_ptr, shared_w_ptr, expert_start, num_local_experts,
                             stride_we, TOP_K)
    is_shared = (tl.full([], 0, tl.int32) + slot) == TOP_K
    stride_n = tl.where(is_shared, stride_swn, stride_wn)
    routed_weight = tl.load(topk_weights_ptr + token * TOP_K + tl.minimum(slot, TOP_K - 1)).to(tl.float32)
    shared_logit = tl.load(shared_logit_ptr + token * stride_sl).to(tl.float32)
    weight = tl.where(is_shared, 1.0 / (1.0 + tl.exp(-shared_logit)), routed_weight)
    i_ok = offs_i < tl.where(ok, inter, 0)  # a slot of another EP rank's expert reads nothing
    a = tl.load(act_ptr + (token * SLOTS + slot) * inter + offs_i[None, :] + tl.zeros([16, 1], tl.int32),
                mask=first & i_ok[None, :], other=0.0)  # [16, I]
    w = tl.load(base + offs_n[None, :] * stride_n + offs_i[:, None], mask=i_ok[:, None] & n_ok[None, :],
                other=0.0)  # [I, N]
    part = tl.sum(tl.dot(a, w, input_precision=PRECISION), axis=0) * tl.where(ok, weight, 0.0)  # [N]
    row = partial_ptr + (token * SLOTS) * hidden  # partials [T, SLOTS, H]
    tl.store(row + slot * hidden + offs_n, part, mask=n_ok)
    ticket = counter_ptr + token * tl.num_programs(1) + tile
    done = tl.atomic_add(ticket, 1, sem="acq_rel")  # release our partial, acquire the others'
    if done == SLOTS - 1:
        offs_s = tl.arange(0, SLOTS_P2)
        parts = tl.load(row + offs_s[:, None] * hidden + offs_n[None, :],
                        mask=(offs_s[:, None] < SLOTS) & n_ok[None, :], other=0.0, cache_modifier=".cg")  # [S, N]
        tl.store(out_ptr + token * stride_ot + offs_n, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty), mask=n_ok)
        tl.atomic_xchg(ticket, 0)  # ready for the next call (and the next graph replay)


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 tickets of the split down kernel, one per (token, output tile), kept per device:
    each call leaves them zero again, so a captured graph replays on the same buffer. Sized on the
    first (eager, warm-up) call of a shape; not grown during a graph capture."""
    tickets = _TICKETS.get(device)
    if tickets is None or tickets.numel() < count:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused_moe_gemv: run one eager call of this shape before capturing a graph")
        tickets = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _TICKETS[device] = tickets
    return tickets


# Tile sizes at the Qwen3.5-35B-A3B shape on an H200 (benchmarks/tune_gemv.py).
# L2-cold, 2026-12-01 (benchmarks/results/tune_gemv_h200.json): at one token the slot-split down
# kernel and wider gate/up tiles win (26.6 us vs 28.6 for the loop); at 2 and 4 tokens the split
# kernel's 2.3k-4.6k programs lose to the slot loop (77 vs 64 us at 4 tokens).
GEMV_CONFIG = dict(up_n=32, up_k=256, down_n=16, up_warps=4, down_warps=4, up_stages=3, down_stages=3,
                   down_split=False)
GEMV_CONFIG_ONE_TOKEN = dict(GEMV_CONFIG, up_n=64, down_split=True, down_warps=2, down_stages=1)

# The down kernel holds a slot's whole intermediate row block in one tile; wider experts (TP
# splits make them narrower) take the grouped-GEMM path.
GEMV_MAX_INTER = 1024


# Shared memory of the gate/up kernel: (up_stages - 1) buffers of the gate and up weight tiles
# [up_k, up_n] and the 16-row token tile [16, up_k] (what Triton asked for on an H200: 288 KiB for
# the one-token tiles in float32, over the 227 KiB there; 144 KiB in bf16).
SHARED_MEMORY_LIMIT = 227 * 1024


def _fit_shared_memory(cfg: dict, element_size: int) -> None:
    """Narrow the gate/up tile (then cut its stages) until it fits the GPU's shared memory."""
    def needed() -> int:
        return (cfg["up_stages"] - 1) * (2 * cfg["up_n"] + 16) * cfg["up_k"] * element_size

    while needed() > SHARED_MEMORY_LIMIT and cfg["up_n"] > 16:
        cfg["up_n"] //= 2
    while needed() > SHARED_MEMORY_LIMIT and cfg["up_stages"] > 2:
        cfg["up_stages"] -= 1


def fused_moe_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """`lamina.kernels.triton_moe.fused_moe`'s contract for a few tokens: x `[T, H]`; w13
    `[E_local, 2I, H]`; w2 `[E_local, H, I]`; topk_weights / topk_ids `[T, k]` (global ids);
    `shared = (w13_shared [2I, H], w2_shared [H, I], gate_logit [T])`. Returns `[T, H]` in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    num_local_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    if inter > GEMV_MAX_INTER:
        raise ValueError(f"fused_moe_gemv: intermediate size {inter} > GEMV_MAX_INTER = {GEMV_MAX_INTER}")
    if shared is not None and shared[0].shape != (two_inter, hidden):
        raise ValueError(f"shared expert gate_up {tuple(shared[0].shape)} does not match the experts' {(two_inter, hidden)}")
    cfg = dict(GEMV_CONFIG_ONE_TOKEN if num_tokens == 1 else GEMV_CONFIG)
    cfg.update(config or {})
    if config is None:
        _fit_shared_memory(cfg, x.element_size())
    x = x if x.stride(-1) == 1 else x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    slots = top_k + (shared is not None)
    shared_w13, shared_w2, shared_logit = shared if shared is not None else (w13, w2, topk_weights)
    act = torch.empty(num_tokens * slots, inter, dtype=x.dtype, device=x.device)  # [T*slots, I]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _gemv_gate_up_kernel[(num_tokens * slots, triton.cdiv(inter, cfg["up_n"]))](
        x, topk_ids, w13, shared_w13, act, hidden, inter, expert_start, num_local_experts,
        x.stride(0), w13.stride(0), w13.stride(1), shared_w13.stride(-2),
        TOP_K=top_k, SLOTS=slots, BLOCK_N=cfg["up_n"], BLOCK_K=cfg["up_k"], PRECISION=precision,
        num_warps=cfg["up_warps"], num_stages=cfg["up_stages"],
    )
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)  # [T, H]
    block_i = max(16, triton.next_power_of_2(inter))
    tiles = triton.cdiv(hidden, cfg["down_n"])
    if cfg["down_split"]:
        partial = torch.empty(num_tokens, slots, hidden, dtype=torch.float32, device=x.device)  # [T, slots, H]
        _gemv_down_split_kernel[(num_tokens, tiles, slots)](
            act, topk_ids, topk_weights, w2, shared_w2, shared_logit, partial, _tickets(x.device, num_tokens * tiles),
            out, hidden, inter, expert_start, num_local_experts,
            w2.stride(0), w2.stride(1), shared_w2.stride(-2), shared_logit.stride(0), out.stride(0),
            TOP_K=top_k, SLOTS=slots, SLOTS_P2=triton.next_power_of_2(slots), BLOCK_N=cfg["down_n"], BLOCK_I=block_i,
            PRECISION=precision, num_warps=cfg["down_warps"], num_stages=cfg["down_stages"],
        )
        return out
    _gemv_down_kernel[(num_tokens, tiles)](
        act, topk_ids, topk_weights, w2, shared_w2, shared_logit, out, hidden, inter, expert_start, num_local_experts,
        w2.stride(0), w2.stride(1), shared_w2.stride(-2), shared_logit.stride(0), out.stride(0),
        TOP_K=top_k, SLOTS=slots, BLOCK_N=cfg["down_n"], BLOCK_I=block_i,
        PRECISION=precision, num_warps=cfg["down_warps"], num_stages=cfg["down_stages"],
    )
    return out

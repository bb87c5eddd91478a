"""The MoE router for a few tokens (decode): GEMV, softmax, top-k and renormalisation in one launch.

At decode each MoE layer spent two launches on routing: the router GEMV over `router_rows`
(`[E, H]`, or `[E+1, H]` with the shared expert's gate row after the experts',
`SparseMoE.router_rows`) and `lamina.kernels.triton_moe.route_softmax_topk`. At batch 1 both are
bound by launch latency (an H200 reads the 1 MB of router weights in well under a microsecond).
Here, for `T <= ROUTER_MAX_TOKENS` tokens, one launch does both:

1. logits: program p loads rows `[p*BLOCK_E, (p+1)*BLOCK_E)` of the router weights once (and
   every token's features), computes those rows of `x @ W^T` for every token in float32 (one
   tree reduction per chunk of BLOCK_K features, the chunks added in order), and stores them
   rounded to the activation dtype in `logits [T, R]`, as the GEMV did;
2. routing: each program then draws a ticket from an atomic counter; the program that draws the
   last one reads the T x E expert logits back and does `route_softmax_topk`'s math: softmax in
   float32, the top-k (ties to the lower expert id), optionally renormalised; it writes weights
   `[T, k]` (activation dtype) and ids `[T, k]` (int64) and resets the counter to zero, so the
   next call (or the next replay of a captured graph) finds it zero. Rows past the E expert rows
   (the shared expert's gate) are only returned, in `logits`.

Deterministic: every logit is one program's own sum (no float atomics), and the ticket decides
only which program routes, never an order of summation. Batch invariant: tensors are shaped by
ROUTER_MAX_TOKENS, never by T, and every token runs through the same code, so a token's logits,
weights and ids do not depend on the tokens beside it. Nothing syncs with the host and every
shape follows from T and the weights: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION

__all__ = ["ROUTER_CONFIG", "ROUTER_MAX_TOKENS", "fused_router"]

# Up to this many tokens the router runs in one launch; beyond, the GEMV and the routing kernel.
ROUTER_MAX_TOKENS = 4

# block_e router rows per program (E+1 = 257 rows -> 129 programs at the Qwen3.5 shape: about one
# per SM, 8 KB of weights each), block_k features per chunk (capped at the hidden size: H = 2048 is
# one chunk, so a program issues all its weight loads at once; sm_90 builds of these tiles use 64
# registers a thread in bf16, 96 in float32, no spills). Not yet timed on a GPU:
# benchmarks/bench_router.py --sweep times the alternatives.
ROUTER_CONFIG = dict(block_e=2, block_k=2048, warps=4, stages=1)


@triton.jit
def _router_kernel(
    x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, ticket_ptr,
    num_tokens, num_rows, num_experts, stride_xt, stride_wn,
    HIDDEN: tl.constexpr, MAX_TOKENS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    tokens = tl.arange(0, MAX_TOKENS)
    token_ok = tokens < num_tokens
    # ---- 1. this program's rows of the GEMV, for every token --------------------------------
    rows = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < num_rows
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([MAX_TOKENS, BLOCK_E], tl.float32)
    for k0 in tl.static_range(0, HIDDEN, BLOCK_K):  # unrolled: one chunk up to BLOCK_K features
        k = k0 + offs_k
        k_ok = k < HIDDEN
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :], mask=token_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [MAX_TOKENS, BLOCK_K]
        w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_E, BLOCK_K], read once for all tokens
        for t in tl.static_range(MAX_TOKENS):  # the same code for every token, whatever T is
            xt = tl.sum(tl.where(tokens[:, None] == t, x, 0.0), axis=0)  # [BLOCK_K]: row t, exactly
            part = tl.sum(w * xt[None, :], axis=1)  # [BLOCK_E]
            acc += tl.where(tokens[:, None] == t, part[None, :], 0.0)  # row t only (+0.0 elsewhere)
    tl.store(logits_ptr + tokens[:, None] * num_rows + rows[None, :], acc.to(logits_ptr.dtype.element_ty),
             mask=token_ok[:, None] & row_ok[None, :])
    # ---- 2. the last program to finish routes every token -----------------------------------
    tl.debug_barrier()  # all of this program's logits are stored before its ticket releases them
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")  # release ours, acquire the others'
    if ticket == tl.num_programs(0) - 1:
        experts = tl.arange(0, E_PAD)
        expert_ok = experts < num_experts
        logits = tl.load(logits_ptr + tokens[:, None] * num_rows + experts[None, :],
                         mask=token_ok[:, None] & expert_ok[None, :], other=0.0,
                         cache_modifier=".cg").to(tl.float32)  # [MAX_TOKENS, E_PAD], L2 (other SMs wrote it)
        logits = tl.where(expert_ok[None, :], logits, float("-inf"))
        probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        probs = probs / tl.sum(probs, axis=1)[:, None]
        # Top-k as k rounds of one max over key = (probability bits << 32) | (E_PAD - 1 - expert):
        # non-negative floats order as their bits, so a round picks the highest probability and,
        # among equal ones, the lowest expert id (route_softmax_topk's k rounds of argmax).
        key = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (E_PAD - 1 - experts).to(tl.int64)[None, :]
        key = tl.where(expert_ok[None, :], key, -1)  # padding experts never win (real keys are >= 0)
        slots = tl.arange(0, K_PAD)  # padded to a power of 2 (top-10 routers)
        top = tl.zeros([MAX_TOKENS, K_PAD], tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(key, axis=1)  # [MAX_TOKENS]
            top = tl.where(slots[None, :] == j, best[:, None], top)
            key = tl.where(key == best[:, None], -1, key)  # keys are distinct: removes exactly one
        top_p = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)  # [MAX_TOKENS, K_PAD]
        top_i = (E_PAD - 1) - (top & (E_PAD - 1))
        if RENORMALIZE:
            top_p = top_p / tl.sum(top_p, axis=1)[:, None]  # the padding slots hold 0.0
        out = tokens[:, None] * TOP_K + slots[None, :]
        out_ok = token_ok[:, None] & (slots[None, :] < TOP_K)
        tl.store(weights_ptr + out, top_p.to(weights_ptr.dtype.element_ty), mask=out_ok)
        tl.store(ids_ptr + out, top_i, mask=out_ok)
        tl.atomic_xchg(ticket_ptr, 0)  # ready for the next call (and the next graph replay)


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _ticket(device: torch.device) -> torch.Tensor:
    """The zeroed int32 counter of the routing launches on `device` (they run one after another on
    a stream and each leaves it zero). Made by the first, eager call; not during a graph capture."""
    ticket = _TICKETS.get(device)
    if ticket is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused_router: run one eager call on this device before capturing a graph")
        ticket = torch.zeros(1, dtype=torch.int32, device=device)
        _TICKETS[device] = ticket
    return ticket


def fused_router(
    x: torch.Tensor,
    router_rows: torch.Tensor,
    num_experts: int,
    top_k: int,
    renormalize: bool,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route_softmax_topk(F.linear(x, router_rows)[:, :num_experts], top_k, renormalize, x.dtype)`
    in one launch, for `T <= ROUTER_MAX_TOKENS` tokens.

    x `[T, H]`; router_rows `[R, H]`, R >= num_experts: the experts' rows first, then any extra
    gate rows (the shared expert's), whose logits are only returned. Returns (weights `[T, k]` in
    x's dtype, ids `[T, k]` int64, logits `[T, R]` in x's dtype)."""
    num_tokens, hidden = x.shape
    num_rows = router_rows.shape[0]
    if num_tokens > ROUTER_MAX_TOKENS:
        raise ValueError(f"fused_router takes at most {ROUTER_MAX_TOKENS} tokens, got {num_tokens}")
    if router_rows.dim() != 2 or router_rows.shape[1] != hidden:
        raise ValueError(f"fused_router: x has {hidden} features, router_rows is {tuple(router_rows.shape)}")
    if router_rows.stride(1) != 1:
        raise ValueError("fused_router: router_rows must have contiguous rows")
    if not 1 <= num_experts <= num_rows:
        raise ValueError(f"fused_router: num_experts = {num_experts} must be in [1, {num_rows}] (router rows)")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"fused_router: top_k = {top_k} must be in [1, num_experts = {num_experts}]")
    cfg = dict(ROUTER_CONFIG)
    cfg.update(config or {})
    logits = torch.empty(num_tokens, num_rows, dtype=x.dtype, device=x.device)  # [T, R]
    weights = torch.empty(num_tokens, top_k, dtype=x.dtype, device=x.device)  # [T, k]
    ids = torch.empty(num_tokens, top_k, dtype=torch.long, device=x.device)  # [T, k]
    if num_tokens == 0:
        return weights, ids, logits
    x = x if x.stride(-1) == 1 else x.contiguous()
    _router_kernel[(triton.cdiv(num_rows, cfg["block_e"]),)](
        x, router_rows, logits, weights, ids, _ticket(x.device),
        num_tokens, num_rows, num_experts, x.stride(0), router_rows.stride(0),
        HIDDEN=hidden, MAX_TOKENS=ROUTER_MAX_TOKENS, BLOCK_E=cfg["block_e"],
        BLOCK_K=min(cfg["block_k"], triton.next_power_of_2(hidden)),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize, num_warps=cfg["warps"], num_stages=cfg["stages"], **FP_FUSION,
    )
    return weights, ids, logits

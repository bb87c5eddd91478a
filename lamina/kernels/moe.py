"""Routed-expert computation over a flat token batch.

`grouped_experts` sorts the (token, expert) pairs by expert and runs the two expert matmuls as
grouped GEMMs (`torch._grouped_mm`) with device-side offsets: no host sync (per-expert counts by
`scatter_add_`, not `bincount`, whose output size syncs). Where the grouped GEMM cannot run (feature dims whose rows are not
16-byte aligned, or a torch without it), a per-expert loop is used; it is a loop over experts,
never over tokens. (`lamina.kernels.grouped_mm_moe` is the same computation shaped for long
prefill chunks on a GPU.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mm_usable(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch has `_grouped_mm` and every feature dim's rows are 16-byte aligned (CUTLASS's need)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    align = 16 // x.element_size()
    return all(d % align == 0 for d in (w13.shape[1], w13.shape[2], w2.shape[1], w2.shape[2]))


def sort_pairs_by_expert(topk_ids: torch.Tensor, num_local_experts: int, expert_start: int):
    """The `P = T*k` (token, expert) pairs sorted by local expert, stable, on the device (no sync).
    Returns (order `[P]`: the pair of each sorted row; is_local `[P]` per pair; counts `[E_local]`
    int32: each local expert's pairs). Pairs of other ranks' experts sort last, past the counts."""
    local_ids = topk_ids.reshape(-1) - expert_start  # [P]
    is_local = (local_ids >= 0) & (local_ids < num_local_experts)  # [P]
    sort_key = torch.where(is_local, local_ids, num_local_experts)  # [P]
    order = torch.argsort(sort_key, stable=True)  # [P]
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int32, device=topk_ids.device)
    counts = counts.scatter_add_(0, sort_key, torch.ones_like(sort_key, dtype=torch.int32))  # [E_local + 1]
    return order, is_local, counts[:num_local_experts]


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * down(silu(gate(x)) * up(x)).

    x [T, H]; w13 [E_local, 2I, H] (gate rows then up rows); w2 [E_local, H, I];
    topk_weights [T, k] (x's dtype); topk_ids [T, k] global expert ids. Experts outside
    [expert_start, expert_start + E_local) contribute nothing (they live on other ranks).
    Returns [T, H].
    """
    num_tokens, top_k = topk_ids.shape
    order, is_local, counts = sort_pairs_by_expert(topk_ids, w13.shape[0], expert_start)
    token_of_pair = order // top_k  # [T*k]
    pair_weights = topk_weights.reshape(-1)[order] * is_local[order].to(topk_weights.dtype)  # [T*k]
    x_sorted = x[token_of_pair]  # [T*k, H]

    if grouped_mm_usable(x, w13, w2):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E_local]
        gate_up = torch._grouped_mm(x_sorted, w13.transpose(1, 2), offs=offsets)  # [T*k, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up  # [T*k, I]
        out_sorted = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offsets)  # [T*k, H]
    else:
        out_sorted = _per_expert_loop(x_sorted, w13, w2, counts)
    # Rows past the last offset (non-local pairs) are undefined in grouped_mm: zero their weight.
    out_sorted = torch.where(is_local[order][:, None], out_sorted.float(), 0.0) * pair_weights.float()[:, None]
    # Un-sort to [T, k, H] and sum over k in float32: deterministic (no atomics) and one rounding.
    per_pair = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)  # [T*k, H]
    return per_pair.view(num_tokens, top_k, w2.shape[1]).sum(dim=1).to(x.dtype)  # [T, H] (T may be 0)


def _per_expert_loop(x_sorted: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x_sorted.shape[0], w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            rows = x_sorted[start : start + count]  # [n, H]
            gate, up = F.linear(rows, w13[expert]).chunk(2, dim=-1)
            out[start : start + count] = F.linear(F.silu(gate) * up, w2[expert])
            start += count
    return out

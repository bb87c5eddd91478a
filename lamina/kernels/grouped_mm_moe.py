"""The routed-expert MoE of a long prefill chunk on `torch._grouped_mm` (CUTLASS's grouped GEMM on
sm90), `LAMINA_MOE_PREFILL=grouped_mm`: `triton_moe.fused_moe`'s contract, for the chunks where a
library GEMM may beat the Triton grouped kernels.

1. the (token, expert) pairs sorted by local expert on the device (stable), x's rows gathered in
   that order, each expert's row count as device-side offsets (no host sync);
2. gate/up and down as two grouped GEMMs (bf16 out), SiLU-and-mul between them;
3. `_combine_kernel`: per token, its k pairs' down rows read where the sort put them, weighted and
   summed in float32 in slot order (one rounding, no atomics: deterministic), rows of experts on
   other ranks skipped; one pass over the [pairs, H] rows instead of an un-sort and a sum;
4. the shared expert, if any, as two dense GEMMs, weighted by sigmoid(gate logit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.moe import grouped_mm_usable, sort_pairs_by_expert
from lamina.kernels.pdl import pdl_kwargs, wait_for_producer

__all__ = ["combine_pairs", "grouped_mm_moe", "grouped_mm_usable"]


@triton.jit
def _combine_kernel(rows_ptr, row_of_pair_ptr, weights_ptr, out_ptr, hidden, stride_r,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = offs < hidden
    total = tl.zeros([BLOCK], tl.float32)
    for slot in range(0, TOP_K):  # in slot order: deterministic
        row = tl.load(row_of_pair_ptr + token * TOP_K + slot)  # -1: the expert lives on another rank
        weight = tl.load(weights_ptr + token * TOP_K + slot).to(tl.float32)
        row_ok = ok & ((offs * 0 + row) >= 0)  # [BLOCK]: the row's test, broadcast (an undefined row may hold NaN)
        part = tl.load(rows_ptr + tl.maximum(row, 0).to(tl.int64) * stride_r + offs, mask=row_ok, other=0.0)
        total += weight * part.to(tl.float32)
    tl.store(out_ptr + token * hidden + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def combine_pairs(rows: torch.Tensor, row_of_pair: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows `[R, H]` (the pairs' down rows in sorted order), row_of_pair `[T*k]` int32 (each pair's
    row, -1 for none), weights `[T, k]` -> `[T, H]` in rows' dtype: sum over k of weight * row."""
    num_tokens, top_k = weights.shape
    hidden = rows.shape[1]
    if rows.stride(1) != 1 or row_of_pair.numel() != num_tokens * top_k:
        raise ValueError(f"combine_pairs: rows {tuple(rows.shape)} need unit column stride (got {rows.stride()}) and "
                         f"row_of_pair {tuple(row_of_pair.shape)} one entry per pair ({num_tokens} x {top_k})")
    row_of_pair = row_of_pair.contiguous()
    out = torch.empty(num_tokens, hidden, dtype=rows.dtype, device=rows.device)  # [T, H]
    if num_tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
            rows, row_of_pair, weights.contiguous(), out, hidden, rows.stride(0),
            TOP_K=top_k, BLOCK=block, **pdl_kwargs(rows.device), **FP_FUSION,
        )
    return out


def grouped_mm_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x `[T, H]`; w13 `[E_local, 2I, H]`; w2 `[E_local, H, I]`; topk_weights / topk_ids `[T, k]`
    (global ids: experts of other ranks contribute nothing); `shared = (w13_shared [2I_s, H],
    w2_shared [H, I_s], gate_logit [T])` adds sigmoid(gate_logit) * shared_mlp(x). The caller
    checks `grouped_mm_usable`. Returns `[T, H]` in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    order, is_local, counts = sort_pairs_by_expert(topk_ids, w13.shape[0], expert_start)  # [P], [P], [E_local]
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E_local] end row of each expert
    x_sorted = x.index_select(0, order // top_k)  # [P, H]
    gate_up = torch._grouped_mm(x_sorted, w13.transpose(1, 2), offs=offsets)  # [P, 2I]; rows past the offsets undefined
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate).mul_(up)  # [P, I]
    down = torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)  # [P, H]
    sorted_row = torch.arange(num_pairs, dtype=torch.int32, device=x.device)  # [P]
    row_of_pair = torch.empty_like(sorted_row).index_copy_(0, order, sorted_row)  # [P] sorted row of each pair
    row_of_pair = torch.where(is_local, row_of_pair, -1)  # [P]: undefined rows are never read
    out = combine_pairs(down, row_of_pair, topk_weights)  # [T, H]
    if shared is not None:
        shared_w13, shared_w2, gate_logit = shared
        shared_gate, shared_up = F.linear(x, shared_w13).chunk(2, dim=-1)  # [T, I_s] each
        shared_out = F.linear(F.silu(shared_gate) * shared_up, shared_w2)  # [T, H]
        out = out + torch.sigmoid(gate_logit.to(x.dtype)).unsqueeze(1) * shared_out
    return out

"""Filling in a step planned ahead under MTP in one launch (the torch form and the shapes:
lamina.kernels.pending_fill). The torch form is ~15 small launches between two verification
graphs, on the device's critical path; this is one program per request, which reads its row of
the previous step's results and rewrites its Q tokens, positions and KV slots and its context
length. Integer work only, so the result equals the reference's exactly."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION


@triton.jit
def _fill_pending_kernel(
    token_ids, positions, seq_lens, slot_mapping, block_tables, source_rows, bonus, drafts, rejected, shift_out,
    queries, table_stride, draft_stride, block_size, BLOCK_Q: tl.constexpr,
):
    req = tl.program_id(0)
    source = tl.load(source_rows + req)
    pending = source >= 0
    row = tl.maximum(source, 0)
    shift = tl.where(pending, tl.load(rejected + row), 0)
    tl.store(shift_out + req, shift)
    q = tl.arange(0, BLOCK_Q)
    mask = (q < queries) & (source + tl.zeros([BLOCK_Q], tl.int64) >= 0)  # [BLOCK_Q]: this request's tokens, if pending
    first = tl.load(bonus + row)
    draft = tl.load(drafts + row * draft_stride + q - 1, mask=mask & (q > 0), other=0)
    tl.store(token_ids + req * queries + q, tl.where(q == 0, first, draft), mask=mask)
    position = tl.load(positions + req * queries + q, mask=mask, other=0) - shift
    tl.store(positions + req * queries + q, position, mask=mask)
    block = tl.load(block_tables + req * table_stride + position // block_size, mask=mask, other=0)
    tl.store(slot_mapping + req * queries + q, block * block_size + position % block_size, mask=mask)
    tl.store(seq_lens + req, tl.load(seq_lens + req) - shift)


def fill_pending_triton(
    token_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
    block_tables: torch.Tensor, source_rows: torch.Tensor, bonus: torch.Tensor, drafts: torch.Tensor,
    rejected: torch.Tensor, block_size: int,
) -> torch.Tensor:
    num_reqs, queries = token_ids.shape
    for name, t in (("token_ids", token_ids), ("positions", positions), ("slot_mapping", slot_mapping)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [B, Q], got strides {t.stride()}")
    if block_tables.stride(1) != 1 or drafts.stride(1) != 1:
        raise ValueError(f"block_tables and drafts need unit column strides, got {block_tables.stride()} and {drafts.stride()}")
    if queries > 1 and drafts.shape[1] < queries - 1:
        raise ValueError(f"{queries} tokens a request need {queries - 1} drafts, the previous step has {drafts.shape[1]}")
    source_rows, bonus, rejected = source_rows.contiguous(), bonus.contiguous(), rejected.contiguous()  # [B], [B_prev]
    shift = torch.empty(num_reqs, dtype=torch.long, device=token_ids.device)  # [B]
    if num_reqs:
        _fill_pending_kernel[(num_reqs,)](
            token_ids, positions, seq_lens, slot_mapping, block_tables, source_rows, bonus, drafts, rejected, shift,
            queries, block_tables.stride(0), drafts.stride(0), block_size, BLOCK_Q=triton.next_power_of_2(queries),
            **FP_FUSION,
        )
    return shift

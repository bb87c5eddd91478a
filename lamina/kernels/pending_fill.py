"""Filling in a step planned ahead under MTP, the torch form (asynchronous scheduling,
lamina.engine.async_scheduling): the step was planned as if every draft of the step before were
accepted, so its tokens are pending and its positions may lie too late. On the device, before
the verification graph replays, each pending request's tokens become the previous step's target
token and drafts, and its positions, context length and KV slots move back by the drafts the
previous step rejected. Imports no Triton; the one-launch form is lamina.kernels.triton_pending_fill.

Shapes: B requests of Q tokens. `token_ids`, `positions`, `slot_mapping` [B, Q], `seq_lens` [B],
`block_tables` [B, M] (views of the verification graphs' input buffer, written in place);
`source_rows` [B] (each request's row in the previous step's results, -1 where nothing is
pending); the previous step's `bonus` [B_prev], `drafts` [B_prev, D >= Q - 1], `rejected`
[B_prev]. Every tensor int64. Returns the shift [B] (0 where nothing is pending).
"""

from __future__ import annotations

import torch


def fill_pending_reference(
    token_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
    block_tables: torch.Tensor, source_rows: torch.Tensor, bonus: torch.Tensor, drafts: torch.Tensor,
    rejected: torch.Tensor, block_size: int,
) -> torch.Tensor:
    queries = token_ids.shape[1]
    pending = source_rows >= 0  # [B]
    rows = source_rows.clamp(min=0)  # [B]
    shift = torch.where(pending, rejected.index_select(0, rows), 0)  # [B]
    filled = torch.cat([bonus.index_select(0, rows)[:, None], drafts.index_select(0, rows)[:, : queries - 1]], dim=1)  # [B, Q]
    token_ids.copy_(torch.where(pending[:, None], filled, token_ids))
    positions.sub_(shift[:, None])
    seq_lens.sub_(shift)
    # rows with nothing pending keep their slots: gather block 0 there, whatever their positions
    blocks = block_tables.gather(1, torch.where(pending[:, None], positions // block_size, 0))  # [B, Q]
    slot_mapping.copy_(torch.where(pending[:, None], blocks * block_size + positions % block_size, slot_mapping))
    return shift

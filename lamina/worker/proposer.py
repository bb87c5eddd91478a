"""The MTP proposer: runs the drafter on the last pipeline stage after the target's step.

Positions are the target's. A pass at position p reads the hidden state of p and the token at
p+1, writes the drafter's KV at p and predicts the token at p+2.

1. First pass: over all T tokens of the step, with the step's metadata (same positions, slots
   and token counts as the target, so expert-parallel replicas stay in lockstep). Token inputs
   are the step's tokens shifted by one; the last row of a prompt chunk reads the next prompt
   token (from the plan), and the last accepted row of a sampling request reads the token just
   emitted. Rows past the accepted prefix carry rejected drafts: their KV lands beyond the
   request's length and is overwritten before anything reads it. This pass runs even when no
   draft is wanted, so the drafter's KV history never has holes.
2. Drafts: the LM head on the first pass's output at each sampling request's last accepted
   position gives draft 1; pass j (one token per request, at position P + j, P the last accepted
   position) feeds draft j back and gives draft j+1. A loop over draft positions, never tokens.

Positions past a request's allocated KV blocks (only near max_model_len) are clamped to its last
slot; that only changes what the drafter remembers there, never the target's output.
"""

from __future__ import annotations

import torch

from lamina.host_to_device import to_device
from lamina.layers.metadata import ForwardMetadata
from lamina.step_plan import ScheduledChunk, StepPlan
from lamina.worker.rejection_sampler import sample_drafts
from lamina.worker.sampler import SamplingBatch


class MTPProposer:
    def __init__(self, mtp, device: torch.device, broadcast):
        self.mtp = mtp
        self.device = device
        self.broadcast = broadcast  # tensor -> the TP group's sampling rank's tensor

    def first_pass(
        self, token_ids: torch.Tensor, meta: ForwardMetadata, chunks: list[ScheduledChunk],
        bonus_rows: torch.Tensor, bonus_tokens: torch.Tensor, target_hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the drafter's (LM-head input, next-pass hidden) for every row of the step."""
        next_ids = torch.zeros_like(token_ids)  # [T]
        if meta.num_tokens > 0:
            next_ids[:-1] = token_ids[1:]
            ends, known = [], []
            start = 0
            for c in chunks:  # per request: where its chunk ends and the token after it, if known
                start += c.num_tokens
                if not c.sample and c.next_token_id is not None:
                    ends.append(start - 1)
                    known.append(c.next_token_id)
            if ends:
                next_ids.index_copy_(0, to_device(ends, self.device), to_device(known, self.device))
            next_ids.index_copy_(0, bonus_rows, bonus_tokens)
        return self.mtp(next_ids, target_hidden, meta, 0)

    def propose(
        self, plan: StepPlan, meta: ForwardMetadata, index: torch.Tensor, last_pos: torch.Tensor,
        max_pos: list[int], capacity: list[int], capacity_on_device: torch.Tensor, h_logits: torch.Tensor,
        h_next: torch.Tensor, batch: SamplingBatch | None, is_sampler: bool, first_output_index: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """`plan.num_draft_tokens` drafts for each sampling request. `index` [B] (device): the
        sampling requests' rows among the step's requests; `last_pos` [B] (device): the last
        accepted position; `max_pos` / `capacity` (host, and `capacity_on_device` [B]): its upper
        bound and the last position the request's blocks hold; `first_output_index` [B] (device):
        the output index draft 1 stands for (a seeded request draws draft j with the noise of
        index first + j - 1, the noise the target's sampling uses there). Returns per draft
        position the tokens [B] and (on the sampling rank, for random requests) the drafter's
        distribution [B, V]."""
        num = len(capacity)
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        for j in range(plan.num_draft_tokens):  # draft positions, not tokens
            token = torch.zeros(num, dtype=torch.long, device=self.device)  # [B]
            if num:
                logits = self.mtp.compute_logits(h_logits)  # [B, V]
                q = None
                if is_sampler:
                    draft_batch = batch
                    if first_output_index is not None:
                        draft_batch = batch.with_noise_positions(first_output_index + j)
                    token, q = sample_drafts(logits, draft_batch)
                token = self.broadcast(token)
                tokens.append(token)
                probs.append(q)
            if j + 1 < plan.num_draft_tokens:
                step_meta = self.draft_meta(plan, meta, index, last_pos, max_pos, capacity, capacity_on_device, j + 1)
                h_logits, h_next = self.mtp(token, h_next, step_meta, j + 1)
        return tokens, probs

    def draft_meta(
        self, plan: StepPlan, meta: ForwardMetadata, index: torch.Tensor, last_pos: torch.Tensor,
        max_pos: list[int], capacity: list[int], capacity_on_device: torch.Tensor, step: int,
    ) -> ForwardMetadata:
        """One token per sampling request at position last_pos + step (clamped to its blocks)."""
        num = len(capacity)
        positions = torch.minimum(last_pos + step, capacity_on_device)  # [B]
        tables = meta.block_tables.index_select(0, index)  # [B, max_blocks]
        block_size = self.mtp.paged_cache_modules()[0].k_cache.shape[1]
        blocks = tables.gather(1, (positions // block_size)[:, None])[:, 0]  # [B]
        max_seq_len = max((min(m + step, c) + 1 for m, c in zip(max_pos, capacity)), default=0)
        return ForwardMetadata(
            num_tokens=num,
            num_reqs=num,
            max_query_len=1 if num else 0,
            max_seq_len=max_seq_len,
            positions=positions,
            query_start_loc=torch.arange(num + 1, device=self.device),
            seq_lens=positions + 1,
            slot_mapping=blocks * block_size + positions % block_size,
            block_tables=tables,
            state_slots=meta.state_slots.index_select(0, index),
            has_initial_state=torch.ones(num, dtype=torch.bool, device=self.device),
            token_request_index=torch.arange(num, device=self.device),
            dp_num_tokens=plan.dp_num_samples,
            query_lens_host=(1,) * num,
            seq_lens_host=tuple(min(m + step, c) + 1 for m, c in zip(max_pos, capacity)),
            allow_groups=meta.allow_groups,
        )


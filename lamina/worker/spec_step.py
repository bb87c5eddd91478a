"""A rank's part of speculative decoding: per-position states, verification, drafts.

Every rank of a replica (all pipeline stages, all TP ranks) does the same from the same plans:

- Capture: a chunk with k drafts is `[last token, draft 1..k]`; recurrent layers keep the states
  after its first k tokens in the step's `StateCapture` (lamina.layers.metadata, spec_state),
  which this object builds from the plan, passes in `ForwardMetadata.state_capture` and holds
  until the next plan's commit. The state after the whole chunk is written to the slot as usual
  (right when all k are accepted).
- Commit: the next plan carries how many drafts each verified request accepted
  (`StepPlan.spec_commits`, from the engine); before its forward the rank copies the captured
  state after the accepted position into the slot. So slots only ever hold states of accepted
  tokens, on every stage, without any message flowing back along the pipeline.
- Last stage: the target's logits at every verified position are checked
  (lamina.worker.rejection_sampler) on TP rank 0, which shares the accepted counts and emitted
  tokens with its TP group; then the MTP proposer (lamina.worker.proposer) drafts for the next
  step. Drafts go back to the engine with the tokens and return in the next plan.

KV slots of rejected positions need no rollback: they lie beyond the request's length, are never
read, and are rewritten by the next step.

Asynchronous scheduling (single rank, verification graphs): the engine plans step N+1 before step
N's results reach the host, as if every draft of N were accepted. N+1's chunks then carry pending
tokens (N's target token and drafts) at positions that lie N's rejected count too late, and name
the requests whose commit of N the runner derives from N's accepted counts on the device
(`StepPlan.device_commits`). `previous` keeps what N left on the device for that; the
verification graphs fill the tokens in and move the positions back before the replay
(`VerifyGraphs.run`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lamina.host_to_device import to_device_many
from lamina.layers.metadata import ForwardMetadata, StateCapture
from lamina.sampling_params import SamplingParams
from lamina.step_plan import PENDING_TOKEN_ID, StepPlan
from lamina.worker.pending_step import PendingVerify, PreviousVerify, ReadyStep
from lamina.worker.proposer import MTPProposer
from lamina.worker.rejection_sampler import verify_drafts
from lamina.worker.sampler import SamplerOutput, SamplingBatch

NO_BANS = 1 << 62  # a generated-token count past any min_tokens: drafts are drawn without bans


@dataclass
class _VerifyInputs:
    """A verification's host side: per row (R) the sampling options and, for requests whose sampling
    reads them, the tokens generated before the row (penalties, bad words: the request's output and
    the drafts before the row), the prompt (repetition penalty) and the grammar's mask (None
    elsewhere, or None for the whole list when no row has any); and the ints its device part reads:
    the [B, W] grid of rows (flat), each row's request / position / draft, each request's k."""

    params: list
    out_lens: list[int]
    width: int
    int_lists: tuple[list[int], ...]
    outputs: list | None = None
    prompts: list | None = None
    masks: list | None = None


def _drafting_params(params: SamplingParams) -> SamplingParams:
    """A request's options for drawing drafts: without those that read its tokens (penalties, bad
    words), which the drafter does not apply (verification does, at every position)."""
    if not params.needs_output_tokens:
        return params
    return dataclasses.replace(params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                               bad_words=None)


class SpecDecodeStep:
    def __init__(
        self, model, device: torch.device, eos_token_ids: tuple[int, ...], vocab_size: int,
        sampler_kernels: str = "torch", logprobs_mode: str = "raw_logprobs",
    ):
        self.model = model
        self.logprobs_mode = logprobs_mode  # what verified tokens' logprobs report (lamina.worker.sampler)
        self.mtp = getattr(model, "mtp", None)  # None on stages other than the last
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.sampler_kernels = sampler_kernels  # the plain sampler's (seeded noise: one function for drafts and checks)
        self.proposer = MTPProposer(self.mtp, self.device, self.broadcast) if self.mtp is not None else None
        self._capture: StateCapture | None = None  # the last verification step's kept states
        self._captured: dict[str, tuple[int, int, int]] = {}  # request -> (slot, first captured row, rows)
        self._draft_probs: dict[str, torch.Tensor] = {}  # sampling rank: q [k, V] of the drafts last proposed
        # The last launched step's results on the device: for the next plan's pending tokens and
        # its device commits (asynchronous scheduling); None before the first step.
        self.previous: PreviousVerify | None = None
        self._copy_rows = None  # commits: the torch reference, an index_copy_ per state pool
        # On the Triton kernel set (any state layer on it; Qwen4-Exp's PLE convs have no kernel
        # choice of their own), one launch per group of like pools (lamina.kernels.triton_state_rows).
        if any(getattr(m, "kernels", None) == "triton" for m in model.state_modules()):
            from lamina.kernels.triton_state_rows import StateRowCopier

            self._copy_rows = StateRowCopier()

    # ---- states ----------------------------------------------------------------------------
    def capture_for(self, plan: StepPlan, buffers=None) -> StateCapture | None:
        """The tokens of this step whose states verification keeps, and where the layers put
        them (None: no drafts); `buffers`: the verify graphs' persistent capture rows
        (lamina.layers.spec_state.CaptureBuffers) when the step replays a graph."""
        self._captured = {}
        req: list[int] = []
        offset: list[int] = []
        for i, c in enumerate(plan.chunks):
            k = c.num_draft_tokens
            if k:
                self._captured[c.request_id] = (c.state_slot, len(req), k)
                first = c.num_tokens - 1 - k  # the request's last accepted token
                req += [i] * k
                offset += range(first, first + k)
        # replayed from a verification graph (`buffers`), the step's layers never read its tokens
        self._capture = StateCapture.from_host(req, offset, self.device, buffers, upload=buffers is None) if req else None
        return self._capture

    def commit(self, plan: StepPlan) -> None:
        """Put the state after each verified request's accepted position into its slot: from the
        accepted counts the plan carries (`spec_commits`), and for `device_commits` from the last
        step's rejected counts on the device (its results have not reached the engine yet)."""
        captured, self._captured = self._captured, {}
        capture, self._capture = self._capture, None
        rows, slots = [], []
        for request_id, accepted in plan.spec_commits.items():
            entry = captured.get(request_id)
            if entry is not None and accepted < entry[2]:  # all accepted: the slot is already right
                rows.append(entry[1] + accepted)
                slots.append(entry[0])
        if rows:
            rows_on_device, slots_on_device = to_device_many(self.device, rows, slots)  # one upload
            capture.commit(rows_on_device, slots_on_device, self._copy_rows)
        pending = [request_id for request_id in plan.device_commits if request_id in captured]
        if pending:
            if self.previous is None:
                raise RuntimeError("device commits in the plan, but no verification step ran on this rank")
            entries = [captured[request_id] for request_id in pending]
            batch_rows, last_rows, slots_on_device = to_device_many(
                self.device, [self.previous.rows[request_id] for request_id in pending],
                [e[1] + e[2] for e in entries], [e[0] for e in entries],
            )  # [P] each, one upload: the row, the row after its last captured one, the slot
            rejected = self.previous.rejected.index_select(0, batch_rows)  # [P]
            # the state after the last accepted token; none rejected: the slot already holds the
            # state after the whole chunk (-1: no copy)
            source = torch.where(rejected > 0, last_rows - rejected, -1)  # [P]
            capture.commit(source, slots_on_device, self._copy_rows, skip_negative=True)

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._draft_probs.pop(request_id, None)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """TP rank 0's `x` on every rank of the TP group."""
        ctx = self.model.ctx
        if ctx.tp_size == 1:
            return x
        return ctx.tp.all_reduce(x if ctx.tp_rank == 0 else torch.zeros_like(x))

    # ---- last stage --------------------------------------------------------------------------
    def finish_step(
        self, plan: StepPlan, stage_output: torch.Tensor, token_ids: torch.Tensor, meta: ForwardMetadata,
        block_size: int, logits: torch.Tensor | None = None, position_shift: torch.Tensor | None = None,
    ) -> PendingVerify | ReadyStep:
        """Verify this step's drafts, emit tokens and propose the next drafts, all queued on the
        device. `token_ids` [T] and `meta` are the step's inputs (the ones `stage_output` was
        computed from); `block_size` that of the paged caches; `logits`: optionally the LM head's
        output at every row `[T, V]` already computed (a verification graph's); `position_shift`
        [chunks] (device): how far each request's real positions lie before its chunk's (the
        drafts the previous step rejected, for a step planned before that step's results). Returns
        a handle whose `result()` gives the per-request results on TP rank 0 (empty elsewhere)."""
        model = self.model
        chunks = plan.chunks
        is_sampler = model.ctx.tp_rank == 0
        sample_index = [i for i, c in enumerate(chunks) if c.sample]
        sampled = [chunks[i] for i in sample_index]
        num = len(sampled)
        ends = [0]
        for c in chunks:
            ends.append(ends[-1] + c.num_tokens)
        drafts_k = [c.num_draft_tokens for c in sampled]
        base_rows = [ends[i + 1] - 1 - k for i, k in zip(sample_index, drafts_k)]  # last accepted row
        base_pos = [c.end_position - 1 - c.num_draft_tokens for c in sampled]
        base_out = [c.num_output_tokens for c in sampled]  # output index of each request's first row

        capacity = [len(c.block_table) * block_size - 1 for c in sampled]
        max_pos = [p + k for p, k in zip(base_pos, drafts_k)]  # with a position shift: upper bounds
        rows = [r for b, k in zip(base_rows, drafts_k) for r in range(b, b + k + 1)]  # [R]
        select = num > 0 and (logits is None or len(rows) != logits.shape[0])  # R == T, in order: no selection
        verify_host = self._verify_inputs(sampled, drafts_k, base_rows) if is_sampler and num else None
        # This step's host ints in one upload (each copy costs host time, and a gap on the device
        # whenever the step was not queued ahead).
        uploads = to_device_many(
            self.device, base_rows, base_pos, sample_index, capacity, drafts_k, rows if select else [], base_out,
            *(verify_host.int_lists if verify_host is not None else ()),
        )
        base_rows_t, base_pos_t, index_t, capacity_t, drafts_k_t, rows_t, base_out_t = uploads[:7]
        if position_shift is not None:  # output indices move back with the positions
            shift = position_shift.index_select(0, index_t)  # [B]
            base_pos_t, base_out_t = base_pos_t - shift, base_out_t - shift  # [B] each

        verified = None
        num_accepted = torch.zeros(num, dtype=torch.long, device=self.device)  # [B]
        bonus = torch.zeros(num, dtype=torch.long, device=self.device)  # [B]
        if num:
            if logits is None:
                logits = model.compute_logits(stage_output.index_select(0, rows_t))  # [R, V]
            elif select:
                logits = logits.index_select(0, rows_t)  # [T, V] -> [R, V]
            if is_sampler:
                verified = self._verify(logits, sampled, drafts_k, verify_host, uploads[7:], token_ids, base_out_t)
                num_accepted = verified.num_accepted
                bonus = verified.tokens.gather(1, num_accepted[:, None])[:, 0]
            packed = self.broadcast(torch.stack([num_accepted, bonus]))  # [2, B]
            num_accepted, bonus = packed[0], packed[1]

        bonus_rows = base_rows_t + num_accepted  # [B]
        target_hidden = self.mtp.target_hidden(stage_output, meta)
        h_logits, h_next = self.proposer.first_pass(token_ids, meta, chunks, bonus_rows, bonus, target_hidden)
        draft_batch = None
        if is_sampler and num and plan.num_draft_tokens:
            draft_batch = SamplingBatch.build(
                [_drafting_params(c.sampling_params) for c in sampled], [NO_BANS] * num, self.eos_token_ids, self.device, self.vocab_size,
                sampler_kernels=self.sampler_kernels,
            )
        drafts, probs = self.proposer.propose(
            plan, meta, index_t, base_pos_t + num_accepted, max_pos, capacity, capacity_t,
            h_logits.index_select(0, bonus_rows), h_next.index_select(0, bonus_rows), draft_batch, is_sampler,
            base_out_t + num_accepted + 1,
        )
        next_drafts = torch.stack(drafts, dim=1) if drafts else bonus.new_zeros((num, 0))  # [B, D]
        self.previous = PreviousVerify({c.request_id: b for b, c in enumerate(sampled)}, bonus, next_drafts,
                                       drafts_k_t - num_accepted)
        if not is_sampler or not num:
            return ReadyStep({})
        self._keep_draft_probs(sampled, probs)
        # accepted counts, emitted tokens and next drafts in one copy to the host
        packed = torch.cat([verified.num_accepted[:, None], verified.tokens, next_drafts], dim=1)  # [B, 1 + W + D]
        row_out = SamplerOutput(verified.row_tokens, verified.logprobs, verified.num_logprobs)
        return PendingVerify([c.request_id for c in sampled], drafts_k, packed, verified.tokens.shape[1], row_out)

    def _verify_inputs(self, sampled, drafts_k, base_rows) -> "_VerifyInputs":
        """Host side of verification: each row's sampling options, and the int lists the device
        part reads (uploaded with the step's other ints). The drafts themselves are read from the
        step's token ids on the device (`row_draft_at`: the token row of the draft a row checks,
        -1 at bonus rows): a step queued ahead has them only there."""
        params, out_lens, row_req, row_pos, row_draft_at = [], [], [], [], []
        outputs, prompts, masks = [], [], []
        for b, (c, k) in enumerate(zip(sampled, drafts_k)):  # per request: its k+1 rows
            drafts = c.token_ids[len(c.token_ids) - k:]
            if c.output_token_ids is not None and PENDING_TOKEN_ID in drafts:
                raise RuntimeError(f"request {c.request_id} reads its tokens, but its drafts are still pending")
            row_masks = [c.token_bitmask, *(c.draft_token_bitmasks or [None] * k)]
            for j in range(k + 1):
                params.append(c.sampling_params)
                out_lens.append(c.num_output_tokens + j)
                row_req.append(b)
                row_pos.append(j)
                row_draft_at.append(base_rows[b] + 1 + j if j < k else -1)
                # the row is reached only when drafts[:j] are accepted: they are its latest outputs
                outputs.append(None if c.output_token_ids is None else [*c.output_token_ids, *drafts[:j]])
                prompts.append(c.prompt_token_ids)
                masks.append(row_masks[j])
        width = max(drafts_k) + 1
        starts = [0]
        for k in drafts_k:
            starts.append(starts[-1] + k + 1)
        grid = [starts[b] + min(j, k) for b, k in enumerate(drafts_k) for j in range(width)]  # [B*W]
        return _VerifyInputs(params, out_lens, width, (grid, row_req, row_pos, row_draft_at, drafts_k),
                             *(None if all(v is None for v in values) else values for values in (outputs, prompts, masks)))

    def _verify(self, logits, sampled, drafts_k, host: "_VerifyInputs", device_ints: list[torch.Tensor],
                token_ids: torch.Tensor, base_out: torch.Tensor):
        """`base_out` [B] (device): each request's output index at its first row (real, after any
        position shift): a seeded row samples the token at output index base_out + j."""
        grid, row_req, row_pos, row_draft_at, num_drafts = device_ints
        row_draft = torch.where(row_draft_at >= 0, token_ids.index_select(0, row_draft_at.clamp(min=0)), -1)  # [R]
        batch = SamplingBatch.build(host.params, host.out_lens, self.eos_token_ids, self.device, self.vocab_size,
                                    output_token_ids=host.outputs, prompt_token_ids=host.prompts,
                                    token_bitmasks=host.masks, sampler_kernels=self.sampler_kernels)
        batch = batch.with_noise_positions(base_out.index_select(0, row_req) + row_pos)
        needs_q = batch.num_greedy + len(batch.seeded_rows) < len(host.params)  # random rows without a seed
        draft_probs = self._draft_prob_rows(sampled, drafts_k, row_draft, logits.shape[1]) if needs_q else None
        rows = grid.view(len(sampled), host.width)  # [B, W]
        return verify_drafts(logits, rows, row_req, row_pos, row_draft, num_drafts, batch, draft_probs,
                             logprobs_mode=self.logprobs_mode)

    def _draft_prob_rows(self, sampled, drafts_k, row_draft: torch.Tensor, vocab: int) -> torch.Tensor:
        """q [R, V] at every verified row: the stored draft distributions (a point mass at the
        draft when none was stored, e.g. for drafts drawn greedily), zeros at bonus rows.
        `row_draft` [R] (device): the draft checked at each row."""
        blocks, row = [], 0
        for c, k in zip(sampled, drafts_k):
            block = torch.zeros(k + 1, vocab, device=self.device)  # [k+1, V]
            stored = self._draft_probs.get(c.request_id)
            if k and stored is not None and stored.shape[0] >= k and not c.sampling_params.greedy:
                block[:k] = stored[:k]
            elif k:
                block[torch.arange(k, device=self.device), row_draft[row : row + k]] = 1.0
            blocks.append(block)
            row += k + 1
        return torch.cat(blocks)

    def _keep_draft_probs(self, sampled, probs) -> None:
        """The drafter's distributions of the drafts just proposed, for the next verification of
        random requests without a seed (seeded ones are verified by coupling, which needs none; on the
        device: the next step may be queued before these results are read)."""
        for b, c in enumerate(sampled):
            params = c.sampling_params
            if probs and probs[0] is not None and not params.greedy and params.seed is None:
                self._draft_probs[c.request_id] = torch.stack([q[b] for q in probs])  # [D, V]
            else:
                self._draft_probs.pop(c.request_id, None)

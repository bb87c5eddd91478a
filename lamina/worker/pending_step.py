"""A launched step whose sampled tokens the host has not read yet (asynchronous scheduling).

`ModelRunner.launch` queues a step's forward and sampling on the device and returns one of these
at once; `result()` waits for that step alone (an event recorded after its sampling, not the
whole stream: the next step may already be queued behind it) and builds the per-request
`SampledToken`s. The sampled ids and logprobs travel to pinned host memory with non-blocking
copies issued at launch, so waiting costs no extra round trip.

`PreviousTokens` is the other half: the device tensor of the ids the last launched step sampled
and the row of each request in it, from which the next step's pending tokens
(`step_plan.PENDING_TOKEN_ID`) are filled in on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lamina.step_plan import PENDING_TOKEN_ID, SampledToken, ScheduledChunk
from lamina.worker.sampler import LogprobsTensors, SamplerOutput


class ReadyStep:
    """A step whose results are already on the host (synchronous paths, empty steps)."""

    def __init__(self, results: dict[str, SampledToken]):
        self._results = results

    def result(self) -> dict[str, SampledToken]:
        return self._results


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    # From CUDA, a non-blocking copy lands in pinned memory: valid once the step's event completes.
    return tensor.to("cpu", non_blocking=True)


def _output_to_host(out: SamplerOutput) -> SamplerOutput:
    logprobs = out.logprobs
    if logprobs is not None:
        logprobs = LogprobsTensors(*(_to_host(getattr(logprobs, f.name)) for f in dataclasses.fields(logprobs)))
    return SamplerOutput(_to_host(out.token_ids), logprobs, out.num_logprobs)


def _recorded_event():
    event = torch.cuda.Event()
    event.record()
    return event


class PendingSamples:
    """Sampled tokens (and logprobs) of `chunks`, still being computed or copied to the host."""

    def __init__(self, chunks: list[ScheduledChunk], out: SamplerOutput):
        self.chunks = chunks
        self.event = None
        if out.token_ids.device.type == "cuda":
            out = _output_to_host(out)
            self.event = _recorded_event()
        self.out = out

    def result(self) -> dict[str, SampledToken]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        out = self.out
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs_lists()
        return {c.request_id: SampledToken(t, lp) for c, t, lp in zip(self.chunks, token_ids, logprobs)}


@dataclass
class PreviousTokens:
    """The last launched step's sampled ids on the device and each sampling request's row in them."""

    sampled: torch.Tensor  # [B_prev] int64, on the device
    rows: dict[str, int]

    def source_rows(self, chunks: list[ScheduledChunk], positions_per_chunk: bool = False) -> list[int] | None:
        """For each token of `chunks` (or each chunk's first token when `positions_per_chunk`), the
        row of `sampled` that holds it when it is pending, else -1; None when nothing is pending."""
        rows, any_pending = [], False
        for chunk in chunks:
            tokens = chunk.token_ids[:1] if positions_per_chunk else chunk.token_ids
            for token in tokens:
                if token != PENDING_TOKEN_ID:
                    rows.append(-1)
                    continue
                row = self.rows.get(chunk.request_id)
                if row is None:
                    raise RuntimeError(
                        f"request {chunk.request_id!r}: a pending token, but the last launched step sampled "
                        "nothing for it (asynchronous scheduling out of order)"
                    )
                rows.append(row)
                any_pending = True
        return rows if any_pending else None

    def fill(self, token_ids: torch.Tensor, source_rows: torch.Tensor) -> None:
        """In place: `token_ids[i] = sampled[source_rows[i]]` where `source_rows[i] >= 0` (on the device)."""
        taken = self.sampled.index_select(0, source_rows.clamp(min=0))  # [T]
        torch.where(source_rows >= 0, taken, token_ids, out=token_ids)


class PendingVerify:
    """A speculative step's results on their way to the host: per request (rows of `packed`
    `[B, 1 + W + D]`) the accepted count, the W emitted-token slots and the D next drafts, and
    per verified row the emitted token's logprobs (`row_out`). Copied at launch, read by
    `result()` once the step's event has passed, so the next step can be queued meanwhile."""

    def __init__(self, request_ids: list[str], drafts_k: list[int], packed: torch.Tensor, width: int,
                 row_out: SamplerOutput):
        self.request_ids = request_ids
        self.drafts_k = drafts_k
        self.width = width
        self.event = None
        self.num_rows = sum(k + 1 for k in drafts_k)
        self.row_out = row_out if row_out.logprobs is not None else None  # no logprobs asked: nothing to copy
        if packed.device.type == "cuda":
            packed = _to_host(packed)
            if self.row_out is not None:
                self.row_out = _output_to_host(self.row_out)
            self.event = _recorded_event()
        self.packed = packed

    def result(self) -> dict[str, SampledToken]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        host = self.packed.tolist()  # [B, 1 + W + D]
        row_lps = self.row_out.logprobs_lists() if self.row_out is not None else [None] * self.num_rows
        results, row = {}, 0
        for b, (request_id, k) in enumerate(zip(self.request_ids, self.drafts_k)):
            accepted = host[b][0]
            emitted = host[b][1 : 1 + accepted + 1]
            lps = row_lps[row : row + accepted + 1]
            results[request_id] = SampledToken(
                token_id=emitted[-1], logprobs=lps[-1], accepted_token_ids=emitted[:-1], accepted_logprobs=lps[:-1],
                num_draft_tokens=k, draft_token_ids=host[b][1 + self.width :],
            )
            row += k + 1
        return results


@dataclass
class PreviousVerify:
    """The last launched speculative step's results on the device, for a step planned before they
    reach the host (asynchronous scheduling): each sampling request's row, the target's token after
    its accepted drafts, the drafts proposed for the next step, and how many of its drafts were
    rejected (its positions in the next plan lie that far too late)."""

    rows: dict[str, int]
    bonus: torch.Tensor  # [B] long
    drafts: torch.Tensor  # [B, D] long
    rejected: torch.Tensor  # [B] long

    def source_rows(self, chunks: list[ScheduledChunk]) -> list[int] | None:
        """Each chunk's row here when its tokens are pending (all of them: the bonus token and
        the drafts), else -1; None when no chunk is pending."""
        rows, any_pending = [], False
        for chunk in chunks:
            if chunk.token_ids[0] != PENDING_TOKEN_ID:
                if PENDING_TOKEN_ID in chunk.token_ids:
                    raise RuntimeError(f"request {chunk.request_id!r}: only some of its tokens are pending")
                rows.append(-1)
                continue
            row = self.rows.get(chunk.request_id)
            if row is None or chunk.num_tokens - 1 > self.drafts.shape[1]:
                raise RuntimeError(
                    f"request {chunk.request_id!r}: {chunk.num_tokens} pending tokens, but the last launched step "
                    f"{'did not sample for it' if row is None else f'proposed {self.drafts.shape[1]} drafts'} "
                    "(asynchronous scheduling out of order)"
                )
            rows.append(row)
            any_pending = True
        return rows if any_pending else None

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


class PendingSamples:
    """Sampled tokens (and logprobs) of `chunks`, still being computed or copied to the host."""

    def __init__(self, chunks: list[ScheduledChunk], out: SamplerOutput):
        self.chunks = chunks
        self.event = None
        if out.token_ids.device.type == "cuda":
            logprobs = out.logprobs
            if logprobs is not None:
                logprobs = LogprobsTensors(*(_to_host(getattr(logprobs, f.name)) for f in dataclasses.fields(logprobs)))
            out = SamplerOutput(_to_host(out.token_ids), logprobs, out.num_logprobs)
            self.event = torch.cuda.Event()
            self.event.record()
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

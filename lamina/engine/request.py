"""A request's bookkeeping on the engine side (pure Python, no tensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from lamina.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self._value_ not in _UNFINISHED_VALUES  # read for every request several times a step: no enum lookups


_UNFINISHED_VALUES = frozenset({RequestStatus.WAITING.value, RequestStatus.RUNNING.value})


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int
    max_tokens: int  # resolved: never lets the sequence exceed max_model_len
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    # Asynchronous scheduling: tokens sampled by a step still in flight, not yet appended (under
    # speculative decoding as if all its drafts were accepted: 1 + drafts verified), and the
    # drafts that step proposes, which the next step verifies without the host seeing them
    num_pending_tokens: int = 0
    num_pending_drafts: int = 0
    # Prefix caching: vLLM's cache_salt (prefixes are shared only between requests with the same
    # salt), the chained hashes of the full blocks of `all_token_ids` computed so far, and the
    # prompt tokens the request started with from a kept prefix (None: it never started from one)
    cache_salt: str | None = None
    prefix_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None
    # where the prompt parts from an earlier prompt (tokens, a block boundary; 0: nowhere useful),
    # looked up at the first admission (lamina.engine.prefix_cache, junctions)
    prefix_junction: int | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens the request will have once the step in flight reports (what the next step extends)."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens_with_pending(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

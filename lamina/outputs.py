"""Request outputs (vLLM-compatible shapes)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per generated token: the sampled token and the top k
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's timeline (`time.monotonic()` seconds), for metrics."""

    arrival_time: float  # the engine took the request
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # it first entered the running batch
    queue_time: float = 0.0  # time spent waiting for the running batch: the first wait and each after a preemption
    last_token_time: float | None = None
    # gaps between consecutive steps that gave it tokens (one per step, as vLLM's inter-token latency)
    inter_token_latencies: array = field(default_factory=lambda: array("d"))


class Logprob(float):
    """A token's logprob, as vLLM's `Logprob`: `.logprob`, `.rank` (1 = the most likely token) and
    `.decoded_token` (its text; None without a tokenizer). It is also the float itself, so code that
    reads logprob dict values as numbers keeps working."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, logprob)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):  # pickles across rank processes with its rank and text
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass
class SpecDecodeMetrics:
    """Speculative decoding counters (per request on `RequestOutput.spec_decode`, and per engine).

    A verification step checks `k >= 1` draft tokens of one request; draft position j (1-based)
    was proposed when k >= j and accepted when the first j drafts all were.
    """

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_tokens_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        grow = num_drafts - len(self.draft_tokens_per_position)
        if grow > 0:
            self.draft_tokens_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.draft_tokens_per_position[j] += 1
            self.accepted_per_position[j] += int(j < num_accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.draft_tokens_per_position)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the target's own token)."""
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)
    spec_decode: SpecDecodeMetrics | None = None  # set when speculative decoding is on
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per position
    # {token id: Logprob} with the prompt's token and the top-k (filled as prefill chunks run).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # With prompt_logprobs: each prompt token's rank in its position's distribution (1 = the most
    # likely token; None for the first), as vLLM's Logprob.rank.
    prompt_logprob_ranks: list[int | None] | None = None
    # vLLM's field: prompt tokens served from a kept prefix (enable_prefix_caching), else 0
    num_cached_tokens: int = 0

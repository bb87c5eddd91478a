"""A step plan: the scheduler's decision for one step, delivered to every rank of a replica; and
what a replica sends back (`SampledToken` per request).

Pure Python data (no tensors), so it can be pickled to and from worker processes. Each rank
derives its own input tensors from the plan; the token ids, positions and block tables are all
here. The engine and the worker both import this module; it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lamina.sampling_params import SamplingParams

# Asynchronous scheduling: a token sampled by the step still running on the device, not yet known
# on the host. The runner takes it from that step's sampled ids on the device (never a vocab id).
PENDING_TOKEN_ID = -1


@dataclass
class ScheduledChunk:
    request_id: str
    token_ids: list[int]  # the tokens computed in this step (PENDING_TOKEN_ID: sampled by the step in flight)
    start_position: int  # tokens of this request already in the cache
    block_table: list[int]
    state_slot: int
    sample: bool  # this chunk reaches the request's last known token: sample the next one
    sampling_params: SamplingParams
    num_output_tokens: int  # generated so far (for min_tokens)
    # Up to `token_history_len` tokens just before `start_position` (fewer at the start of a
    # request): layers that look back over token ids (N-gram PLE) read them on any stage.
    history_token_ids: list[int] = field(default_factory=list)
    # Speculative decoding: the last `num_draft_tokens` of `token_ids` are draft tokens to verify
    # (the chunk is then [last known token, drafts...]); `next_token_id` is the request's token at
    # `end_position` when already known (a prompt chunk that does not reach the end), which the
    # MTP drafter reads at the chunk's last position.
    num_draft_tokens: int = 0
    next_token_id: int | None = None
    # Sampling that reads the request's history (only set for requests that need it, on chunks that
    # sample): the tokens generated so far (penalties, bad words) and the prompt (repetition penalty).
    output_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    # Prompt logprobs: the prompt's length (positions p < num_prompt_tokens - 1 of this chunk score the
    # prompt token at p + 1); 0 when the request did not ask for them.
    num_prompt_tokens: int = 0
    # Structured output: the tokens the request's grammar allows next, one bit per vocabulary id
    # (a numpy int32 array of ceil(vocab / 32) words, filled by the engine); None: no constraint.
    token_bitmask: Any = None
    # ... and with drafts to verify, the masks of the positions after each draft (k entries: the
    # grammar advanced through drafts 1..j for the position after draft j); None without a grammar.
    draft_token_bitmasks: list | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass
class StepPlan:
    step_id: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests that ended (finished, aborted or preempted) since the last plan: workers drop
    # per-request state they keep (the drafter's draft probabilities on finish; nothing on preemption).
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Token counts of all data-parallel replicas in this step (set by the engine when DP > 1).
    dp_num_tokens: tuple[int, ...] | None = None
    # Speculative decoding: drafts to propose for each sampling request in this step; for every
    # request verified in the previous step and still running, how many drafts it accepted (each
    # rank rolls its recurrent states back to that position before this step's forward); and the
    # sampling-request counts of all data-parallel replicas (drafting passes under EP lockstep).
    num_draft_tokens: int = 0
    spec_commits: dict[str, int] = field(default_factory=dict)
    # Asynchronous scheduling (one rank): requests verified in the previous step whose accepted
    # counts the engine does not know yet; the runner commits them from its own on the device.
    device_commits: list[str] = field(default_factory=list)
    dp_num_samples: tuple[int, ...] | None = None
    # Prompt sharing (`n` / `best_of`): before this step's forward every rank copies cache rows,
    # (source, destination) pairs of plain ints: whole KV blocks of every paged-cache layer, and
    # whole recurrent-state slots of every state layer. A forked child starts from its source's
    # prompt state this way (Scheduler.add_group).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def has_copies(self) -> bool:
        return bool(self.block_copies or self.state_copies)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledToken:
    token_id: int | None  # None: no token this step (prompt logprobs only)
    logprobs: dict[int, float] | None = None
    # Speculative decoding: draft tokens accepted this step (emitted before `token_id`) and their
    # logprobs, how many drafts were checked, and the drafts proposed for the next step.
    accepted_token_ids: list[int] = field(default_factory=list)
    accepted_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_draft_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs scored in this step: entries for prompt positions prompt_logprobs_start, ...
    # (`token_id` is None for a chunk that scored prompt tokens without sampling).
    prompt_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs_start: int = 0
    prompt_logprob_ranks: list[int] | None = None  # each scored prompt token's rank (1 = most likely)

    @property
    def token_ids(self) -> list[int]:
        """Every token this step emitted, in order."""
        return [] if self.token_id is None else [*self.accepted_token_ids, self.token_id]

"""`n` and `best_of`: one request fanned out into `best_of` child sequences, collected back into one
`RequestOutput` with `outputs[0..n-1]` (vLLM semantics).

Each child is a request to the scheduler with its own KV blocks and recurrent-state slot; they are
added as a group (`Scheduler.add_group`), so child 0 prefills `prompt[:-1]` once and the others
start from copies of its cache (every child then computes the last prompt token and samples its
first token itself). A seeded parent gives child i the seed
`seed + i`, so the children differ and the whole request is reproducible.

With `best_of > n` the children track their cumulative logprob (each samples with at least
`logprobs = 0`), and the parent's output appears once, when every child has finished: the `n`
children with the highest cumulative logprob, best first. With `best_of == n` the parent reports
every step, its completions in child order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lamina.outputs import CompletionOutput, RequestOutput
from lamina.sampling_params import SamplingParams

__all__ = ["ParentRequest", "child_params", "child_request_id"]


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sampling parameters of child `index`: one sequence; its own seed; logprobs kept (at least
    the sampled token's) when candidates are ranked; prompt logprobs computed once, by child 0."""
    child = params.clone()
    child.n = child.best_of = 1
    if params.seed is not None:
        child.seed = params.seed + index
    if params.best_of > params.n and child.logprobs is None:
        child.logprobs = 0
    if index > 0:
        child.prompt_logprobs = None
    child.bad_words_token_ids = params.bad_words_token_ids
    return child


@dataclass
class ParentRequest:
    request_id: str
    params: SamplingParams
    child_ids: list[str]
    latest: dict[str, RequestOutput] = field(default_factory=dict)

    @property
    def ranked(self) -> bool:
        return self.params.best_of > self.params.n

    def update(self, child: RequestOutput) -> RequestOutput | None:
        """Record a child's newest output; returns the parent's output when there is one to report."""
        self.latest[child.request_id] = child
        finished = len(self.latest) == len(self.child_ids) and all(o.finished for o in self.latest.values())
        if self.ranked and not finished:
            return None
        # (child index, completion) of every child heard from so far, in child order
        indexed = [(i, self.latest[c].outputs[0]) for i, c in enumerate(self.child_ids) if c in self.latest]
        if self.ranked:
            def score(item: tuple[int, CompletionOutput]) -> float:
                value = item[1].cumulative_logprob
                return -math.inf if value is None or math.isnan(value) else value

            best = sorted(indexed, key=score, reverse=True)[: self.params.n]
            indexed = [(rank, c) for rank, (_, c) in enumerate(best)]
        keep_logprobs = self.params.logprobs is not None
        outputs = [
            CompletionOutput(
                index=index, text=c.text, token_ids=c.token_ids,
                cumulative_logprob=c.cumulative_logprob if keep_logprobs or self.ranked else None,
                logprobs=c.logprobs if keep_logprobs else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            )
            for index, c in indexed
        ]
        first = self.latest.get(self.child_ids[0]) or child
        return RequestOutput(
            request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=outputs, finished=finished, metrics=first.metrics, prompt_logprobs=first.prompt_logprobs,
            prompt_logprob_ranks=first.prompt_logprob_ranks,
            spec_decode=first.spec_decode, num_cached_tokens=first.num_cached_tokens,
        )

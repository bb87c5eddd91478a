"""Beam search over the offline API, as vLLM's `LLM.beam_search`.

Each step asks the engine for one token of every live beam with its 2 x beam_width most likely
continuations (`logprobs`), extends every beam by each of them, and keeps the beam_width best by
score: cumulative logprob / length ** length_penalty, the length counting the prompt and not a final
EOS (vLLM's `get_beam_search_score`). A beam that picks an EOS token (unless `ignore_eos`) is complete;
after `max_tokens` steps the complete and the live beams compete, the best beam_width are returned,
best first, each with its text decoded from all its tokens (prompt included), as vLLM's.

Every step submits each beam's whole sequence: without prefix caching it is computed again, the cost
growing with max_tokens x beam_width x length; with `enable_prefix_caching` a beam starts from the
longest kept block-aligned prefix of it (its prompt's, or its parent beam's at an earlier step),
as vLLM reuses the shared prefixes' KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lamina.outputs import Logprob


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (the prompt's first), each generated position's logprobs, its score's
    cumulative logprob; `text` and `finish_reason` once returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (length ** length_penalty)


def beam_search(llm: Any, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """`llm`: a lamina LLM; `prompts`: token-id prompts ({"prompt_token_ids": [...]}) or text."""
    from lamina.sampling_params import SamplingParams

    engine = llm.engine
    eos = frozenset(engine.eos_token_ids)
    tokenizer = engine.tokenizer
    starts = []
    for prompt in prompts:
        _, token_ids = engine.prepare_prompt(prompt)
        starts.append([BeamSearchSequence(tokens=list(token_ids))])
    live, done = starts, [[] for _ in prompts]
    step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width)
    for _ in range(params.max_tokens):
        flat = [beam for beams in live for beam in beams]
        if not flat:
            break
        outputs = llm.generate([{"prompt_token_ids": beam.tokens} for beam in flat], step_params, use_tqdm=False)
        at = 0
        for i, beams in enumerate(live):
            grown = []
            for beam, output in zip(beams, outputs[at:at + len(beams)]):
                entry = output.outputs[0].logprobs[0]  # {token id: Logprob}: the sampled token and the 2W likeliest
                for token_id, logprob in entry.items():
                    child = BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [entry],
                                               cum_logprob=beam.cum_logprob + float(logprob))
                    if token_id in eos and not params.ignore_eos:
                        child.finish_reason, child.stop_reason = "stop", None
                        done[i].append(child)
                    else:
                        grown.append(child)
            at += len(beams)
            grown.sort(key=lambda b: beam_score(b, eos, params.length_penalty), reverse=True)
            live[i] = grown[:params.beam_width]
    results = []
    for finished, beams in zip(done, live):
        for beam in beams:
            beam.finish_reason = "length"
        best = sorted(finished + beams, key=lambda b: beam_score(b, eos, params.length_penalty), reverse=True)
        best = best[:params.beam_width]
        for beam in best:
            tokens = beam.tokens
            if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                tokens = tokens[:-1]
            beam.text = tokenizer.decode(tokens) if tokenizer is not None else None
        results.append(BeamSearchOutput(best))
    return results

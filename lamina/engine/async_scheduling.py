"""Asynchronous scheduling (vLLM's `async_scheduling`): plan and launch step N+1 while step N runs.

Without it the device idles while the host reads step N's tokens, detokenizes them, checks stops,
plans step N+1 and fills its inputs (~0.6 ms a step at batch 1 on an H200, against a ~3 ms
step). With it `LLMEngine.step` launches the next step first and then processes the one before:

1. plan step N+1 with every request of step N one token further (`Request.num_pending_tokens`);
   the chunk of a request whose token is pending carries `PENDING_TOKEN_ID`, which the runner
   fills in on the device from step N's sampled ids (`lamina.worker.pending_step`);
2. launch it (`ModelRunner.launch`: forward and sampling queued, nothing read back);
3. wait for step N alone, append its tokens, detokenize, check stops, emit outputs.

A request that stops at step N was already part of step N+1: that token is computed and dropped,
and its cache, freed when it stops, is reused only by steps queued after N+1. Tokens and outputs
are the same as without overlap (a request's result never depends on the rest of its batch).

A step overlaps the next only when nothing in the next plan needs its tokens on the host:
requests whose sampling reads their generated tokens (penalties, bad words), structured output
(the grammar advances with each token), and prompt logprobs are processed before anything else
is planned. Several ranks and token-history models (Qwen4-Exp's N-gram PLE reads earlier token
ids on the host) are not supported yet: `auto` leaves it off there.

Speculative decoding (MTP) overlaps too (on in `auto` since it was measured on an H200: 0.2-0.5 ms
a step faster at batch 1 and 0.4-1.0 ms at batch 8 for every K, docs/PERFORMANCE.md sessions 22-23): step N+1 is planned as if every draft of step N were accepted,
its chunks `[N's target token, N's drafts]` all pending; the verification graphs fill them in on
the device and move the positions back by N's rejected count, the runner commits N's recurrent
states from N's accepted counts on the device (`StepPlan.device_commits`), and the engine takes
the rejected drafts back from each request's computed tokens when N reports
(`Scheduler.on_verified`). It plans ahead only when the verification graphs can take the whole
next step (`LLMEngine._may_plan_ahead`: every running request decoding, nothing waiting, no
min_tokens still to reach); otherwise step N reports first, as without overlap.
"""

from __future__ import annotations

from lamina.step_plan import StepPlan


def resolve_async_scheduling(
    requested: bool | None, *, device_type: str, single_rank: bool, token_history_len: int,
) -> bool:
    """`requested` None (auto): on for a single-rank CUDA engine where supported, with or without
    speculative decoding. True where it is not supported raises, naming why."""
    unsupported = []
    if not single_rank:
        unsupported.append("more than one rank (tensor / pipeline / data / expert parallel)")
    if token_history_len > 0:
        unsupported.append(f"a model whose layers read earlier token ids (token_history_len = {token_history_len})")
    if requested is None:
        return device_type == "cuda" and not unsupported
    if requested and unsupported:
        raise ValueError(
            "async_scheduling = True is not supported with " + "; ".join(unsupported)
            + ". Leave it unset (auto) or set it to False."
        )
    return bool(requested)


def plan_may_overlap(plans: list[StepPlan], has_grammar) -> bool:
    """The next step may be planned before this one's tokens reach the host: no chunk scores
    prompt logprobs, and no sampling chunk reads its request's tokens (penalties, bad words) or
    follows a grammar (`has_grammar(request_id)`)."""
    for plan in plans:
        for chunk in plan.chunks:
            if chunk.num_prompt_tokens:
                return False
            if chunk.sample and (chunk.sampling_params.needs_output_tokens or has_grammar(chunk.request_id)):
                return False
    return True

"""The engine's warm-up on CUDA: throwaway requests through the normal path, so the first real
request does not pay for compiling the prefill kernels (`WarmUp.warm_up`)."""

from __future__ import annotations

from lamina.sampling_params import SamplingParams

__all__ = ["WarmUp", "WARM_UP_PROMPT_TOKENS", "WARM_UP_REQUEST_ID"]

WARM_UP_PROMPT_TOKENS = 256  # several 64-token chunks of the delta-net prefill kernels
WARM_UP_SHORT_PROMPT_TOKENS = 32  # a short prompt's step (the fused MoE's decode-sized tiles)
# With 32 and 256, every power of two from 8 to 512 tokens: the fused MoE's alignment compiles once per
# power-of-two bucket of (token, expert) pairs, and mixed steps of any size between decode and a long
# chunk come (a 281-token step of an offline run compiled it for 4.3 s before these were warmed).
WARM_UP_SIZE_CLASSES = (8, 16, 64, 128, 512)
WARM_UP_REQUEST_ID = "lamina-warm-up"


def _cut_prompt_lengths(budget: int, seqs: int, per_request: int) -> list[int]:
    """The warm-up's last prompts (lengths), of which the token budget cuts one so that the next
    step continues it over its cached context: the varlen attention kernel and fla's chunked delta
    rule from an initial state compile on their first such chunk (~1.5 s at head dim 256 once
    landed in a 16k prompt's TTFT). Triton specialises integer arguments equal to 1 or divisible
    by 16, so the rest is as long as real prompts' continued chunks: with prompts longer than the
    budget, one of min(2 x budget, per_request) tokens (up to a whole budget continues); otherwise
    whole prompts up to 16 tokens short of the budget (never ending exactly on it), then one of
    per_request tokens that the budget cuts after its first 16 (more, when only seqs - 1 prompts
    fit before it). None when `seqs` prompts of `per_request` fit one budget: then no prompt is
    ever cut."""
    if per_request < 2 or per_request * seqs <= budget:
        return []
    if per_request > budget:
        return [min(2 * budget, per_request)]
    first = min(per_request - 1, max(16, budget - (seqs - 1) * per_request))  # the cut prompt's first chunk
    head = budget - first  # whole prompts before it: at most seqs - 1 of per_request tokens
    count = -(-head // per_request)
    return [head // count + (i < head % count) for i in range(count)] + [per_request]


class WarmUp:
    """Mixin of `LLMEngine`: reads its `model_config`, `max_model_len`, `max_num_seqs`,
    `max_num_batched_tokens` and `num_replicas`, and drives it through `add_request`, `step` and
    `_reset_statistics`."""

    def warm_up(self, num_tokens: int = WARM_UP_PROMPT_TOKENS) -> None:
        """Throwaway requests (prompts of ids, one greedy token each) through the normal path, so the
        first real request does not pay for compiling the prefill kernels (Triton's JIT, fla-core's
        autotuning: seconds to minutes on a cold cache; the decode steps were compiled by the graph
        capture). Kernels are compiled per step size class: the fused MoE picks its tiles by the
        step's token count (an 8k chunk's tiles once cost the first 8k request 11 s of compiling),
        and Triton specialises integer arguments divisible by 16 and equal to 1 (fla-core's kernels;
        lamina's leave their step-size counts unspecialised). So the warm-up runs steps of a short
        prompt (WARM_UP_SHORT_PROMPT_TOKENS), of `num_tokens` and of the whole token budget
        (`max_num_batched_tokens`, in as many requests as `max_model_len` needs), each once as one
        step of that many tokens and once one token short over two requests, and one step of each
        of WARM_UP_SIZE_CLASSES below the budget, and prompts of which the budget cuts one, so the
        next step continues it over its cached context (`warm_up_steps`). Leaves
        the engine as it found it: no request, every cache block free, the statistics reset. Run by
        the constructor on CUDA. Prefix caching stays off meanwhile (it would cut the steps short and
        keep the throwaway prompts)."""
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up() runs on an idle engine only")
        prefixes = [cache.prefix for cache in self.caches]
        for cache in self.caches:
            cache.prefix = None
        try:
            self._warm_up_steps(num_tokens)
        finally:
            for cache, prefix in zip(self.caches, prefixes):
                cache.prefix = prefix
        self._reset_statistics()

    def _warm_up_steps(self, num_tokens: int) -> None:
        vocab = self.model_config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for step, lengths in enumerate(self.warm_up_steps(num_tokens)):
            for replica in range(self.num_replicas):  # one set each: a new request goes to the least busy replica
                for index, length in enumerate(lengths):
                    prompt = [(7 * i + 3 * index + 1) % vocab for i in range(length)]
                    request_id = f"{WARM_UP_REQUEST_ID}-{step}-{index}-{replica}"
                    self.add_request({"prompt_token_ids": prompt}, params, request_id=request_id)
            while self.has_unfinished_requests():
                self.step()

    def warm_up_steps(self, num_tokens: int = WARM_UP_PROMPT_TOKENS) -> list[list[int]]:
        """The warm-up's steps, each the prompt lengths of the requests added together."""
        per_request = max(1, self.max_model_len - 1)  # the longest prompt that still samples a token
        budget = min(self.max_num_batched_tokens, per_request * self.max_num_seqs)  # the largest step there can be
        steps: list[list[int]] = []
        both = {min(t, budget) for t in (WARM_UP_SHORT_PROMPT_TOKENS, max(1, num_tokens), budget)}
        size_classes = {t for t in WARM_UP_SIZE_CLASSES if t < budget} - both
        for total in sorted(both | size_classes):
            for tokens, fewest in ((total, 1), (total - 1, 2))[:2 if total in both else 1]:
                count = min(max(fewest, -(-tokens // per_request)), self.max_num_seqs)
                if tokens < count:
                    continue
                lengths = [tokens // count + (i < tokens % count) for i in range(count)]
                if lengths not in steps and max(lengths) <= per_request:
                    steps.append(lengths)
        cut = _cut_prompt_lengths(self.max_num_batched_tokens, self.max_num_seqs, per_request)
        if cut:
            steps.append(cut)
        return steps

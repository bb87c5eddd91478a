"""Requests checked before they are queued: prompts (text, ids, dicts) to token ids, vLLM's prompt
truncation, and every sampling option checked against the model and the engine's limits, with errors
that name the offending value (`RequestValidation`)."""

from __future__ import annotations

import operator

from lamina.sampling_params import SamplingParams

__all__ = ["RequestValidation", "MULTIMODAL_PROMPT_KEYS"]

# vLLM's prompt-dict keys for images, audio and video: lamina serves the text model only, so such a
# prompt is refused rather than answered without them
MULTIMODAL_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


def _token_ids(ids) -> list[int]:
    """A prompt's token ids as Python ints (numpy / torch integers too); anything else is refused."""
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        bad = next((t for t in ids if not hasattr(t, "__index__")), ids)
        raise ValueError(f"prompt token ids must be integers, got {bad!r} ({type(bad).__name__})") from None


class RequestValidation:
    """Mixin of `LLMEngine`: reads its `tokenizer`, `args`, `model_config`, `max_model_len` and
    `structured` (the structured-output manager)."""

    @property
    def no_tokenizer_reason(self) -> str:
        """Why there is no tokenizer, for error messages (empty when there is one)."""
        if self.tokenizer is not None:
            return ""
        if self.args.skip_tokenizer_init:
            return "the engine runs without a tokenizer (skip_tokenizer_init)"
        return "this model has no tokenizer"

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.no_tokenizer_reason}: text prompts cannot be tokenized; pass token ids "
                             "({'prompt_token_ids': [...]}, or a list of ints)")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def prepare_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as a string, a token-id list, or a dict with
        `prompt_token_ids` or `prompt`."""
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict):
            media = [key for key in MULTIMODAL_PROMPT_KEYS if prompt.get(key) is not None]
            if media:
                raise ValueError(f"the prompt carries {', '.join(media)}: lamina serves the text model of a checkpoint "
                                 "(no vision or audio encoder), so images, audio and video cannot be given")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, (list, tuple)):
            return None, _token_ids(prompt)
        raise TypeError(f"a prompt is a string, a token-id list or a dict, got {type(prompt).__name__}")

    @staticmethod
    def prompt_cache_salt(prompt) -> str | None:
        """A dict prompt's `cache_salt` (vLLM's: kept prefixes are shared only between prompts with
        the same salt), checked."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def prepare_request_prompt(self, prompt: str | list[int] | dict, keep: int | None) -> tuple[str | None, list[int]]:
        """`prepare_prompt`, then vLLM's truncate_prompt_tokens `keep`: only the last k tokens (-1: the
        last max_model_len; None: all) are kept; the text stays the prompt given (vLLM's output `prompt`)."""
        text, token_ids = self.prepare_prompt(prompt)
        return text, self.truncate_prompt(token_ids, keep)

    def truncate_prompt(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The last `keep` prompt tokens (-1: the last max_model_len; None: all)."""
        if keep is None:
            return token_ids
        keep = self.max_model_len if keep == -1 else keep
        return token_ids[-keep:] if len(token_ids) > keep else token_ids

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request before it is queued; returns its resolved max_tokens."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer ({self.no_tokenizer_reason}): use stop_token_ids instead")
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, which leaves no room to generate within "
                f"max_model_len = {self.max_model_len}"
            )
        self._check_logprobs(params)
        self._check_token_options(params, vocab)
        room = self.max_model_len - len(prompt_token_ids)
        return room if params.max_tokens is None else min(params.max_tokens, room)

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask a token (max_logprobs; -1 there: the vocabulary)."""
        return self.model_config.vocab_size if self.args.max_logprobs == -1 else self.args.max_logprobs

    def logprobs_limit_error(self, name: str, asked: int | None) -> str | None:
        """Why `name` = `asked` (logprobs or prompt_logprobs; -1: the vocabulary) is more than the
        engine allows (vLLM's max_logprobs), or None."""
        count = self.model_config.vocab_size if asked == -1 else asked
        if count is None or count <= self.max_logprobs:
            return None
        return (f"{name} = {asked} asks {count} logprobs a token, more than max_logprobs = {self.max_logprobs} allows "
                f"(start the engine with a larger max_logprobs, or -1 for the whole vocabulary)")

    def _check_logprobs(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            error = self.logprobs_limit_error(name, getattr(params, name))
            if error is not None:
                raise ValueError(error)

    def _check_token_options(self, params: SamplingParams, vocab: int) -> None:
        """Token ids of logit_bias / allowed_token_ids inside the vocabulary; bad words tokenized; a
        structured-output request's grammar compiled."""
        bad_bias = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary [0, {vocab})")
        bad_allowed = [t for t in (params.allowed_token_ids or []) if t >= vocab]
        if bad_allowed:
            raise ValueError(f"allowed_token_ids {bad_allowed[:5]} are outside the vocabulary [0, {vocab})")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer, and this model has none")
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # a bad schema / regex fails here

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as tokens, as written without a leading space and, when that tokenizes
        differently in its first token but to as many tokens, with one (vLLM's rule)."""
        sequences: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if plain:
                sequences.append(list(plain))
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                sequences.append(list(spaced))
        return sequences

"""Per-request sampling parameters.

:class:`SamplingParams` uses the same field names and defaults as vLLM's
``SamplingParams`` so that OpenAI-style request bodies and offline callers can
pass values straight through.  Only the subset of options that lamina
implements is exposed; every value is validated in ``__post_init__`` and a bad
value raises :class:`ValueError` whose message names the offending value and
the valid range.

Normalisation performed at construction time:

* ``stop`` (``None``, a string, or a sequence of strings) becomes ``list[str]``.
* ``stop_token_ids`` (``None`` or a sequence of ints) becomes ``list[int]``.
* ``top_k`` of ``0`` or ``-1`` both mean "disabled"; the value is kept as given
  (see :attr:`SamplingParams.top_k_enabled`).
* ``max_tokens=None`` means "generate until the context is full"; the engine
  resolves it against ``max_model_len`` (the value stays ``None`` here).
* ``best_of=None`` becomes ``n``; ``logit_bias`` keys become ints (JSON sends
  strings); ``bad_words`` and ``allowed_token_ids`` become lists.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
import numbers
from dataclasses import dataclass, field

from lamina.beam_search import BeamSearchParams  # noqa: F401 (vLLM imports it from here)
from lamina.structured_output import GuidedDecodingParams, StructuredOutputsParams  # noqa: F401 (vLLM imports both from here)

__all__ = ["SamplingParams", "RequestOutputKind", "GREEDY_TEMPERATURE_EPS", "MIN_TEMPERATURE", "MAX_LOGIT_BIAS"]

logger = logging.getLogger(__name__)

# Temperatures below this are greedy decoding (vLLM's _SAMPLING_EPS). Since every temperature in
# (0, MIN_TEMPERATURE) is first raised to MIN_TEMPERATURE, as vLLM does (its _MAX_TEMP: dividing
# logits by a tiny number only risks overflow), only 0 stays below it.
GREEDY_TEMPERATURE_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
# OpenAI's range for one logit_bias entry (the server's check; offline any finite bias or -inf).
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """Which outputs the engine reports for a request (vLLM's names and values)."""

    CUMULATIVE = 0  # after every step: everything generated so far
    DELTA = 1  # vLLM: only what is new since the last output (not supported by lamina)
    FINAL_ONLY = 2  # once, when the request finishes (what `LLM.generate` asks for)


def _is_int(value: object) -> bool:
    """True for Python/numpy integers, False for bools and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """True for real numbers (ints or floats), False for bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Sampling options of one request (vLLM-compatible names and defaults).

    Attributes:
        n: Number of completions returned per prompt (``>= 1``).
        best_of: Number of candidate completions generated (``>= n``; default
            ``n``); the ``n`` with the highest cumulative logprob are returned.
        presence_penalty: Subtracted from the logit of every token that already
            occurs in the output; in ``[-2, 2]``.
        frequency_penalty: Subtracted from a token's logit once per occurrence
            in the output; in ``[-2, 2]``.
        repetition_penalty: Tokens that occur in the prompt or the output have
            positive logits divided by it and negative ones multiplied by it;
            ``> 0``, ``1`` disables it.
        logit_bias: ``{token id: bias}`` added to the logits before sampling;
            any finite bias, or ``-inf`` to ban the token (as vLLM's offline
            API; the server keeps OpenAI's ``[-100, 100]``).
        allowed_token_ids: If given, only these token ids can be sampled.
        bad_words: Words that are never generated: the engine tokenizes each
            (with and without a leading space) and bans a sequence's last token
            whenever the output ends with the rest of it.
        structured_outputs: A :class:`~lamina.structured_output.StructuredOutputsParams`
            (or a dict of its fields: ``json``, ``json_object``, ``regex``,
            ``choice``, ``grammar``): the output must match it; enforced
            during sampling. ``guided_decoding`` (vLLM's older name, with
            ``GuidedDecodingParams``) is taken as it.
        extra_args: vLLM's arguments of custom logits processors: kept on the
            request, read by nothing (lamina has no custom logits processors).
        prompt_logprobs: If not ``None``, return for every prompt token after
            the first its logprob plus the ``prompt_logprobs`` most likely
            tokens' logprobs at that position; ``-1``: the whole vocabulary's
            (as vLLM; the engine's ``max_logprobs`` caps the count).
        truncate_prompt_tokens: Keep only the last ``k`` prompt tokens
            (``-1``: the last ``max_model_len``), as vLLM; ``None`` keeps all.
        detokenize: ``False`` skips detokenization: outputs carry token ids and
            an empty text (stop strings need it).
        temperature: Softmax temperature, ``>= 0``. Values below
            ``0`` selects greedy (argmax) decoding; values in
            ``(0, MIN_TEMPERATURE)`` are raised to ``MIN_TEMPERATURE`` (0.01)
            with a warning, as vLLM does.
        top_p: Nucleus sampling threshold in ``(0, 1]``; ``1`` disables it.
        top_k: Keep only the ``top_k`` most likely tokens; ``0`` or ``-1``
            disable it.
        min_p: Drop tokens whose probability is below ``min_p`` times the
            probability of the most likely token; in ``[0, 1]``, ``0``
            disables it. Applied before top-k / top-p, as vLLM does.
        seed: Optional integer seed: the request's random draws become a
            function of the seed and the output index, so its text is
            reproducible independently of the batch, of preemption and of
            speculative decoding (lamina.kernels.seeded_noise). ``-1`` means no
            seed, as in vLLM.
        max_tokens: Maximum number of generated tokens (``> 0``), or ``None``
            for "until ``max_model_len``" (resolved by the engine).
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this
            many tokens have been generated.
        stop: Stop strings; generation ends when the output text contains one.
        stop_token_ids: Token ids that end generation (in addition to EOS).
        ignore_eos: Do not stop when the model's EOS token is sampled.
        logprobs: If not ``None``, return the sampled token's logprob plus the
            ``logprobs`` most likely tokens' logprobs at every step; ``-1``:
            the whole vocabulary's, ``True``: 1 (as vLLM; the engine's
            ``max_logprobs`` caps the count).
        include_stop_str_in_output: Keep the matched stop string in the
            returned text.
        skip_special_tokens: Drop special tokens when detokenizing.
        spaces_between_special_tokens: Put spaces between special tokens when
            detokenizing (honoured only by tokenizers that support it).
        output_kind: :class:`RequestOutputKind`: ``CUMULATIVE`` (default) reports
            the whole output after every step, ``FINAL_ONLY`` only the finished
            one (``LLM.generate`` sets it; the engine then skips building the
            outputs of unfinished steps). ``DELTA`` is not supported.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's older name of structured_outputs (GuidedDecodingParams, before 0.11): taken into it
    guided_decoding: StructuredOutputsParams | dict | None = None
    # vLLM's per-request arguments of custom logits processors: kept, read by nothing in lamina
    extra_args: dict | None = None
    # Set by the engine from `bad_words` and its tokenizer: the token sequences to ban.
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()

    # ------------------------------------------------------------------ #
    # Normalisation and validation
    # ------------------------------------------------------------------ #
    def _normalise(self) -> None:
        """Convert ``stop`` / ``stop_token_ids`` to lists (type-checked)."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            try:
                stops = list(self.stop)
            except TypeError:
                raise ValueError(
                    f"stop must be a string or a list of strings, got {self.stop!r}"
                ) from None
            for s in stops:
                if not isinstance(s, str):
                    raise ValueError(
                        f"stop must be a string or a list of strings, got entry {s!r} "
                        f"of type {type(s).__name__}"
                    )
            self.stop = stops

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            try:
                ids = list(self.stop_token_ids)
            except TypeError:
                raise ValueError(
                    f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}"
                ) from None
            for t in ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(
                        f"stop_token_ids must contain non-negative ints, got {t!r}"
                    )
            self.stop_token_ids = [int(t) for t in ids]

        self._normalise_token_options()

    def _normalise_token_options(self) -> None:
        """Type-check and normalise ``logit_bias``, ``allowed_token_ids`` and ``bad_words``."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r}")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                try:
                    tok = int(key) if isinstance(key, str) else key
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids (ints), got {key!r}") from None
                if not _is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
                if not _is_real(value) or math.isnan(value) or value == math.inf:
                    raise ValueError(
                        f"logit_bias values must be finite numbers, or -inf to ban a token, got {value!r} for token {key!r}"
                    )
                bias[int(tok)] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            try:
                ids = list(self.allowed_token_ids)
            except TypeError:
                raise ValueError(f"allowed_token_ids must be a list of ints, got {self.allowed_token_ids!r}") from None
            if not ids:
                raise ValueError("allowed_token_ids is empty: give at least one token id (or None for all)")
            for t in ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(f"allowed_token_ids must contain token ids >= 0, got {t!r}")
            self.allowed_token_ids = [int(t) for t in ids]
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            try:
                words = list(words)
            except TypeError:
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}") from None
            for w in words:
                if not isinstance(w, str) or not w.strip():
                    raise ValueError(f"bad_words must contain non-empty strings, got {w!r}")
            self.bad_words = words or None
        if self.best_of is None:
            self.best_of = self.n
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (vLLM's older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")

    def _validate(self) -> None:
        """Raise ValueError for any out-of-range field."""
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not _is_int(self.best_of) or self.best_of < self.n:
            raise ValueError(f"best_of must be an int >= n = {self.n}, got {self.best_of!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or math.isnan(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or math.isnan(rp) or math.isinf(rp) or rp <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {rp!r}")
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or not (self.truncate_prompt_tokens >= 1
                                                                 or self.truncate_prompt_tokens == -1)):
            raise ValueError(f"truncate_prompt_tokens must be an int >= 1, -1 (max_model_len) or None, "
                             f"got {self.truncate_prompt_tokens!r}")
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be a bool, got {self.detokenize!r}")
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (the text is where they are found); "
                             "use stop_token_ids instead")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:  # vLLM's spelling of 1
                setattr(self, name, 1)
            elif value is not None and (not _is_int(value) or value < -1):
                raise ValueError(f"{name} must be an int >= 0, -1 (the whole vocabulary) or None, got {value!r}")

        if not _is_real(self.temperature) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}"
            )
        if math.isinf(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which risks inf / nan in the logits; raised to %s (as vLLM)",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE

        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an int >= -1 (0 or -1 disable it), got {self.top_k!r}"
            )

        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed == -1:  # vLLM's convention: -1 means no seed
            self.seed = None

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens <= 0):
            raise ValueError(
                f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}"
            )

        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens (in [0, {self.max_tokens}]), "
                f"got min_tokens={self.min_tokens!r}"
            )

        kinds = (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)
        if isinstance(self.output_kind, bool) or self.output_kind not in kinds:
            raise ValueError(
                f"output_kind must be RequestOutputKind.CUMULATIVE or FINAL_ONLY, got {self.output_kind!r}"
                + (" (DELTA outputs are not supported)" if self.output_kind == RequestOutputKind.DELTA else "")
            )
        self.output_kind = RequestOutputKind(self.output_kind)

        for s in self.stop:
            if s == "":
                raise ValueError(f"stop strings must be non-empty, got {s!r} in stop={self.stop!r}")

    # ------------------------------------------------------------------ #
    # Convenience
    # ------------------------------------------------------------------ #
    @property
    def greedy(self) -> bool:
        """True when this request decodes greedily (temperature ~ 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering is active (``top_k`` > 0)."""
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        """True when any of the presence / frequency / repetition penalties is active."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_output_tokens(self) -> bool:
        """True when the sampler reads this request's generated tokens (penalties, bad words)."""
        return self.has_penalties or bool(self.bad_words)

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 when there are none)."""
        return max((len(s) for s in self.stop), default=0)

    def clone(self) -> SamplingParams:
        """Return an independent deep copy (lists are not shared)."""
        return copy.deepcopy(self)

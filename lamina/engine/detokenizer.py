"""Incremental detokenization and stop-string search.

:class:`IncrementalDetokenizer` turns a stream of generated token ids into a
stream of text deltas without re-decoding the whole output at every step.  It
keeps two offsets into the request's token list:

* ``prefix_offset``: start of a short window of already-emitted tokens kept as
  decoding context (a token's text can depend on its left neighbours, e.g. a
  leading-space marker or the first bytes of a multi-byte character);
* ``read_offset``: first token whose text has not been emitted yet.

Each push decodes ``tokens[prefix_offset:]`` and ``tokens[prefix_offset:
read_offset]``; the difference of the two strings is the new text.  If the
decoded window ends with U+FFFD (an incomplete UTF-8 sequence split over
several byte-level tokens) nothing is emitted and the offsets stay put until a
later token completes the character.  When text is emitted the window slides:
the just-emitted tokens become the next context.  The cost per step is
proportional to the window, not to the output length.

:func:`find_stop_string` looks for stop strings only in the tail of the text
that could contain a newly completed match.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["IncrementalDetokenizer", "fast_decoder", "find_stop_string"]

_REPLACEMENT_CHAR = "\ufffd"
# Number of prompt tokens used as initial decoding context.
_INITIAL_CONTEXT_TOKENS = 5


# Where transformers' stock fast tokenizers define `decode` and `_decode` (5.x; 4.x for `_decode`):
# `_decode` there is the backend's decode, then the optional clean-up of tokenization spaces.
_STOCK_DECODE_MODULES = {
    "decode": ("transformers.tokenization_utils_base",),
    "_decode": ("transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"),
}


def _defined_in(cls: type, name: str) -> str | None:
    """The module of the class in `cls`'s MRO that defines `name`."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass.__module__
    return None


def fast_decoder(tokenizer: Any):
    """The `tokenizers.Tokenizer` behind a fast Hugging Face tokenizer when decoding through it
    gives exactly `tokenizer.decode`'s text: transformers' own `decode` / `_decode` (no subclass
    override) and no clean-up of tokenization spaces (Qwen's tokenizers turn it off); None
    otherwise (decode through the tokenizer). `tokenizer.decode` converts its input and checks for
    batches on every call, which costs more than the decode itself on the engine's few-token
    windows (two per generated token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    if any(_defined_in(type(tokenizer), name) not in modules for name, modules in _STOCK_DECODE_MODULES.items()):
        return None
    return backend


class IncrementalDetokenizer:
    """Stream text out of a growing list of generated token ids.

    Args:
        tokenizer: A Hugging Face tokenizer (anything with
            ``decode(ids, skip_special_tokens=...)``).
        prompt_token_ids: The request's prompt; its last few tokens serve as
            decoding context for the first output tokens.
        skip_special_tokens: Drop special tokens from the text.
        spaces_between_special_tokens: Forwarded to ``decode`` when ``False``
            (fast tokenizers ignore it).

    Attributes:
        text: All output text emitted so far.
        output_token_ids: All output token ids pushed so far.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._backend = fast_decoder(tokenizer)
        self.text = ""
        self.output_token_ids: list[int] = []

        # Only the prompt tail is kept: the window never reaches further back.
        context = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a multi-byte character; using it as
            # context would glue its bytes to the output's.  Decode the output
            # on its own instead, like ``tokenizer.decode(output_ids)`` does.
            context = []
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    # ------------------------------------------------------------------ #
    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:  # what tokenizer.decode returns, without its per-call conversions
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        kwargs: dict[str, Any] = {"skip_special_tokens": self.skip_special_tokens}
        if not self.spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        return self.tokenizer.decode(list(ids), **kwargs)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the newly finalised text (maybe "").

        Text ending in an incomplete UTF-8 sequence is held back until the
        character is completed by a later push (or :meth:`flush`).
        """
        if not new_token_ids:
            return ""
        new_ids = [int(t) for t in new_token_ids]
        self.output_token_ids.extend(new_ids)
        self._tokens.extend(new_ids)

        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._tokens[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""

        delta = window_text[len(prefix_text) :]
        self.text += delta
        self._slide(len(self._tokens))
        return delta

    def flush(self) -> str:
        """Emit any held-back text (e.g. a dangling partial character as
        U+FFFD) so that :attr:`text` equals the full decode of the output.
        Call when the request finishes."""
        if self._read_offset >= len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._tokens[self._prefix_offset :])
        delta = window_text[len(prefix_text) :]
        self.text += delta
        self._slide(len(self._tokens))
        return delta

    def truncate(self, length: int) -> None:
        """Cut :attr:`text` to ``length`` characters (after a stop-string hit)."""
        self.text = self.text[:length]

    def _slide(self, new_read_offset: int) -> None:
        """Make the just-emitted tokens the context of the next window and
        drop tokens that can no longer be part of any window."""
        self._prefix_offset = self._read_offset
        self._read_offset = new_read_offset
        if self._prefix_offset > 0:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    @property
    def num_pending_tokens(self) -> int:
        """Tokens pushed whose text has not been emitted yet."""
        return len(self._tokens) - self._read_offset


def find_stop_string(
    text: str, new_text_len: int, stops: Sequence[str], include_stop: bool,
) -> tuple[str, int] | None:
    """Find a stop string completed by the last ``new_text_len`` characters.

    Only the tail ``text[-(new_text_len + len(stop) - 1):]`` is searched for
    each stop (a match that ends before the new text would have been found on
    an earlier call).  When several stops complete at once, the first in
    ``stops``' order wins (vLLM's rule), at its first match.

    Args:
        text: The full output text so far (including the new text).
        new_text_len: Number of characters appended since the last call.
        stops: Stop strings (non-empty).
        include_stop: Whether the stop string stays in the output.

    Returns:
        ``(stop, truncate_at)``: the caller should set ``text =
        text[:truncate_at]``; ``truncate_at`` is the match's start, or its end
        when ``include_stop``.  ``None`` when no stop string was completed.
    """
    if new_text_len <= 0 or not stops:
        return None
    for stop in stops:
        if not stop:
            continue
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx >= 0:
            return stop, idx + len(stop) if include_stop else idx
    return None

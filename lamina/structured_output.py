"""Structured output: what a request asks for (`StructuredOutputsParams`, vLLM's names) and the
grammar state that enforces it (`StructuredOutputManager`, on xgrammar).

The grammar lives with the engine, beside the scheduler, not on the ranks: before each step the
engine fills, for every sampling request with a grammar, a token bitmask (one bit per vocabulary
id, `[ceil(V/32)]` int32) of the tokens the grammar allows next, and the plan carries it to the
rank that samples, where the sampler applies all rows' masks in one batched op. After the step the
engine advances each request's matcher with the token it got. A preempted request keeps its matcher
(its generated tokens are kept), so nothing rolls back. Under speculative decoding the engine fills
a mask for every verified position (`bitmasks_along`: the matcher advanced through the drafts
before that position, then rolled back), so each position is checked under the grammar state its
accepted prefix reaches; the matcher only ever keeps the tokens emitted.

JSON is compiled without free whitespace (compact `", "` / `": "` separators), so a weak model cannot
fill its budget with blanks; a finished grammar allows only the model's EOS tokens. xgrammar's JSON
strings admit raw control characters (bytes below 0x20 other than newline), which strict JSON parsers
reject; since compact JSON has no place for any such byte, JSON masks also clear every token that
contains one (a mask computed once from the vocabulary). A structural tag with JSON content (the tool
calls of a `required` / named tool_choice) gets the same mask but keeps line breaks (`\n`, `\r`), which
its tags need and which the JSON grammar keeps out of strings (tabs and the other control bytes are
cleared: xgrammar's strings with `maxLength` admit them).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["StructuredOutputsParams", "StructuredOutputManager", "bitmask_words"]

MAX_CHOICES = 1024
_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_OPTIONS = ("enforce_after_token_id", "disable_any_whitespace", "backend", "disable_fallback", "whitespace_pattern",
            "disable_additional_properties")


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@dataclass
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or a JSON string), `json_object` (any JSON
    object), `regex`, `choice` (one of these strings), `grammar` (EBNF, xgrammar's dialect),
    `structural_tag` (xgrammar's structural tag, `{"type": "structural_tag", "format": {...}}`, as a
    dict or a JSON string; the server builds one for tool_choice `required` / a named function)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    # lamina's: the grammar applies only once this token has been generated (the server sets the
    # reasoning end `</think>` when its reasoning parser is on and the prompt opened a think block,
    # as vLLM enforces structured output only after the reasoning); None: from the first token
    enforce_after_token_id: int | None = None
    # vLLM's options: `disable_any_whitespace` False lets JSON have any whitespace between its tokens
    # (None, lamina's default, and True: compact JSON, which keeps a model from looping on blanks);
    # `backend` None / "auto" / "xgrammar" (lamina's only one); `disable_fallback` (no fallback here);
    # `whitespace_pattern` and `disable_additional_properties` (other backends') unset only
    disable_any_whitespace: bool | None = None
    backend: str | None = None
    disable_fallback: bool = False
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.backend not in (None, "auto", "xgrammar"):
            raise ValueError(f"structured_outputs backend {self.backend!r}: lamina compiles grammars with xgrammar; "
                             "valid: auto, xgrammar")
        if self.whitespace_pattern is not None or self.disable_additional_properties:
            raise ValueError("structured_outputs whitespace_pattern / disable_additional_properties belong to other "
                             "backends (outlines, guidance); lamina's xgrammar takes disable_any_whitespace")
        given = [name for name in _KINDS if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(_KINDS)}; got "
                + (", ".join(given) if given else "none")
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None
            if not isinstance(self.json, dict):
                raise ValueError(f"structured_outputs json must be a JSON schema object, got {type(self.json).__name__}")
        if self.structural_tag is not None:
            if isinstance(self.structural_tag, str):
                try:
                    self.structural_tag = json.loads(self.structural_tag)
                except ValueError as e:
                    raise ValueError(f"structured_outputs structural_tag is not valid JSON: {e}") from None
            if not isinstance(self.structural_tag, dict):
                raise ValueError("structured_outputs structural_tag must be an object, got "
                                 f"{type(self.structural_tag).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs regex must be a string, got {self.regex!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"structured_outputs grammar must be a string, got {self.grammar!r}")
        if self.enforce_after_token_id is not None and (
                isinstance(self.enforce_after_token_id, bool) or not isinstance(self.enforce_after_token_id, int)
                or self.enforce_after_token_id < 0):
            raise ValueError(f"structured_outputs enforce_after_token_id must be a token id, got {self.enforce_after_token_id!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs choice must be a list of non-empty strings, got {self.choice!r}")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs choice has {len(self.choice)} entries; at most {MAX_CHOICES}")
            self.choice = list(self.choice)

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(_KINDS) - set(_OPTIONS))
            if unknown:
                raise ValueError(f"structured_outputs has unknown keys {unknown}; valid: {', '.join(_KINDS)}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")

    def key(self) -> tuple[str, ...]:
        """A hashable description (the compiled-grammar cache key)."""
        spaces = "any" if self.disable_any_whitespace is False else ""
        if self.json is not None:
            return ("json", json.dumps(self.json, sort_keys=True), spaces)
        if self.json_object:
            return ("json_object", "", spaces)
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice))
        if self.structural_tag is not None:
            return ("structural_tag", json.dumps(self.structural_tag, sort_keys=True))
        return ("grammar", self.grammar)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before 0.11 (SamplingParams(guided_decoding=...))


def _holds_json(node: Any) -> bool:
    """Whether a structural tag has JSON content (a `json_schema` format in the default `json` style)."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and node.get("style", "json") == "json":
            return True
        return any(_holds_json(v) for v in node.values())
    if isinstance(node, list):
        return any(_holds_json(v) for v in node)
    return False


class StructuredOutputManager:
    """Compiled grammars (cached by request description) and one matcher per running request."""

    CACHE_SIZE = 256

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler = None
        # the server compiles on request threads while the engine thread looks grammars up: one lock
        # guards the compiler's creation and the cache (compiling itself runs outside it)
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._matchers: dict[str, list] = {}  # request id -> [matcher, extra mask, token it waits for or None]
        self._json_safe: np.ndarray | None = None  # [W] int32: tokens without control bytes
        self._json_lines_safe: np.ndarray | None = None  # [W] int32: ... other than \n and \r

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    def _get_compiler(self):
        with self._lock:
            return self._get_compiler_locked()

    def _get_compiler_locked(self):
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer, and this model has none")
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            self._json_safe = self._control_free_mask(info.decoded_vocab)
            self._json_lines_safe = self._control_free_mask(info.decoded_vocab, keep=b"\n\r")
        return self._compiler

    def _control_free_mask(self, decoded_vocab: list[bytes], keep: bytes = b"") -> np.ndarray:
        """Bit t set when token t's bytes contain no control byte (< 0x20) other than those in `keep`;
        special tokens (EOS) decode to their names and stay allowed."""
        bits = np.zeros(self.words * 32, dtype=bool)
        control = bytes(b for b in range(32) if b not in keep)
        for token_id, raw in enumerate(decoded_vocab[: self.vocab_size]):
            bits[token_id] = not any(b in control for b in raw)
        for token_id in self.eos_token_ids:
            if token_id < self.vocab_size:
                bits[token_id] = True
        weights = np.left_shift(np.uint64(1), np.arange(32, dtype=np.uint64))  # bit j of a word: 2**j
        words = (bits.reshape(-1, 32).astype(np.uint64) * weights).sum(axis=1)  # [W]
        return words.astype(np.uint32).view(np.int32)

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` (cached); a ValueError naming the problem if it does not compile."""
        key = spec.key()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiler = self._get_compiler()
        try:
            any_whitespace = spec.disable_any_whitespace is False  # vLLM's False: any whitespace
            if spec.json is not None:
                compiled = compiler.compile_json_schema(json.dumps(spec.json), any_whitespace=any_whitespace)
            elif spec.json_object:
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            elif spec.regex is not None:
                compiled = compiler.compile_regex(spec.regex)
            elif spec.choice is not None:
                compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            elif spec.structural_tag is not None:
                compiled = compiler.compile_structural_tag(json.dumps(spec.structural_tag))
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except Exception as e:  # noqa: BLE001 - whatever the grammar library raises, the request's grammar is at fault
            kind = key[0]
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", first_line)  # drop "[time] file.cc:123:"
            raise ValueError(f"structured_outputs {kind} could not be compiled: {reason}") from None
        with self._lock:
            self._compiled[key] = compiled
            if len(self._compiled) > self.CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    # ---- per request ----------------------------------------------------------------------
    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        compiled = self.compile(spec)  # builds the masks below on first use
        extra = None
        if spec.json is not None or spec.json_object:
            extra = self._json_safe
        elif spec.structural_tag is not None and _holds_json(spec.structural_tag):
            extra = self._json_lines_safe
        self._matchers[request_id] = [xgr.GrammarMatcher(compiled), extra, spec.enforce_after_token_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._matchers

    def bitmask(self, request_id: str) -> np.ndarray | None:
        """[ceil(V/32)] int32: bit t set when token t may come next; None when the grammar has ended
        or has not started (it waits for its `enforce_after_token_id`)."""
        import torch
        import xgrammar as xgr

        matcher, extra, waiting_for = self._matchers[request_id]
        if waiting_for is not None or matcher.is_terminated():
            return None
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, W] int32 (torch, CPU)
        matcher.fill_next_token_bitmask(mask, 0)
        assert mask.dtype == torch.int32
        words = mask[0].numpy().copy()
        if extra is not None:
            words &= extra
        return words

    def bitmasks_along(self, request_id: str, draft_token_ids: list[int]) -> list[np.ndarray | None]:
        """Speculative decoding: the masks of a verification's k + 1 positions, position j's with
        the grammar advanced through the first j of the k drafts (`bitmask`'s format). Drafts are
        taken tentatively and rolled back: the matcher ends where it started. Past a draft the
        grammar rejects, the later positions repeat the last mask (verification rejects that draft
        under the mask before it, so their tokens are never emitted)."""
        entry = self._matchers[request_id]
        matcher, waiting_for = entry[0], entry[2]
        masks = [self.bitmask(request_id)]
        advanced = 0
        try:
            for draft in draft_token_ids:
                if entry[2] is not None:  # the grammar starts after its token
                    if int(draft) == entry[2]:
                        entry[2] = None
                elif not matcher.is_terminated():
                    if not matcher.accept_token(int(draft)):
                        masks += [masks[-1]] * (len(draft_token_ids) + 1 - len(masks))
                        break
                    advanced += 1
                masks.append(self.bitmask(request_id))
        finally:
            if advanced:
                matcher.rollback(advanced)
            entry[2] = waiting_for
        return masks

    def accept(self, request_id: str, token_id: int) -> bool:
        entry = self._matchers.get(request_id)
        if entry is None:
            return True
        matcher, _, waiting_for = entry
        if waiting_for is not None:  # not started: the grammar starts after this token
            if int(token_id) == waiting_for:
                entry[2] = None
            return True
        if matcher.is_terminated():
            return True
        return bool(matcher.accept_token(int(token_id)))

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

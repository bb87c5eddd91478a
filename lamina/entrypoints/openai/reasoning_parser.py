"""`--reasoning-parser qwen3`: split a Qwen model's `<think>...</think>` block off its answer.

The split is a pure function of the text generated so far (plus whether the chat template opened the
think block in the prompt, as Qwen3.5 / Qwen3-Next-Thinking templates do), so streaming and
non-streaming agree: a stream sends, at each update, what grew in the cumulative split, and holds back
a tail that could still become a marker.

Rules (the text is what the model generated, not the prompt):
- The think block is open from the start if the prompt ends inside one (`<think>` after the prompt's
  last `</think>`), or if the output starts with `<think>` (leading whitespace allowed).
- Open: everything up to the first `</think>` is reasoning (without the `<think>` tag), the rest is
  content. With no `</think>` yet (or ever, when generation was cut off), all of it is reasoning.
- A tool call also ends an open block: Qwen3.5 models may write `<tool_call>` followed (after
  whitespace) by `<function=...>` (the qwen3_coder format) before any `</think>`; the content, where
  the tool parser finds the call, then starts at that `<tool_call>` (vLLM's qwen3 parser does the
  same). A `<tool_call>` followed by anything else (a mention in the reasoning) does not end it.
  Whichever comes first, `</think>` or such a call, ends the block.
- Not open: all of it is content, tags included (enable_thinking=false closes the block in the
  prompt, so the model's output is all answer).
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
FUNCTION_OPEN = "<function"  # then "=" or whitespace: <function=NAME> (qwen3_coder's call format)
REASONING_PARSERS = ("qwen3",)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (it may still become one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def prompt_opens_think(prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves a think block open for the model to continue."""
    start = prompt_tail.rfind(THINK_START)
    return start >= 0 and prompt_tail.find(THINK_END, start) < 0


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: no think block (as opposed to an empty one)
    content: str


def split_reasoning(text: str, *, opened_in_prompt: bool, final: bool = True) -> ReasoningSplit:
    """The (reasoning, content) split of `text`. With `final=False`, a tail that may still turn into a
    marker is left out of both, so each part only grows as more text arrives."""
    if not opened_in_prompt:
        lead = 0  # leading whitespace, counted without copying the (possibly long) text on every update
        while lead < len(text) and text[lead].isspace():
            lead += 1
        if text.startswith(THINK_START, lead):
            text = text[lead + len(THINK_START):]
        elif not final and THINK_START.startswith(text[lead:lead + len(THINK_START)]) \
                and len(text) - lead < len(THINK_START):
            return ReasoningSplit(None, "")  # maybe the start of "<think>": wait
        else:
            return ReasoningSplit(None, text)
    end = text.find(THINK_END)
    call, undecided = _tool_call_end(text, len(text) if end < 0 else end, final)
    if call is not None:
        return ReasoningSplit(text[:call], text[call:])
    if end >= 0:
        return ReasoningSplit(text[:end], text[end + len(THINK_END):])
    if not final:
        held = max(_partial_suffix(text, THINK_END), _partial_suffix(text, TOOL_CALL_START))
        text = text[:min(len(text) - held, len(text) if undecided is None else undecided)]
    return ReasoningSplit(text, "")


def _tool_call_end(text: str, limit: int, final: bool) -> tuple[int | None, int | None]:
    """(where the first `<tool_call>` before `limit` that opens a `<function` call starts, or None;
    with `final=False`, where one starts whose next characters may still become `<function`: the
    text from there is held back, or None)."""
    start = text.find(TOOL_CALL_START, 0, limit)
    while start >= 0:
        after = text[start + len(TOOL_CALL_START):].lstrip()
        if after.startswith(FUNCTION_OPEN) and len(after) > len(FUNCTION_OPEN):
            if after[len(FUNCTION_OPEN)] == "=" or after[len(FUNCTION_OPEN)].isspace():
                return start, None
        elif not final and FUNCTION_OPEN.startswith(after):  # only whitespace or part of "<function" yet
            return None, start
        start = text.find(TOOL_CALL_START, start + 1, limit)
    return None, None


class Qwen3ReasoningParser:
    """The qwen3 parser bound to one request (whether its prompt opened the think block)."""

    name = "qwen3"

    def __init__(self, opened_in_prompt: bool):
        self.opened_in_prompt = opened_in_prompt

    def split(self, text: str, final: bool = True) -> ReasoningSplit:
        return split_reasoning(text, opened_in_prompt=self.opened_in_prompt, final=final)


def make_reasoning_parser(name: str | None, prompt_tail: str) -> Qwen3ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not known; valid: {', '.join(REASONING_PARSERS)}")
    return Qwen3ReasoningParser(prompt_opens_think(prompt_tail))

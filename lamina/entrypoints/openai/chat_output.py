"""A chat answer's text turned into OpenAI message fields: `reasoning_content` (reasoning parser),
`content` and `tool_calls` (tool parser), for a whole answer and as streamed deltas.

Both parsers are pure functions of the text so far, so the stream sends the growth of each field and
its concatenated deltas equal the non-streaming message. One exception: a tool call whose name was
already streamed and whose text then turns out malformed or cut off (max_tokens). The client has
its header and part of its arguments; the text up to there is not sent again as content, text
after it is, and the finish reason is the engine's ("length", "stop"), never "tool_calls" (the
whole answer has no tool calls then: its content is the raw text, its finish reason the engine's).

`finish_reason`: "tool_calls" when the answer's calls parsed whole, as OpenAI and vLLM answer, except
for a named tool_choice, where both answer "stop".
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from lamina.entrypoints.openai.reasoning_parser import Qwen3ReasoningParser, ReasoningSplit
from lamina.entrypoints.openai.tool_parsers import ParsedCall, ToolParser


# Reasoning goes out as `reasoning_content` (DeepSeek's name, what most clients read) and as `reasoning`
# (what vLLM has answered since late 2025), with the same text.
REASONING_FIELDS = ("reasoning_content", "reasoning")


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChatMessageFields:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _SentCall:
    id: str
    arguments: int = 0  # characters of arguments sent


class ChatOutputParser:
    """Parses one request's answer. `tools` is None when tool calls are not parsed (no parser, or
    tool_choice none); `only_function` keeps only calls of that function (a named tool_choice);
    `max_calls` (1 for the request's `parallel_tool_calls: false`) keeps the first calls only, streamed
    and not: vLLM and OpenAI answer one call then, whatever the tool_choice."""

    def __init__(self, reasoning: Qwen3ReasoningParser | None = None, tools: ToolParser | None = None,
                 only_function: str | None = None, max_calls: int | None = None):
        self.reasoning = reasoning
        self.tools = tools
        self.only_function = only_function
        self.max_calls = max_calls
        # stream state
        self._sent_reasoning = 0
        self._sent_content = 0
        self._calls: list[_SentCall] = []
        self._plain = False  # a malformed call was seen: the rest is plain content
        self._calls_whole = False  # the final text parsed with the calls sent

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def _split(self, text: str, final: bool) -> ReasoningSplit:
        if self.reasoning is None:
            return ReasoningSplit(None, text)
        return self.reasoning.split(text, final=final)

    def _wanted(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        if self.only_function is not None:
            calls = [c for c in calls if c.name == self.only_function]
        return calls if self.max_calls is None else calls[:self.max_calls]

    # ---- the whole answer ----------------------------------------------------------------
    def parse(self, text: str) -> ChatMessageFields:
        split = self._split(text, final=True)
        content = split.content
        if self.tools is not None:
            parsed = self.tools.parse(content, final=True, max_calls=self.max_calls)
            calls = self._wanted(parsed.calls) if parsed.valid else []
            if calls:
                return ChatMessageFields(
                    content=parsed.content or None, reasoning_content=split.reasoning,
                    tool_calls=[{"id": new_tool_call_id(), "type": "function",
                                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls])
        return ChatMessageFields(content=content if content or split.reasoning is None else None,
                                 reasoning_content=split.reasoning)

    def finish_reason(self, engine_reason: str | None, tool_calls: bool) -> str | None:
        """The answer's finish reason: `tool_calls` when it has whole tool calls (unless they
        answer a named tool_choice), else the engine's."""
        return "tool_calls" if tool_calls and self.only_function is None else engine_reason

    # ---- streaming --------------------------------------------------------------------------
    @property
    def called_tools(self) -> bool:
        """Whether the stream's tool calls parsed whole in its final text."""
        return self._calls_whole

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas (OpenAI `delta` objects) that bring the client from what was sent to `text`."""
        out: list[dict[str, Any]] = []
        split = self._split(text, final)
        reasoning = split.reasoning or ""
        if len(reasoning) > self._sent_reasoning:  # under both names vLLM has used (see REASONING_FIELDS)
            piece = reasoning[self._sent_reasoning:]
            out.append(dict.fromkeys(REASONING_FIELDS, piece))
            self._sent_reasoning = len(reasoning)
        content = split.content
        if self.tools is not None and not self._plain:
            parsed = self.tools.parse(content, final, max_calls=self.max_calls)
            if not parsed.valid:
                self._plain = True
                if self._calls:  # the text so far belongs to calls the client has: not sent again
                    self._sent_content = max(self._sent_content, len(content))
            else:
                self._content_delta(out, parsed.content)
                for index, call in enumerate(self._wanted(parsed.calls)):
                    self._call_deltas(out, index, call)
                self._calls_whole = final and bool(self._calls)
                if not final or self._calls:
                    return out
        self._content_delta(out, content)
        return out

    def _content_delta(self, out: list[dict], content: str) -> None:
        if len(content) > self._sent_content:
            out.append({"content": content[self._sent_content:]})
            self._sent_content = len(content)

    def _call_deltas(self, out: list[dict], index: int, call: ParsedCall) -> None:
        """Calls are matched by their order: the index-th call parsed is the index-th call sent."""
        if call.name is None:
            return
        if index == len(self._calls):  # first sight of this call's name: its header
            self._calls.append(_SentCall(new_tool_call_id()))
            out.append({"tool_calls": [{"index": index, "id": self._calls[index].id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
        sent = self._calls[index]
        if len(call.arguments) > sent.arguments:
            out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments[sent.arguments:]}}]})
            sent.arguments = len(call.arguments)

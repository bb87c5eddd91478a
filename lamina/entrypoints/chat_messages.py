"""OpenAI-format chat messages as the chat templates read them (offline `LLM.chat` and the server).

Clients send what OpenAI's API takes; Qwen templates read something narrower:
- `content` as a list of parts becomes their texts joined by newlines (Qwen templates turn any
  non-string content into an empty turn), `None` becomes "" (assistant messages with tool calls);
  parts other than text are refused: these models read text only;
- an assistant message's `tool_calls[].function.arguments` as an object (clients send back the
  JSON string they received; templates iterate its items), checked to be a JSON object;
- a message's `reasoning` (vLLM's newer name) also as `reasoning_content`, the name Qwen templates read.

Errors are `MessageError` (a ValueError) naming the message and field; the server answers them 400.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MessageError", "normalize_messages"]


class MessageError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
            text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
            if kind != "text" or not isinstance(text, str):
                raise MessageError(f"{where}: part type {kind!r} is not supported; this model takes text parts "
                                   "only ({'type': 'text', 'text': ...})", where)
            texts.append(text)
        return "\n".join(texts)
    raise MessageError(f"{where} must be a string or a list of text parts, got {type(content).__name__}", where)


def _tool_calls(message: dict[str, Any], i: int) -> None:
    where = f"messages[{i}].tool_calls"
    if message.get("role") != "assistant":
        raise MessageError(f"{where}: only assistant messages carry tool_calls", where)
    calls = []
    for j, call in enumerate(message["tool_calls"]):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessageError(f"{where}[{j}] needs function.name (a string)", where)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise MessageError(f"{where}[{j}].function.arguments is not valid JSON ({e.msg}): {args[:80]!r}",
                                   where) from None
        if not isinstance(args, dict):
            raise MessageError(f"{where}[{j}].function.arguments must be a JSON object", where)
        calls.append({**call, "function": {**fn, "arguments": args}})
    message["tool_calls"] = calls


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` (dicts) in the form the chat templates read; the caller's are not changed."""
    out = []
    for i, original in enumerate(messages):
        if not isinstance(original, dict):
            raise MessageError(f"messages[{i}] must be a dict with a role, got {type(original).__name__}", f"messages[{i}]")
        message = dict(original)
        message["content"] = _text_of(message.get("content"), f"messages[{i}].content")
        if message.get("reasoning") is not None and message.get("reasoning_content") is None:
            message["reasoning_content"] = message["reasoning"]
        if message.get("tool_calls"):
            _tool_calls(message, i)
        out.append(message)
    return out

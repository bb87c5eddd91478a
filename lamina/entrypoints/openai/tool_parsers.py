"""`--tool-call-parser hermes|qwen3_coder`: find the tool calls in a Qwen model's output.

The two formats Qwen chat templates teach their models:

    hermes       <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
    qwen3_coder  <tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>

(newlines around the tags are allowed; for qwen3_coder, a bare `<function=...>...</function>` without the
`<tool_call>` wrapper counts too). `parse(text, final)` is a pure function of the text generated
so far: the content before the first `<tool_call>`, and each call's name and arguments as far as they
are known. Every part only grows as text arrives (a tail that may still become a tag is held back), so a
stream sends the growth of each part and ends with what the non-streaming answer holds:

- hermes streams the arguments object as the model writes it (its raw JSON text; trailing `}` and
  spaces are held back until it is clear whether they close the arguments or the call);
- qwen3_coder streams one `"name": value` piece per finished parameter, converted by the tool's
  JSON schema (`integer`, `number`, `boolean`, `object`, `array`; strings otherwise; a member of the
  schema's `enum` with the whitespace around it dropped; without a schema, a value that parses as
  JSON is taken as such).

`parse(..., max_calls=1)` (the request's `parallel_tool_calls: false`) stops after the first whole
call: what follows it is dropped, as vLLM and OpenAI answer one call then.

A call that cannot be parsed makes `ToolParse.valid` false; the server then answers the whole text as
plain content (never an error).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from lamina.entrypoints.openai.reasoning_parser import _partial_suffix

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass
class ParsedCall:
    name: str | None  # None: not known yet (streaming)
    arguments: str  # JSON text of the arguments object, as far as known
    complete: bool


@dataclass
class ToolParse:
    content: str  # text before the first call (all text when there is none)
    calls: list[ParsedCall] = field(default_factory=list)
    valid: bool = True


class _Invalid(Exception):
    pass


class ToolParser:
    name = ""

    def __init__(self, tools: list[dict] | None = None):
        self.schemas: dict[str, dict] = {}
        for tool in tools or []:
            fn = tool.get("function") or {}
            if isinstance(fn.get("name"), str):
                self.schemas[fn["name"]] = fn.get("parameters") or {}

    # (start tag, end tag, whether the tags belong to the body): where a call can begin and end
    markers: tuple[tuple[str, str, bool], ...] = ((TOOL_CALL_START, TOOL_CALL_END, False),)

    def _find_start(self, text: str, pos: int) -> tuple[int, str, str, bool]:
        found = [(i, *m) for m in self.markers if (i := text.find(m[0], pos)) >= 0]
        return min(found) if found else (-1, "", "", False)

    def parse(self, text: str, final: bool = True, max_calls: int | None = None) -> ToolParse:
        """`max_calls` (1 under `parallel_tool_calls: false`): the text after that many whole calls is
        not looked at, so a later call, whole or malformed, changes nothing."""
        pos, start, end_tag, inclusive = self._find_start(text, 0)
        if pos < 0:
            if final:
                return ToolParse(text)
            # hold back a tail that may become a start tag, and trailing whitespace (dropped if a call follows)
            keep = len(text) - max(_partial_suffix(text, m[0]) for m in self.markers)
            return ToolParse(text[:keep].rstrip())
        result = ToolParse(text[:pos].rstrip())
        while pos >= 0:
            body_start = pos if inclusive else pos + len(start)
            end = text.find(end_tag, pos + len(start))
            closed = end >= 0
            body = text[body_start:(end + len(end_tag) if inclusive else end) if closed else len(text)]
            if not closed and not final:
                body = body[:len(body) - _partial_suffix(body, end_tag)]
            try:
                call = self.parse_body(body, complete=closed or final)
            except _Invalid:
                result.valid = False
                return result
            if call is not None:
                result.calls.append(call)
            if not closed or (max_calls is not None and len(result.calls) >= max_calls):
                break
            pos, start, end_tag, inclusive = self._find_start(text, end + len(end_tag))
        return result

    def parse_body(self, body: str, complete: bool) -> ParsedCall | None:
        raise NotImplementedError


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5 / Qwen3 templates)."""

    name = "hermes"

    def parse_body(self, body: str, complete: bool) -> ParsedCall | None:
        head = _HERMES_HEAD.match(body)
        if complete:
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                raise _Invalid() from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
                raise _Invalid()
            args = obj.get("arguments", obj.get("parameters", {}))
            if head is not None and body[head.end():head.end() + 1] == "{":
                _, end = json.JSONDecoder().raw_decode(body, head.end())
                return ParsedCall(obj["name"], body[head.end():end], True)  # the raw text, as streamed
            if isinstance(args, str):  # arguments given as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    raise _Invalid() from None
            if not isinstance(args, dict):
                raise _Invalid()
            return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False), True)
        if head is None:
            return None  # not enough text to know the name yet (or another key order: wait for the end)
        name = json.loads(f'"{head.group(1)}"')
        raw = body[head.end():]
        if not raw.startswith("{"):
            return ParsedCall(name, "", False)
        keep = len(raw)
        while keep and (raw[keep - 1] == "}" or raw[keep - 1].isspace()):
            keep -= 1
        return ParsedCall(name, raw[:keep], False)


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_PARAM_END = re.compile(r"</parameter>|<parameter=|</function>")


class Qwen3CoderToolParser(ToolParser):
    """`<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>` (Qwen3-Coder,
    Qwen3.5 templates)."""

    name = "qwen3_coder"
    # the model sometimes leaves out the <tool_call> wrapper: a bare <function=...>...</function> is a call too
    markers = ((TOOL_CALL_START, TOOL_CALL_END, False), ("<function=", "</function>", True))

    def parse_body(self, body: str, complete: bool) -> ParsedCall | None:
        head = _FUNCTION.match(body)
        if head is None:
            if complete or (body.strip() and not "<function=".startswith(body.strip()[:10])):
                raise _Invalid()
            return None
        name = head.group(1).strip()
        props = (self.schemas.get(name) or {}).get("properties") or {}
        pieces = []
        pos = head.end()
        fn_closed = False
        while True:
            rest = body[pos:]
            stripped = rest.lstrip()
            if stripped.startswith("</function>"):
                fn_closed = True
                break
            param = _PARAMETER.search(body, pos)
            if param is None or body[pos:param.start()].strip():
                if complete and rest.strip():
                    raise _Invalid()
                break
            stop = _PARAM_END.search(body, param.end())
            if stop is None and not complete:
                break  # the value is still being written
            value = body[param.end():stop.start() if stop else len(body)]
            key = param.group(1).strip()
            pieces.append(f"{json.dumps(key, ensure_ascii=False)}: "
                          f"{json.dumps(self._convert(value, props.get(key)), ensure_ascii=False)}")
            if stop is None:
                break
            pos = stop.end() if stop.group(0) == "</parameter>" else stop.start()
        done = complete or fn_closed
        arguments = "{" + ", ".join(pieces) + ("}" if done else "")
        return ParsedCall(name, arguments, done)

    @staticmethod
    def _convert(raw: str, schema: Any) -> Any:
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        kind = schema.get("type") if isinstance(schema, dict) else None
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), None)
        text = value.strip()
        choices = schema.get("enum") if isinstance(schema, dict) else None
        if isinstance(choices, list):  # a string enum member, however the value is padded
            for candidate in (value, text):
                if isinstance(candidate, str) and candidate in choices:
                    return candidate
        if kind == "string":
            return value
        try:
            if kind == "integer":
                return int(text)
            if kind == "number":
                number = float(text)
                return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
            if kind == "boolean":
                if text.lower() in ("true", "false"):
                    return text.lower() == "true"
                return value
            return json.loads(text)  # object, array, null or no schema: JSON if it parses
        except (ValueError, json.JSONDecodeError):
            return value


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Qwen3CoderToolParser)}
TOOL_PARSERS["qwen3_xml"] = Qwen3CoderToolParser  # vLLM's second name for the same XML format


def make_tool_parser(name: str, tools: list[dict] | None) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known; valid: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tools)

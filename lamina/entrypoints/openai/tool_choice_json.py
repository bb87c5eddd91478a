"""tool_choice `required` or a named function on a server without `--tool-call-parser`: the call is
written as plain JSON under a JSON-schema constraint and read back from it, as vLLM serves them.

- a named function: the answer is that function's arguments object, under its `parameters` schema;
  the call's `arguments` is the answer's text.
- `required`: the answer is a JSON array of `{"name": ..., "parameters": {...}}`, one item per call,
  each under its function's schema (one item at most with `parallel_tool_calls: false`).

Streaming: a named call's arguments are streamed as the model writes them; `required` calls are sent
once the array is whole (its items cannot be told apart safely before). An answer cut off before its
JSON closes (max_tokens) has no tool calls: its text is plain content, as with the tag parsers.
"""

from __future__ import annotations

import json
from typing import Any

from lamina.entrypoints.openai.tool_parsers import ParsedCall, ToolParse, ToolParser
from lamina.structured_output import StructuredOutputsParams

OBJECT_SCHEMA = {"type": "object"}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or OBJECT_SCHEMA


def json_tool_choice_constraint(tools: list[dict[str, Any]], choice: str, function: str | None,
                                parallel_tool_calls: bool = True) -> StructuredOutputsParams:
    """The JSON schema of a `required` / named tool_choice without a tool-call parser."""
    by_name = {tool["function"]["name"]: tool for tool in tools}  # a name given twice: its last tool
    if choice == "named":
        return StructuredOutputsParams(json=_parameters(by_name[function]))
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                "parameters": _parameters(tool)},
              "required": ["name", "parameters"]} for name, tool in by_name.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


class JsonToolChoiceParser(ToolParser):
    """Reads the calls back from the constrained JSON answer (`json_tool_choice_constraint`)."""

    name = "json"

    def __init__(self, tools: list[dict] | None, function: str | None):
        super().__init__(tools)
        self.function = function  # the named function; None for `required`

    def parse(self, text: str, final: bool = True, max_calls: int | None = None) -> ToolParse:
        if self.function is not None:
            if final:
                try:
                    whole = json.loads(text)
                except ValueError:
                    return ToolParse(text, valid=False)
                if not isinstance(whole, dict):
                    return ToolParse(text, valid=False)
            return ToolParse("", [ParsedCall(self.function, text, final)])  # compact JSON: no blanks to trim
        if not final:
            return ToolParse("")  # the array's calls go out once it is whole
        try:
            items = json.loads(text)
        except ValueError:
            return ToolParse(text, valid=False)
        if not isinstance(items, list) or not all(
                isinstance(item, dict) and isinstance(item.get("name"), str) for item in items):
            return ToolParse(text, valid=False)
        calls = [ParsedCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False), True)
                 for item in items]
        return ToolParse("", calls if max_calls is None else calls[:max_calls])

"""tool_choice `required` and a named function, enforced while decoding: the request's tools and the
server's `--tool-call-parser` format as an xgrammar structural tag (`StructuredOutputsParams.structural_tag`),
compiled and applied like any other structured output (same compiler, same cache, same token bitmasks).

The whole answer is the call(s), nothing before or after them; once they are written only EOS may follow:

    hermes       <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>
                 ARGS: JSON valid against the tool's `parameters` schema (xgrammar's strict mode: no
                 properties the schema does not name; a tool without parameters takes `{}`)
    qwen3_coder  <tool_call>\\n<function=NAME>\\n<parameter=P>VALUE</parameter>...</function>\\n</tool_call>
                 the parameter names and order of the schema, required ones present; string values are
                 free text up to `</parameter>`, other values (integer, number, boolean, object, array)
                 JSON of their schema (xgrammar's `qwen_xml` style)

`required` allows one or more calls of any of the tools, separated by a newline (exactly one when the
request sets `parallel_tool_calls: false`); a named choice, exactly one call of that function. At most
one whitespace character may stand wherever the formats allow whitespace, so a weak model cannot spend
its budget on blanks. No reasoning text comes first (see docs/SERVING.md, "Tool calls").
"""

from __future__ import annotations

import json
from typing import Any

from lamina.structured_output import StructuredOutputsParams

_EMPTY_OBJECT = {"type": "object", "properties": {}}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    schema = (tool.get("function") or {}).get("parameters")
    return schema if isinstance(schema, dict) and schema else _EMPTY_OBJECT


def _hermes_tag(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ',
        "content": {"type": "json_schema", "json_schema": schema, "style": "json", "max_whitespace_cnt": 1},
        "end": "}\n</tool_call>",
    }


def _qwen3_coder_tag(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": f"<tool_call>\n<function={name}>\n",
        "content": {"type": "json_schema", "json_schema": schema, "style": "qwen_xml", "max_whitespace_cnt": 1},
        "end": "</function>\n</tool_call>",
    }


_TAGS = {"hermes": _hermes_tag, "qwen3_coder": _qwen3_coder_tag}


def tool_choice_constraint(parser: str, tools: list[dict[str, Any]], choice: str, function: str | None,
                           parallel_tool_calls: bool = True) -> StructuredOutputsParams:
    """The structured output that makes `choice` ('required' or 'named', with `function`) hold for the
    format of tool parser `parser`. `tools` are the request's, already checked (resolve_tool_choice)."""
    if parser not in _TAGS:
        raise ValueError(f"tool_choice {choice!r} cannot be enforced for --tool-call-parser {parser!r}; "
                         f"enforced formats: {', '.join(_TAGS)}")
    if choice not in ("required", "named"):
        raise ValueError(f"only tool_choice 'required' or a named function is enforced, not {choice!r}")
    make_tag = _TAGS[parser]
    by_name = {tool["function"]["name"]: tool for tool in tools}  # a name given twice: its last tool (as parsed)
    tags = [make_tag(name, _parameters(tool)) for name, tool in by_name.items()
            if choice == "required" or name == function]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": choice == "named" or not parallel_tool_calls}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})

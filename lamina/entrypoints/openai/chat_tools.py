"""What the server's chat options (`--tool-call-parser`, `--enable-auto-tool-choice`,
`--reasoning-parser`, `--chat-template`) mean for one chat request: checking `tools` and `tool_choice`,
preparing tool-call history for the chat template, and the parser of the answer.

`tool_choice` as vLLM reads it: absent means `auto` when `tools` are given (else `none`); `auto` needs
`--enable-auto-tool-choice` and a `--tool-call-parser`; `required` and a named function are enforced
while decoding: structured output in the parser's format (tool_choice_grammar.py), or, without a
parser, as plain JSON under a JSON schema (tool_choice_json.py, vLLM's way), so the answer is tool
call(s) and nothing else (no reasoning text either); such a request cannot carry another output
constraint (response_format, structured_outputs, guided_*).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lamina.entrypoints.openai.chat_output import ChatOutputParser
from lamina.entrypoints.openai.reasoning_parser import REASONING_PARSERS, make_reasoning_parser
from lamina.entrypoints.openai.serving import APIError
from lamina.entrypoints.openai.tool_choice_grammar import tool_choice_constraint
from lamina.entrypoints.openai.tool_choice_json import JsonToolChoiceParser, json_tool_choice_constraint
from lamina.entrypoints.openai.tool_parsers import TOOL_PARSERS, make_tool_parser
from lamina.structured_output import StructuredOutputsParams

ENFORCED_CHOICES = ("required", "named")
# apply_chat_template arguments that chat_template_kwargs (a request's, the server's defaults) may not override
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "processor_kwargs",
})


@dataclass(frozen=True)
class ChatOptions:
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    chat_template: str | None = None  # overrides the tokenizer's
    trust_request_chat_template: bool = False  # a request's own chat_template is used (else a 400), as vLLM's flag
    # vLLM's --default-chat-template-kwargs: every request's template kwargs, under its own chat_template_kwargs
    default_chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not known; valid: "
                             f"{', '.join(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({' or '.join(TOOL_PARSERS)})")
        bad = RESERVED_TEMPLATE_KWARGS.intersection(self.default_chat_template_kwargs or {})
        if bad:
            raise ValueError(f"--default-chat-template-kwargs may not set {', '.join(sorted(bad))} (the request "
                             "fields and lamina set them)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r} is not known; valid: "
                             f"{', '.join(REASONING_PARSERS)}")


def _check_tools(tools: list[dict[str, Any]]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise APIError(400, f"{where}.type {tool.get('type')!r} is not supported (only 'function')", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, f"{where}.function must be an object with a 'name', got {fn!r}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.function.name must be a non-empty string, got {name!r}", param="tools")
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON Schema object, got "
                           f"{type(fn['parameters']).__name__}", param="tools")
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise APIError(400, f"{where}.function.description must be a string", param="tools")
        names.append(name)
    return names


def resolve_tool_choice(options: ChatOptions, tools: list[dict] | None, tool_choice: Any) -> tuple[str, str | None]:
    """('none' | 'auto' | 'required' | 'named', function name) for a request; a 400 if it cannot be served."""
    names = _check_tools(tools) if tools else []
    if tool_choice is None:
        choice = "auto" if tools else "none"
        if choice == "auto" and not options.enable_auto_tool_choice:
            raise APIError(400, "this request has tools, so tool_choice defaults to 'auto', which needs the "
                           "server started with --enable-auto-tool-choice --tool-call-parser NAME; send "
                           "tool_choice 'none' to render the tools without parsing calls", param="tool_choice")
        return choice, None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice {tool_choice!r} is not valid: 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if tool_choice == "none" or (tool_choice == "auto" and not tools):
            return "none", None
        if tool_choice == "auto" and not options.enable_auto_tool_choice:
            raise APIError(400, "tool_choice 'auto' needs the server started with --enable-auto-tool-choice "
                           "--tool-call-parser NAME", param="tool_choice")
        if tool_choice == "required":
            if tools == []:  # OpenAI's and vLLM's rule: an empty tool list makes 'required' mean 'none'
                return "none", None
            if not tools:
                raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise APIError(400, "a named tool_choice must be {'type': 'function', 'function': {'name': NAME}}, got "
                       f"{json.dumps(tool_choice)[:200]}", param="tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools "
                       f"({', '.join(map(repr, names)) or 'none given'})", param="tool_choice")
    return "named", name


def _constraint_fields(req: Any) -> list[str]:
    """The request's own output constraints (response_format other than text, structured_outputs, guided_*)."""
    fields = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and getattr(fmt, "type", None) != "text":
        fields.append("response_format")
    if getattr(req, "structured_outputs", None) is not None:
        fields.append("structured_outputs")
    guided = (f"guided_{kind}" for kind in ("json", "regex", "choice", "grammar"))
    fields += [name for name in guided if getattr(req, name, None) is not None]
    return fields


def tool_choice_structured_output(options: ChatOptions, req: Any, choice: str, function: str | None,
                                  engine: Any) -> StructuredOutputsParams | None:
    """The output constraint that enforces a `required` / named tool_choice (None for `auto` / `none`),
    compiled here so that a tool schema the grammar library refuses is a 400 naming `tools`. Blocking
    (grammar compilation): run it off the event loop."""
    if choice not in ENFORCED_CHOICES:
        return None
    what = "tool_choice 'required'" if choice == "required" else f"tool_choice naming function {function!r}"
    others = _constraint_fields(req)
    if others:
        raise APIError(400, f"{what} cannot be combined with {' and '.join(others)}: the tool call is enforced "
                       "with structured output, and a request takes one output constraint; drop one of them",
                       param=others[0])
    try:
        parallel = req.parallel_tool_calls is not False
        if options.tool_call_parser is None:  # no parser: the call written as JSON (vLLM's way, tool_choice_json)
            spec = json_tool_choice_constraint(req.tools, choice, function, parallel_tool_calls=parallel)
        else:  # the call in the parser's own format
            spec = tool_choice_constraint(options.tool_call_parser, req.tools, choice, function,
                                          parallel_tool_calls=parallel)
        engine.structured.compile(spec)
    except ValueError as e:
        raise APIError(400, f"{what} could not be enforced for these tools: {e}", param="tools") from e
    return spec


def output_parser(options: ChatOptions, tools: list[dict] | None, choice: str, function: str | None,
                  prompt_tail: str, parallel_tool_calls: bool | None = None) -> ChatOutputParser:
    """`parallel_tool_calls` False: the answer keeps its first tool call only (for `auto` too, where
    nothing constrains the model's output), as vLLM and OpenAI answer."""
    tool_parser = None
    if choice != "none" and options.tool_call_parser is not None:
        tool_parser = make_tool_parser(options.tool_call_parser, tools)
    elif choice in ENFORCED_CHOICES:  # no parser: the enforced call is plain JSON (tool_choice_json)
        tool_parser = JsonToolChoiceParser(tools, function if choice == "named" else None)
    # an enforced tool choice leaves no room for reasoning: all of the answer is the call(s)
    reasoning = None if choice in ENFORCED_CHOICES else make_reasoning_parser(options.reasoning_parser, prompt_tail)
    return ChatOutputParser(reasoning, tool_parser, function if choice == "named" else None,
                            max_calls=1 if parallel_tool_calls is False else None)


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template FILE|STRING`: a file's text if the path exists, else the string itself."""
    from pathlib import Path

    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a template string too long to be a path
        pass
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template string")
    return value

"""The reasoning and tool-call parsers (lamina.entrypoints.openai.{reasoning_parser,tool_parsers,chat_output}):
whole answers, and streams cut at every split point, whose concatenated deltas must equal the whole
answer's message."""

from __future__ import annotations

import json
import random

import pytest

from lamina.entrypoints.openai.chat_output import ChatOutputParser
from lamina.entrypoints.openai.reasoning_parser import make_reasoning_parser, prompt_opens_think, split_reasoning
from lamina.entrypoints.openai.tool_parsers import make_tool_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array"}, "zip": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}}}},
]

HERMES_ONE = ('Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, '
              '"nested": {"a": [1, {"b": "}"}]}}}\n</tool_call>')
HERMES_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "search", "arguments": {"q": "caf\\u00e9 \\"x\\""}}\n</tool_call>')
CODER_ONE = ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n"
             "</parameter>\n<parameter=zip>\n02139\n</parameter>\n</function>\n</tool_call>")
CODER_TWO = ("<tool_call>\n<function=search>\n<parameter=q>\nmulti\nline\n</parameter>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>")


def _parser(tool_parser=None, reasoning=None, prompt_tail="", only=None):
    return ChatOutputParser(make_reasoning_parser(reasoning, prompt_tail),
                            make_tool_parser(tool_parser, TOOLS) if tool_parser else None, only)


def _stream(make, text, cuts):
    """Feed text cut at `cuts` (cumulative), then the final text; rebuild the message from the deltas."""
    parser = make()
    message = {"content": "", "reasoning_content": "", "tool_calls": []}
    updates = [(text[:c], False) for c in cuts] + [(text, True)]
    for prefix, final in updates:
        for delta in parser.deltas(prefix, final):
            assert delta.get("reasoning") == delta.get("reasoning_content")
            for key in ("content", "reasoning_content"):
                message[key] += delta.get(key, "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(message["tool_calls"]) and call["function"]["arguments"] == ""
                    message["tool_calls"].append({"name": call["function"]["name"], "arguments": ""})
                else:
                    assert "name" not in call["function"]
                    message["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    return message, parser.called_tools


def _whole(make, text):
    fields = make().parse(text)
    return {"content": fields.content or "", "reasoning_content": fields.reasoning_content or "",
            "tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                           for c in fields.tool_calls]}


def _check_streams(make, text):
    whole = _whole(make, text)
    for cut in range(len(text) + 1):  # every single split point
        got, called = _stream(make, text, [cut])
        assert got == whole, (cut, text[:cut])
        assert called == bool(whole["tool_calls"])
    got, _ = _stream(make, text, range(len(text) + 1))  # one character at a time
    assert got == whole
    rng = random.Random(0)
    for _ in range(20):
        got, _ = _stream(make, text, sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6)))))
        assert got == whole
    return whole


# ---- reasoning ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nplan\n</think>\n\nanswer", False, "\nplan\n", "\n\nanswer"),
    ("  <think>plan</think>answer", False, "plan", "answer"),
    ("plan</think>answer", True, "plan", "answer"),
    ("plan, cut off by max_tokens", True, "plan, cut off by max_tokens", ""),
    ("<think>cut off", False, "cut off", ""),
    ("just an answer", False, None, "just an answer"),
    ("an answer mentioning </think> late", False, None, "an answer mentioning </think> late"),
    ("", False, None, ""),
    ("", True, "", ""),
    # a qwen3_coder call ends an open block without </think> (Qwen3.5; vLLM's qwen3 parser)
    ("plan\n<tool_call>\n<function=f>\n</function>\n</tool_call>", True, "plan\n",
     "<tool_call>\n<function=f>\n</function>\n</tool_call>"),
    ("<think>plan <tool_call> <function name=f>", False, "plan ", "<tool_call> <function name=f>"),
    # a mention of <tool_call> in the reasoning does not end it; whichever ends it first wins
    ("a <tool_call> b <tool_call>\n<function=f>", True, "a <tool_call> b ", "<tool_call>\n<function=f>"),
    ("say <tool_call> then </think>answer", True, "say <tool_call> then ", "answer"),
    ("a <tool_call>\n<functionx </think>b", True, "a <tool_call>\n<functionx ", "b"),
    ("cut off at <tool_call>\n<func", True, "cut off at <tool_call>\n<func", ""),
    ("plan</think>answer <tool_call>\n<function=f>", True, "plan", "answer <tool_call>\n<function=f>"),
    ("plan <tool_call>\n<function=f>", False, None, "plan <tool_call>\n<function=f>"),  # block not open
])
def test_reasoning_split(text, opened, reasoning, content):
    split = split_reasoning(text, opened_in_prompt=opened)
    assert (split.reasoning, split.content) == (reasoning, content)
    whole = _check_streams(lambda: ChatOutputParser(make_reasoning_parser("qwen3", "<think>\n" if opened else "")),
                           text)
    assert whole == {"content": content, "reasoning_content": reasoning or "", "tool_calls": []}


def test_prompt_opens_think():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="valid: qwen3"):
        make_reasoning_parser("deepseek_r1", "")


def test_message_without_think_keeps_content_and_no_reasoning_field():
    fields = _parser(reasoning="qwen3").parse("hello")
    assert fields.content == "hello" and fields.reasoning_content is None
    fields = _parser(reasoning="qwen3", prompt_tail="<think>\n").parse("only thoughts</think>")
    assert fields.content is None and fields.reasoning_content == "only thoughts"


# ---- tool calls ----------------------------------------------------------------------------------
def test_hermes_one_call_with_content():
    whole = _check_streams(lambda: _parser("hermes"), HERMES_ONE)
    assert whole["content"] == "Let me look."
    [call] = whole["tool_calls"]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris", "days": 3, "nested": {"a": [1, {"b": "}"}]}}


def test_hermes_two_calls_and_escapes():
    whole = _check_streams(lambda: _parser("hermes"), HERMES_TWO)
    assert whole["content"] == ""
    assert [c["name"] for c in whole["tool_calls"]] == ["get_weather", "search"]
    assert json.loads(whole["tool_calls"][1]["arguments"]) == {"q": 'café "x"'}


def test_hermes_other_key_order_and_string_arguments():
    text = '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>'
    whole = _check_streams(lambda: _parser("hermes"), text)
    assert whole["tool_calls"] == [{"name": "search", "arguments": '{"q": "x"}'}]
    text = '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
    whole = _check_streams(lambda: _parser("hermes"), text)
    assert json.loads(whole["tool_calls"][0]["arguments"]) == {"q": "x"}


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call> trailing is fine <tool_call>{bad',
    "plain text with a <tool_call mention",
])
def test_hermes_unparseable_is_plain_content(text):
    fields = _parser("hermes").parse(text)
    assert fields.tool_calls == [] and fields.content == text


def test_unparseable_stream_without_a_name_sent_is_plain_content():
    for text in ("<tool_call>not json</tool_call> and more", "<tool_call>{\"arguments\": {}}</tool_call>"):
        assert _check_streams(lambda: _parser("hermes"), text) == {"content": text, "reasoning_content": "",
                                                                  "tool_calls": []}


def test_qwen3_coder_types_by_schema():
    whole = _check_streams(lambda: _parser("qwen3_coder"), CODER_ONE)
    assert whole["content"] == "I'll check."
    [call] = whole["tool_calls"]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "San Francisco", "days": 3, "metric": True, "hours": [1, 2],
                                             "zip": "02139"}


def test_qwen3_coder_enum_member_without_padding():
    """An enforced tool_choice lets one whitespace character stand around a value: an enum member is
    still recognised (a free string keeps its text)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "unit": {"enum": ["c", "f"]}, "note": {"type": "string"}}}}}]
    parser = make_tool_parser("qwen3_coder", tools)
    parsed = parser.parse("<tool_call>\n<function=f>\n<parameter=unit> c\t</parameter>\n"
                          "<parameter=note> x </parameter>\n</function>\n</tool_call>")
    assert json.loads(parsed.calls[0].arguments) == {"unit": "c", "note": " x "}


def test_qwen3_coder_two_calls_multiline_and_no_parameters():
    whole = _check_streams(lambda: _parser("qwen3_coder"), CODER_TWO)
    assert [(c["name"], json.loads(c["arguments"])) for c in whole["tool_calls"]] == [
        ("search", {"q": "multi\nline"}), ("get_weather", {})]


def test_qwen3_coder_without_the_tool_call_wrapper():
    text = ("Sure.\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n"
            "<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>")
    whole = _check_streams(lambda: _parser("qwen3_coder"), text)
    assert whole["content"] == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in whole["tool_calls"]] == [
        ("search", {"q": "x"}), ("get_weather", {"days": 2})]
    mixed = CODER_TWO.replace("<tool_call>\n<function=get_weather>", "<function=get_weather>")
    whole = _check_streams(lambda: _parser("qwen3_coder"), mixed)
    assert [c["name"] for c in whole["tool_calls"]] == ["search", "get_weather"]


def test_qwen3_coder_unparseable_is_plain_content():
    for text in ("<tool_call>\nno function here\n</tool_call>", "<tool_call><function=x><junk></function></tool_call>"):
        fields = _parser("qwen3_coder").parse(text)
        assert fields.tool_calls == [] and fields.content == text


def test_reasoning_then_tool_call_streams_both():
    text = "<think>\nI should call it.\n</think>\n\n" + HERMES_ONE
    whole = _check_streams(lambda: _parser("hermes", "qwen3"), text)
    assert whole["reasoning_content"] == "\nI should call it.\n"
    assert whole["content"] == "\n\nLet me look." and whole["tool_calls"][0]["name"] == "get_weather"
    fields = _parser("hermes", "qwen3", prompt_tail="<think>\n").parse(
        'thinking</think>\n\n<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert fields.content is None and fields.reasoning_content == "thinking" and len(fields.tool_calls) == 1


def test_qwen3_5_tool_call_inside_the_open_think_block():
    """Qwen3.5 may call a tool before closing its think block: the call is a tool call (finish_reason
    tool_calls), streamed or whole, not reasoning text."""
    text = "I should check the weather.\n" + CODER_ONE
    whole = _check_streams(lambda: _parser("qwen3_coder", "qwen3", prompt_tail="<think>\n"), text)
    assert whole["reasoning_content"] == "I should check the weather.\nI'll check.\n" and whole["content"] == ""
    assert [c["name"] for c in whole["tool_calls"]] == ["get_weather"]
    assert json.loads(whole["tool_calls"][0]["arguments"])["city"] == "San Francisco"


def test_named_choice_keeps_only_that_function():
    whole = _check_streams(lambda: _parser("hermes", only="search"), HERMES_TWO)
    assert [c["name"] for c in whole["tool_calls"]] == ["search"]
    whole = _check_streams(lambda: _parser("hermes", only="search"), HERMES_ONE)
    assert whole == {"content": HERMES_ONE, "reasoning_content": "", "tool_calls": []}  # not called: plain text


def test_tool_call_ids_are_unique():
    fields = _parser("hermes").parse(HERMES_TWO)
    ids = [c["id"] for c in fields.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    with pytest.raises(ValueError, match="valid: hermes, qwen3_coder"):
        make_tool_parser("mistral", None)


def test_json_tool_choice_parser_and_schema():
    """The parser-less form of tool_choice 'required' / named (lamina.entrypoints.openai.tool_choice_json):
    the schema lists every tool (one item at most without parallel calls); the parser reads the array
    or the arguments object, holds 'required' calls until the array is whole, and calls malformed JSON
    plain content."""
    from lamina.entrypoints.openai.tool_choice_json import JsonToolChoiceParser, json_tool_choice_constraint

    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "b"}}]
    schema = json_tool_choice_constraint(tools, "required", None, parallel_tool_calls=False).json
    assert schema["maxItems"] == 1 and [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["a"], ["b"]]
    assert json_tool_choice_constraint(tools, "named", "b").json == {"type": "object"}
    required = JsonToolChoiceParser(tools, None)
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert required.parse(text[:20], final=False).calls == [] and required.parse(text[:20], final=False).content == ""
    parsed = required.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("a", {"x": 1}), ("b", {})]
    assert [c.name for c in required.parse(text, max_calls=1).calls] == ["a"]
    assert not required.parse(text[:-3]).valid
    named = JsonToolChoiceParser(tools, "a")
    assert named.parse('{"x": ', final=False).calls[0].arguments == '{"x": '
    assert named.parse('{"x": 1}').calls[0].arguments == '{"x": 1}' and not named.parse('{"x": ').valid

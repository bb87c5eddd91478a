"""Tool calls and reasoning through the `openai` client against a real server: `--tool-call-parser`,
`--enable-auto-tool-choice`, `--reasoning-parser qwen3`, `--chat-template`, tool results in follow-ups.

The model is a scripted bigram checkpoint (tests/scripted_checkpoint.py): greedy decoding after the chat
template's `<|im_start|>assistant\n` writes

    <think>Checking the weather.</think>\n\n<tool_call>\n{"name": "get_weather", ...}\n</tool_call>

one token per piece, and after a prompt ending in `</think>\n\n` (enable_thinking=false) only the call.
"""

from __future__ import annotations

import json

import openai
import pytest

from lamina import LLM
from lamina.entrypoints.openai.chat_tools import ChatOptions
from tests.scripted_checkpoint import make_scripted_checkpoint
from tests.server_harness import MODEL_NAME, RunningServer

# A Qwen3-style template, shortened: tools in the system turn, assistant tool calls and tool results in
# the history, and enable_thinking=false closing an empty think block. (No whitespace control: the text
# between tags has only the newlines meant.)
TOOLS_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for tc in message.tool_calls or [] %}"
    "<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n"
    "</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# The same, but the generation prompt opens the think block itself (as Qwen3.5's does, there with "\n").
OPEN_THINK_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n",
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>")
assert OPEN_THINK_TEMPLATE != TOOLS_TEMPLATE

THOUGHT = "Checking the weather."
HERMES_PIECES = ["<think>", "Checking", " the", " weather", ".", "</think>", "\n\n", "<tool_call>",
                 '\n{"name": "get_weather", "arguments": {"city": "', "Paris", '", "days": ', "3", "}}\n",
                 "</tool_call>"]
CODER_PIECES = ["<think>", "Checking", " the", " weather", ".", "</think>", "\n\n", "<tool_call>",
                "\n<function=get_weather>\n<parameter=city>\n", "Paris", "\n</parameter>\n<parameter=days>\n", "3",
                "\n</parameter>\n</function>\n", "</tool_call>"]
ARGS = {"city": "Paris", "days": 3}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _ckpt(qwen3_next_dir, tmp_path_factory, pieces, name):
    return make_scripted_checkpoint(qwen3_next_dir, tmp_path_factory.mktemp(name) / "ckpt", pieces,
                                    chat_template=TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def hermes_ckpt(qwen3_next_dir, tmp_path_factory):
    return _ckpt(qwen3_next_dir, tmp_path_factory, HERMES_PIECES, "scripted_hermes")


def _serve(path, **chat):
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=512, show_progress=False)
    return llm, RunningServer(llm.engine, chat=ChatOptions(**chat))


@pytest.fixture(scope="module")
def client(hermes_ckpt):
    llm, srv = _serve(hermes_ckpt, tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    with llm, srv, openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60) as c:
        yield c


def _create(client, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=kw.pop("messages", MESSAGES), temperature=0,
                                          max_tokens=kw.pop("max_tokens", 60), **kw)


def _streamed(client, **kw):
    """The stream's chunks folded into (reasoning, content, calls, finish_reason, deltas in order)."""
    reasoning, content, calls, finish, order = "", "", [], None, []
    for chunk in _create(client, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")  # vLLM's two names, same text
            if extra.get("reasoning_content"):
                reasoning += extra["reasoning_content"]
                order.append("reasoning")
            if delta.content:
                content += delta.content
                order.append("content")
            for tc in delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index == len(calls) and tc.type == "function" and tc.function.name
                    calls.append({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""})
                    order.append("header")
                else:
                    assert tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments
                    order.append("arguments")
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish, order


def test_auto_tool_call_streamed_and_not(client):
    out = _create(client, tools=TOOLS)
    assert out.usage.completion_tokens == len(HERMES_PIECES) + 1  # the script, then EOS
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content is None
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == THOUGHT
    [call] = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS

    reasoning, content, calls, finish, order = _streamed(client, tools=TOOLS, tool_choice="auto")
    assert reasoning == THOUGHT and content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert order.index("header") < order.index("arguments") and order.count("arguments") >= 3  # in fragments
    assert order[0] == "reasoning"


def test_tool_call_cut_off_by_max_tokens_streamed_and_not(client):
    """max_tokens ends the answer inside the call's arguments. The whole answer has no tool call:
    its content is the raw text and its finish reason "length". The stream has sent the call's
    header and part of its arguments by then: it does not send that text again as content, and
    its finish reason is "length" too, never "tool_calls" for a call whose arguments are cut."""
    header_at = next(i for i, piece in enumerate(HERMES_PIECES) if "<tool_call>" in piece)
    max_tokens = header_at + 4  # inside the arguments
    out = _create(client, tools=TOOLS, max_tokens=max_tokens).choices[0]
    assert out.finish_reason == "length" and not out.message.tool_calls
    assert "<tool_call>" in out.message.content
    reasoning, content, calls, finish, order = _streamed(client, tools=TOOLS, max_tokens=max_tokens)
    assert reasoning == THOUGHT and finish == "length"
    assert "header" in order and [c["name"] for c in calls] == ["get_weather"]
    assert "<tool_call>" not in content and content.strip() == out.message.content.split("<tool_call>")[0].strip()


def test_tool_result_follow_up_goes_through_the_template(client, hermes_ckpt):
    first = _create(client, tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    follow_up = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    out = _create(client, messages=follow_up, tools=TOOLS)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hermes_ckpt)
    templated = [dict(m) for m in follow_up]
    templated[1] = {**templated[1], "tool_calls": [{**call.model_dump(exclude_none=True),
                                                   "function": {"name": "get_weather", "arguments": ARGS}}]}
    text = tok.apply_chat_template(templated, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert out.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    assert out.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_required_and_named(client):
    out = _create(client, tools=TOOLS, tool_choice="none").choices[0]
    assert out.finish_reason == "stop" and not out.message.tool_calls
    assert out.message.content.startswith("\n\n<tool_call>") and out.message.model_extra["reasoning_content"] == THOUGHT
    # required / named are enforced while decoding and the answer is the call alone, no reasoning first
    # (docs/SERVING.md); with the think block closed by the template, the script's call fits the grammar
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        want = "tool_calls" if choice == "required" else "stop"  # a named function: "stop", as OpenAI and vLLM answer
        out = _create(client, tools=TOOLS, tool_choice=choice, extra_body=no_think).choices[0]
        assert out.finish_reason == want and out.message.content is None
        assert out.message.model_extra["reasoning_content"] is None  # the parser is on; there is no reasoning
        [call] = out.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
        reasoning, content, calls, finish, _ = _streamed(client, tools=TOOLS, tool_choice=choice, extra_body=no_think)
        assert finish == want and (reasoning, content) == ("", "")
        assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    # a named choice makes the model call that function even though it wanted another one (search takes
    # no parameters, so its arguments are {})
    named = {"type": "function", "function": {"name": "search"}}
    out = _create(client, tools=TOOLS, tool_choice=named, extra_body=no_think).choices[0]
    assert out.finish_reason == "stop" and out.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.message.tool_calls] == [("search", {})]
    # the same when the model wanted to think first: the grammar keeps <think> out
    out = _create(client, tools=TOOLS, tool_choice=named).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.message.tool_calls] == [("search", {})]


def test_reasoning_without_tools_and_enable_thinking_false(client):
    out = _create(client).choices[0].message  # no tools: nothing is parsed as a call
    assert out.model_extra["reasoning_content"] == THOUGHT and out.content.startswith("\n\n<tool_call>")
    reasoning, content, _, _, _ = _streamed(client)
    assert (reasoning, content) == (THOUGHT, out.content)
    # the template closes an empty think block: the output has no think tags, all of it is the answer
    kwargs = dict(tools=TOOLS, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    out = _create(client, **kwargs).choices[0].message
    assert out.model_extra["reasoning_content"] is None and out.content is None
    assert json.loads(out.tool_calls[0].function.arguments) == ARGS
    reasoning, content, calls, _, _ = _streamed(client, **kwargs)
    assert reasoning == "" and content == "" and calls[0]["arguments"] == out.tool_calls[0].function.arguments


def test_template_that_opens_the_think_block(hermes_ckpt):
    llm, srv = _serve(hermes_ckpt, reasoning_parser="qwen3", chat_template=OPEN_THINK_TEMPLATE)
    with llm, srv, openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60) as c:
        response = _create(c)
        assert response.usage.completion_tokens == len(HERMES_PIECES)  # the prompt ended with <think>
        out = response.choices[0]
        assert out.message.model_extra["reasoning_content"] == THOUGHT  # output: "Checking the weather.</think>..."
        assert out.message.content.startswith("\n\n<tool_call>")
        reasoning, content, _, _, _ = _streamed(c)
        assert (reasoning, content) == (THOUGHT, out.message.content)
        # without parsers configured, tools need tool_choice none (auto needs --enable-auto-tool-choice)
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            _create(c, tools=TOOLS)
        out = _create(c, tools=TOOLS, tool_choice="none").choices[0]
        assert not out.message.tool_calls and out.finish_reason == "stop"


# A script that writes vLLM's JSON form of tool_choice 'required' (what the grammar allows without a parser)
JSON_REQUIRED_PIECES = ['[{"name": "get_weather", "parameters": {"city": "', "Paris", '", "days": ', "3", "}}]"]


def test_required_and_named_tool_choice_without_a_parser(qwen3_next_dir, tmp_path_factory):
    """No --tool-call-parser: tool_choice 'required' / a named function are still served, as vLLM serves
    them: the call is written as JSON under a JSON schema (an array of {name, parameters}; the named
    function's arguments object) and read back into tool_calls, streamed and not; a call cut off by
    max_tokens leaves the text as content."""
    path = _ckpt(qwen3_next_dir, tmp_path_factory, JSON_REQUIRED_PIECES, "scripted_json_tools")
    llm, srv = _serve(path, reasoning_parser="qwen3")
    with llm, srv, openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60) as c:
        out = _create(c, tools=TOOLS, tool_choice="required").choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None
        [call] = out.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
        reasoning, content, calls, finish, _ = _streamed(c, tools=TOOLS, tool_choice="required")
        assert (reasoning, content, finish) == ("", "", "tool_calls")
        assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [("get_weather", ARGS)]
        named = {"type": "function", "function": {"name": "search"}}  # its schema: an object, no properties
        out = _create(c, tools=TOOLS, tool_choice=named).choices[0]
        assert out.finish_reason == "stop" and out.message.content is None
        assert [(x.function.name, json.loads(x.function.arguments)) for x in out.message.tool_calls] == [("search", {})]
        reasoning, content, calls, finish, order = _streamed(c, tools=TOOLS, tool_choice=named)
        assert (content, finish, [(x["name"], x["arguments"]) for x in calls]) == ("", "stop", [("search", "{}")])
        cut = _create(c, tools=TOOLS, tool_choice="required", max_tokens=2).choices[0]
        assert cut.finish_reason == "length" and not cut.message.tool_calls
        assert cut.message.content == JSON_REQUIRED_PIECES[0] + JSON_REQUIRED_PIECES[1]


def test_qwen3_coder_calls(qwen3_next_dir, tmp_path_factory):
    path = _ckpt(qwen3_next_dir, tmp_path_factory, CODER_PIECES, "scripted_coder")
    llm, srv = _serve(path, tool_call_parser="qwen3_coder", enable_auto_tool_choice=True)
    with llm, srv, openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60) as c:
        out = _create(c, tools=TOOLS).choices[0]
        assert out.finish_reason == "tool_calls"
        [call] = out.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS  # days: int
        assert "reasoning_content" not in (out.message.model_extra or {})  # no reasoning parser
        assert out.message.content.startswith("<think>Checking")  # the text before the call
        _, content, calls, finish, order = _streamed(c, tools=TOOLS)
        assert finish == "tool_calls" and content == out.message.content
        assert [(x["name"], x["arguments"]) for x in calls] == [("get_weather", call.function.arguments)]
        assert order.count("arguments") >= 2


# (a bigram chain: each piece one distinct token, so the second call is written as one piece)
TWO_CALL_PIECES = ["<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>",
                   '\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>']


def test_parallel_tool_calls_false_keeps_the_first_call(qwen3_next_dir, tmp_path_factory):
    """`parallel_tool_calls: false` with tool_choice auto (given or by default): the model writes two
    calls, the answer holds the first only, streamed and not (vLLM since PR #26233, and OpenAI);
    without it, or with true, both."""
    path = _ckpt(qwen3_next_dir, tmp_path_factory, TWO_CALL_PIECES, "scripted_two_calls")
    llm, srv = _serve(path, tool_call_parser="hermes", enable_auto_tool_choice=True)
    with llm, srv, openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60) as c:
        for extra, names in (({"tool_choice": "auto", "parallel_tool_calls": False}, ["get_weather"]),
                             ({"parallel_tool_calls": False}, ["get_weather"]),
                             ({"parallel_tool_calls": True}, ["get_weather", "search"]),
                             ({}, ["get_weather", "search"])):
            out = _create(c, tools=TOOLS, **extra).choices[0]
            assert out.finish_reason == "tool_calls" and not out.message.content, (extra, out)
            assert [call.function.name for call in out.message.tool_calls] == names, extra
            assert json.loads(out.message.tool_calls[0].function.arguments) == {"city": "Paris"}
            _, content, calls, finish, _ = _streamed(c, tools=TOOLS, **extra)
            assert finish == "tool_calls" and content == "", extra
            assert [(x["name"], x["arguments"]) for x in calls] == \
                [(call.function.name, call.function.arguments) for call in out.message.tool_calls], extra


@pytest.mark.parametrize("parser, second", [
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {oops}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=search>\nnot a parameter\n</function>\n</tool_call>"),
])
def test_parallel_tool_calls_false_ignores_what_follows_the_first_call(parser, second):
    """With one call allowed, the text after the first whole call is not parsed: a malformed second
    call leaves the first one standing (else the whole answer would be plain content)."""
    from lamina.entrypoints.openai.chat_output import ChatOutputParser
    from lamina.entrypoints.openai.tool_parsers import make_tool_parser

    first = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' if parser == "hermes"
             else "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                  "</tool_call>")
    text = f"Let me check.\n{first}\n{second}"
    fields = ChatOutputParser(None, make_tool_parser(parser, TOOLS), max_calls=1).parse(text)
    assert fields.content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in fields.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert not ChatOutputParser(None, make_tool_parser(parser, TOOLS)).parse(text).tool_calls  # all calls: invalid
    stream = ChatOutputParser(None, make_tool_parser(parser, TOOLS), max_calls=1)
    deltas = [d for end in range(1, len(text) + 1) for d in stream.deltas(text[:end], end == len(text))]
    assert stream.called_tools
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    headers = [tc for d in deltas for tc in d.get("tool_calls", []) if "id" in tc]
    assert [(h["index"], h["function"]["name"]) for h in headers] == [(0, "get_weather")]


def test_bad_tool_requests_are_400_and_the_server_stays_healthy(client):
    for kwargs, match in (
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
        (dict(tools=[{"type": "function", "function": {"name": ""}}]), "non-empty string"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "is not valid"),
        (dict(messages=MESSAGES + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]),
         "not valid JSON"),
    ):
        with pytest.raises(openai.BadRequestError, match=match):
            _create(client, **kwargs)
    assert _create(client, tools=TOOLS).choices[0].finish_reason == "tool_calls"


def test_offline_chat_renders_tools(hermes_ckpt):
    from lamina import SamplingParams
    from lamina.entrypoints.openai.chat_output import ChatOutputParser
    from lamina.entrypoints.openai.reasoning_parser import make_reasoning_parser
    from lamina.entrypoints.openai.tool_parsers import make_tool_parser

    with LLM(str(hermes_ckpt), device="cpu", max_model_len=512, show_progress=False) as llm:
        [with_tools] = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=40), tools=TOOLS, use_tqdm=False)
        [plain] = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids)  # the tools are in the prompt
    fields = ChatOutputParser(make_reasoning_parser("qwen3", ""), make_tool_parser("hermes", TOOLS)).parse(
        with_tools.outputs[0].text)  # the server's parsers work on offline output too
    assert fields.reasoning_content == THOUGHT and json.loads(fields.tool_calls[0]["function"]["arguments"]) == ARGS

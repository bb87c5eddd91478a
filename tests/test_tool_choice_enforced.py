"""tool_choice `required` and a named function enforced while decoding (issue 13): the structural tag
built from the tools and the `--tool-call-parser` format accepts exactly the calls it should, and a tiny
*random* checkpoint (nothing scripted) served by `lamina serve` answers every such request, through the
`openai` client, streamed and not, with a tool call whose arguments validate against the tool's schema.

A random model never chooses to stop, so these requests put a large logit_bias on EOS: once the grammar
allows EOS (after the first complete call) the answer ends; until then the mask keeps EOS out.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from lamina import LLM
from lamina.entrypoints.openai.chat_tools import ChatOptions
from lamina.entrypoints.openai.tool_choice_grammar import tool_choice_constraint
from tests.server_harness import MODEL_NAME, RunningServer

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["celsius", "fahrenheit"]},
}, "required": ["city", "unit"]}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 8},
    "exact": {"type": "boolean"},
}, "required": ["query"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: arguments {}
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "ping": {"type": "object", "properties": {}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def validate(name: str, arguments, padded: bool = False) -> None:
    """The arguments against SCHEMAS[name], by hand (jsonschema is not a dependency): an object with the
    required keys, no others, each value of its type and range. `padded` (qwen3_coder): a string value is
    free text that may carry one whitespace character on either side (the grammar allows it, the parser
    keeps it), so maxLength counts without them."""
    schema = SCHEMAS[name]
    assert isinstance(arguments, dict), arguments
    props = schema["properties"]
    assert set(schema.get("required", [])) <= set(arguments) <= set(props), (name, arguments)
    for key, value in arguments.items():
        rule = props[key]
        if "enum" in rule:
            assert value in rule["enum"], (key, value)
        elif rule["type"] == "string":
            assert isinstance(value, str), (key, value)
            if padded:
                value = value[1:] if value[:1].isspace() else value
                value = value[:-1] if value[-1:].isspace() else value
            assert len(value) <= rule["maxLength"], (key, value)
        elif rule["type"] == "integer":
            assert isinstance(value, int) and not isinstance(value, bool), (key, value)
            assert rule["minimum"] <= value <= rule["maximum"], (key, value)
        elif rule["type"] == "boolean":
            assert isinstance(value, bool), (key, value)


# ---- the grammar --------------------------------------------------------------------------------
def _accepts(spec, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(json.dumps(spec.structural_tag)), text)


def _hermes(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_hermes_grammar():
    required = tool_choice_constraint("hermes", TOOLS, "required", None)
    one = _hermes("get_weather", {"city": "Paris", "unit": "celsius"})
    two = _hermes("search", {"query": "x", "exact": True})
    assert _accepts(required, one) and _accepts(required, two) and _accepts(required, _hermes("ping", {}))
    assert _accepts(required, one + "\n" + two)  # parallel calls
    assert not _accepts(required, "")  # at least one call
    assert not _accepts(required, "Sure! " + one)  # nothing before the call
    assert not _accepts(required, _hermes("get_weather", {"city": "Paris"}))  # a required key missing
    assert not _accepts(required, _hermes("get_weather", {"city": "Paris", "unit": "kelvin"}))
    assert not _accepts(required, _hermes("get_weather", {"city": "Paris", "unit": "celsius", "x": 1}))
    assert not _accepts(required, _hermes("ping", {"x": 1}))
    assert not _accepts(required, _hermes("send_mail", {}))  # not a tool
    assert not _accepts(required, "<think>hm</think>\n\n" + one)  # no reasoning first
    single = tool_choice_constraint("hermes", TOOLS, "required", None, parallel_tool_calls=False)
    assert _accepts(single, one) and not _accepts(single, one + "\n" + two)
    named = tool_choice_constraint("hermes", TOOLS, "named", "search")
    assert _accepts(named, two) and not _accepts(named, one) and not _accepts(named, two + "\n" + two)


def test_qwen3_coder_grammar():
    def call(name, *params):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
        return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"

    required = tool_choice_constraint("qwen3_coder", TOOLS, "required", None)
    one = call("get_weather", ("city", "Paris"), ("days", 3), ("unit", "celsius"))
    assert _accepts(required, one) and _accepts(required, call("ping")) and _accepts(required, one + "\n" + one)
    assert _accepts(required, call("search", ("query", "a <b> c")))  # string values: free text
    assert not _accepts(required, call("get_weather", ("city", "Paris"), ("days", "three"), ("unit", "celsius")))
    assert not _accepts(required, call("get_weather", ("city", "Paris")))  # unit is required
    assert not _accepts(required, call("get_weather", ("town", "Paris"), ("unit", "celsius")))
    assert not _accepts(required, call("nope"))
    named = tool_choice_constraint("qwen3_coder", TOOLS, "named", "ping")
    assert _accepts(named, call("ping")) and not _accepts(named, one)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="cannot be enforced"):
        tool_choice_constraint("mistral", TOOLS, "required", None)


# ---- `lamina serve` on a random checkpoint ---------------------------------------------------------
def _server(path, **chat):
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=512, show_progress=False, max_num_seqs=8)
    return llm, RunningServer(llm.engine, chat=ChatOptions(**chat))


@pytest.fixture(scope="module")
def eos_bias(qwen3_next_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_next_dir)
    return {str(tok.convert_tokens_to_ids(tok.eos_token)): 100.0}


def _ask(url, eos_bias, requests):
    """Each request's (finish_reason, [(name, arguments text)], content), at concurrency 8."""

    async def main():
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
        gate = asyncio.Semaphore(8)

        async def one(i, tool_choice, stream):
            kw = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0,
                      seed=i, max_tokens=200, logit_bias=eos_bias)
            async with gate:
                if not stream:
                    choice = (await client.chat.completions.create(**kw)).choices[0]
                    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
                    return choice.finish_reason, calls, choice.message.content
                finish, calls, content = None, [], ""
                async for chunk in await client.chat.completions.create(stream=True, **kw):
                    for choice in chunk.choices:
                        content += choice.delta.content or ""
                        for tc in choice.delta.tool_calls or []:
                            if tc.id is not None:
                                calls.append([tc.function.name, tc.function.arguments or ""])
                            else:
                                calls[tc.index][1] += tc.function.arguments
                        finish = choice.finish_reason or finish
                return finish, [tuple(c) for c in calls], content or None

        try:
            return await asyncio.gather(*(one(i, choice, stream) for i, (choice, stream) in enumerate(requests)))
        finally:
            await client.close()

    return asyncio.run(main())


def _check(answers, named=None, padded=False):
    for finish, calls, content in answers:
        # a named function answers "stop", as OpenAI and vLLM do; `required` answers "tool_calls"
        assert finish == ("tool_calls" if named is None else "stop") and content is None and len(calls) == 1, \
            (finish, calls, content)
        name, arguments = calls[0]
        assert named is None or name == named
        validate(name, json.loads(arguments), padded)


def test_hermes_required_and_named_on_a_random_model(qwen3_next_dir, eos_bias):
    llm, srv = _server(qwen3_next_dir, tool_call_parser="hermes", reasoning_parser="qwen3")
    with llm, srv:
        named = {"type": "function", "function": {"name": "get_weather"}}
        answers = _ask(srv.base_url, eos_bias, [("required", i % 2 == 1) for i in range(10)]
                       + [(named, i % 2 == 1) for i in range(10)])
        _check(answers[:10])
        _check(answers[10:], named="get_weather")
        assert len({args for _, [(_, args)], _ in answers}) > 1  # sampled, not one fixed answer
        assert srv.async_engine.is_healthy


def test_qwen3_coder_required_and_named_on_a_random_model(qwen3_next_dir, eos_bias):
    llm, srv = _server(qwen3_next_dir, tool_call_parser="qwen3_coder", enable_auto_tool_choice=True)
    with llm, srv:
        named = {"type": "function", "function": {"name": "search"}}
        answers = _ask(srv.base_url, eos_bias, [("required", False)] * 6 + [(named, False)] * 4 + [(named, True)] * 2)
        _check(answers[:6], padded=True)
        _check(answers[6:], named="search", padded=True)
        # auto is not enforced: the random model writes whatever it writes, and that is plain content
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=600)
        out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8)
        assert out.choices[0].finish_reason == "length" and not out.choices[0].message.tool_calls


def test_refusals(qwen3_next_dir):
    llm, srv = _server(qwen3_next_dir, tool_call_parser="hermes")
    with llm, srv, openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60) as client:
        def create(**kw):
            return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=4, **kw)

        with pytest.raises(openai.BadRequestError, match="tool_choice 'required' cannot be combined with "
                                                          "response_format") as e:
            create(tool_choice="required", response_format={"type": "json_object"})
        assert e.value.body["param"] == "response_format"
        with pytest.raises(openai.BadRequestError, match="naming function 'search' cannot be combined with "
                                                          "structured_outputs"):
            create(tool_choice={"type": "function", "function": {"name": "search"}},
                   extra_body={"structured_outputs": {"regex": "a+"}})
        bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]
        with pytest.raises(openai.BadRequestError, match="could not be enforced for these tools") as e:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=bad, tool_choice="required",
                                           max_tokens=4)
        assert e.value.body["param"] == "tools"
        # response_format text is no constraint
        assert create(tool_choice="required", response_format={"type": "text"}).choices[0].finish_reason == "length"


def test_enforced_under_speculative_decoding(qwen3_next_dir, tmp_path, eos_bias):
    """Under MTP the grammar masks every verified position (drafts taken tentatively), so `required` and a
    named function give valid calls there too, streamed and not."""
    import shutil

    from tests import tiny_checkpoints as tc

    path = tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "mtp"))
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=512, show_progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with llm, RunningServer(llm.engine, chat=ChatOptions(tool_call_parser="hermes")) as srv:
        named = {"type": "function", "function": {"name": "search"}}
        answers = _ask(srv.base_url, eos_bias, [("required", False), ("required", True), (named, False), (named, True)])
        _check(answers[:2])
        _check(answers[2:], named="search")
        assert llm.engine.spec_decode_metrics.num_draft_tokens > 0

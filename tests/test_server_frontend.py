"""vLLM's frontend behaviour of `lamina serve` beyond the OpenAI fields: /ping and /invocations,
stream_options' defaults and --enable-force-include-usage, X-Request-Id and the body's request_id,
chat return_token_ids, --response-role, --enable-prompt-tokens-details, --default-chat-template-kwargs,
--enable-log-requests / --max-log-len, model cards, tool_choice 'required' with no tools."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from lamina import LLM
from lamina.entrypoints.openai.serving import FrontendOptions
from tests.server_harness import MODEL_NAME, RunningServer
from tests.test_server_api import ckpt  # noqa: F401 (the fixture: the tiny checkpoint with a thinking template)

MESSAGES = [{"role": "user", "content": "Tell me about the river."}]
GREEDY = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def _llm(path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=256, show_progress=False, max_num_seqs=4)


@pytest.fixture(scope="module")
def server(ckpt):
    with _llm(ckpt) as engine_llm, RunningServer(engine_llm.engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(ckpt):
    """An engine of its own for the servers a test starts with other options, one at a time: an engine
    is stepped by one server's thread only (two would take each other's outputs)."""
    with _llm(ckpt) as llm:
        yield llm


def _events(response: httpx.Response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _stream(url: str, body: dict, **kw) -> list[dict]:
    return _events(httpx.post(url, json=body | {"stream": True}, timeout=60, **kw))


def test_ping_and_invocations(llm, server):
    for method in (httpx.get, httpx.post):
        ping = method(f"{server.url}/ping")
        assert ping.status_code == 200 and ping.json() == {"status": "ok"}
    chat = httpx.post(f"{server.base_url}/chat/completions", json=GREEDY | {"messages": MESSAGES}, timeout=60).json()
    via = httpx.post(f"{server.url}/invocations", json=GREEDY | {"messages": MESSAGES}, timeout=60).json()
    assert via["object"] == "chat.completion" and via["choices"][0]["message"] == chat["choices"][0]["message"]
    cmpl = httpx.post(f"{server.url}/invocations", json=GREEDY | {"prompt": "The baker"}, timeout=60).json()
    assert cmpl["object"] == "text_completion" and cmpl["usage"]["completion_tokens"] == 5
    bad = httpx.post(f"{server.url}/invocations", json={"model": MODEL_NAME}, timeout=60)
    assert bad.status_code == 400 and "'messages'" in bad.json()["error"]["message"]
    invalid = httpx.post(f"{server.url}/invocations", json=GREEDY | {"prompt": "x", "temperature": "hot"}, timeout=60)
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "temperature"
    with RunningServer(llm.engine, api_key="k") as guarded:  # /invocations generates: it takes the key too
        assert httpx.post(f"{guarded.url}/invocations", json=GREEDY | {"prompt": "x"}).status_code == 401
        assert httpx.get(f"{guarded.url}/ping").status_code == 200


@pytest.mark.parametrize("options, usage_chunks", [
    ({}, "last"),  # vLLM's default: stream_options given means include_usage true
    ({"continuous_usage_stats": True}, "every"),
    ({"include_usage": False}, "none"),
    (None, "none"),
])
def test_stream_options_as_vllm_reads_them(server, options, usage_chunks):
    body = GREEDY | {"prompt": "The baker"} | ({} if options is None else {"stream_options": options})
    events = _stream(f"{server.base_url}/completions", body)
    with_usage = [e for e in events if e.get("usage") is not None]
    expected = {"none": 0, "last": 1, "every": len(events)}[usage_chunks]
    assert len(with_usage) == expected
    if usage_chunks != "none":
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    # stream_options without stream: refused when it asks something ({} passes), as vLLM
    plain = httpx.post(f"{server.base_url}/completions", json=GREEDY | {"prompt": "x", "stream_options": {}})
    assert plain.status_code == 200
    asked = httpx.post(f"{server.base_url}/completions",
                       json=GREEDY | {"prompt": "x", "stream_options": {"include_usage": True}})
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "stream_options"


def test_force_include_usage_and_prompt_tokens_details(llm):
    """--enable-force-include-usage: a stream without stream_options ends with usage.
    --enable-prompt-tokens-details: vLLM adds the field only when tokens came from its prefix cache;
    lamina has none, so it stays out, as in vLLM's answers then."""
    frontend = FrontendOptions(force_include_usage=True, prompt_tokens_details=True)
    with RunningServer(llm.engine, frontend=frontend) as srv:
        events = _stream(f"{srv.base_url}/chat/completions", GREEDY | {"messages": MESSAGES})
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
        assert "prompt_tokens_details" not in events[-1]["usage"]
        body = httpx.post(f"{srv.base_url}/completions", json=GREEDY | {"prompt": "x"}, timeout=60).json()
        assert "prompt_tokens_details" not in body["usage"]


def test_request_ids_from_the_header_or_the_body(llm, server):
    got = httpx.post(f"{server.base_url}/chat/completions", json=GREEDY | {"messages": MESSAGES},
                     headers={"X-Request-Id": "trace-1"}, timeout=60)
    assert got.json()["id"] == "chatcmpl-trace-1" and "x-request-id" not in got.headers
    body = httpx.post(f"{server.base_url}/completions", json=GREEDY | {"prompt": "x", "request_id": "body-1"},
                      timeout=60).json()
    assert body["id"] == "cmpl-body-1"
    events = _stream(f"{server.base_url}/completions", GREEDY | {"prompt": "x"}, headers={"X-Request-Id": "s-1"})
    assert {e["id"] for e in events} == {"cmpl-s-1"}
    # the same client id twice at once: two engine requests, two full answers
    with httpx.Client(timeout=60) as client:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: client.post(
                f"{server.base_url}/completions", json=GREEDY | {"prompt": "x"}, headers={"X-Request-Id": "dup"}),
                range(2)))
    assert [a.status_code for a in answers] == [200, 200]
    assert all(a.json()["usage"]["completion_tokens"] == 5 for a in answers)
    too_long = httpx.post(f"{server.base_url}/completions", json=GREEDY | {"prompt": "x"},
                          headers={"X-Request-Id": "x" * 257}, timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "X-Request-Id"
    with RunningServer(llm.engine, frontend=FrontendOptions(request_id_headers=True)) as srv:
        echoed = httpx.post(f"{srv.base_url}/completions", json=GREEDY | {"prompt": "x"},
                            headers={"X-Request-Id": "trace-2"}, timeout=60)
        assert echoed.headers["x-request-id"] == "trace-2" and echoed.json()["id"] == "cmpl-trace-2"
        # every answer carries one, as vLLM's: errors and other routes too, a new id when none was sent
        assert len(httpx.get(f"{srv.base_url}/models").headers["x-request-id"]) == 32
        error = httpx.post(f"{srv.base_url}/completions", json={"model": MODEL_NAME}, headers={"X-Request-Id": "e-1"})
        assert error.status_code == 400 and error.headers["x-request-id"] == "e-1"


def test_chat_return_token_ids(llm, server):
    body = GREEDY | {"messages": MESSAGES, "return_token_ids": True}
    whole = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60).json()
    prompt_ids, token_ids = whole["prompt_token_ids"], whole["choices"][0]["token_ids"]
    assert len(prompt_ids) == whole["usage"]["prompt_tokens"] and len(token_ids) == 5
    assert llm.get_tokenizer().decode(token_ids) == whole["choices"][0]["message"]["content"]
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()
    assert tokenized["tokens"] == prompt_ids
    events = _stream(f"{server.base_url}/chat/completions", body)
    assert events[0]["prompt_token_ids"] == prompt_ids  # the first chunk's top level, as vLLM's chat
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids", [])] == token_ids
    plain = httpx.post(f"{server.base_url}/chat/completions", json=GREEDY | {"messages": MESSAGES}, timeout=60).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_response_role_and_default_template_kwargs(llm):
    from lamina.entrypoints.openai.chat_tools import ChatOptions

    chat = ChatOptions(default_chat_template_kwargs={"enable_thinking": False})
    with RunningServer(llm.engine, frontend=FrontendOptions(response_role="bot"), chat=chat) as srv:
        url = f"{srv.base_url}/chat/completions"
        answer = httpx.post(url, json=GREEDY | {"messages": MESSAGES, "return_token_ids": True}, timeout=60).json()
        assert answer["choices"][0]["message"]["role"] == "bot"
        assert _stream(url, GREEDY | {"messages": MESSAGES})[0]["choices"][0]["delta"]["role"] == "bot"
        think = llm.get_tokenizer().encode("<think>\n\n</think>\n\n", add_special_tokens=False)
        assert answer["prompt_token_ids"][-len(think):] == think  # the server's default kwargs reached the template
        own = GREEDY | {"messages": MESSAGES, "return_token_ids": True, "chat_template_kwargs": {"enable_thinking": True}}
        assert httpx.post(url, json=own, timeout=60).json()["prompt_token_ids"][-len(think):] != think  # the request wins
        go_on = GREEDY | {"messages": MESSAGES + [{"role": "assistant", "content": "The river"}],
                          "add_generation_prompt": False, "continue_final_message": True}
        assert httpx.post(url, json=go_on, timeout=60).json()["choices"][0]["message"]["role"] == "assistant"


def test_default_template_kwargs_may_not_set_reserved_arguments():
    from lamina.entrypoints.openai.chat_tools import ChatOptions

    with pytest.raises(ValueError, match="may not set add_generation_prompt"):
        ChatOptions(default_chat_template_kwargs={"add_generation_prompt": False})


def test_log_requests_cut_to_max_log_len(llm, caplog):
    with RunningServer(llm.engine, frontend=FrontendOptions(log_requests=True, max_log_len=3)) as srv, \
            caplog.at_level(logging.INFO, logger="lamina.entrypoints.openai.serving"):
        httpx.post(f"{srv.base_url}/completions", json=GREEDY | {"prompt": "The baker opened the shutters"}, timeout=60)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request 'cmpl-")]
    assert "prompt 'The'" in line and "(first 3 of" in line and "max_tokens=5" in line
    caplog.clear()
    with RunningServer(llm.engine) as srv, caplog.at_level(logging.INFO, logger="lamina.entrypoints.openai.serving"):
        httpx.post(f"{srv.base_url}/completions", json=GREEDY | {"prompt": "x"}, timeout=60)
    assert not [r for r in caplog.records if r.getMessage().startswith("request ")]  # off by default


def test_model_card_and_required_without_tools(server):
    card = httpx.get(f"{server.base_url}/models").json()["data"][0]
    assert card["parent"] is None and card["permission"][0]["object"] == "model_permission"
    # tool_choice 'required' with an empty tool list means 'none' (OpenAI's and vLLM's rule)
    got = httpx.post(f"{server.base_url}/chat/completions",
                     json=GREEDY | {"messages": MESSAGES, "tools": [], "tool_choice": "required"}, timeout=60)
    assert got.status_code == 200 and got.json()["choices"][0]["message"]["tool_calls"] == []
    missing = httpx.post(f"{server.base_url}/chat/completions",
                         json=GREEDY | {"messages": MESSAGES, "tool_choice": "required"}, timeout=60)
    assert missing.status_code == 400


def test_one_server_drives_an_engine_at_a_time(llm):
    """Two servers stepping one engine would take each other's outputs: a second AsyncEngine on the
    same LLMEngine refuses to start while the first runs, and starts once it has stopped."""
    import asyncio

    from lamina.engine.async_engine import AsyncEngine

    async def run():
        first, second = AsyncEngine(llm.engine), AsyncEngine(llm.engine)
        first.start()
        try:
            with pytest.raises(RuntimeError, match="already driven by another running AsyncEngine"):
                second.start()
        finally:
            first.stop()
        second.start()
        second.stop()

    asyncio.run(run())

"""Bad input gets a 4xx with an OpenAI-shaped error naming the problem, never a 5xx, and the server keeps
serving: a table of cases, an oversized body, and a schemathesis fuzz of the OpenAPI spec."""

from __future__ import annotations

import json

import httpx
import pytest

from lamina import LLM
from tests.server_harness import MODEL_NAME, RunningServer

MAX_MODEL_LEN = 64
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), device="cpu", max_model_len=MAX_MODEL_LEN, show_progress=False) as llm, \
            RunningServer(llm.engine, max_body_bytes=1 << 20) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _cmpl(**kw):
    return ("/v1/completions", {"prompt": "hello", "max_tokens": 2, **kw})


def _chat(**kw):
    return ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, **kw})


# (id, (path, body) or (path, raw text), expected status, the param the error should name (None: don't check))
CASES = [
    ("malformed-json", ("/v1/completions", '{"prompt": "x",'), 400, None),
    ("not-an-object", ("/v1/completions", "[1, 2, 3]"), 400, None),
    ("nan-literal", ("/v1/completions", '{"prompt": "x", "temperature": NaN}'), 400, "temperature"),
    ("infinity-literal", ("/v1/completions", '{"prompt": "x", "top_p": Infinity}'), 400, "top_p"),
    ("missing-prompt", ("/v1/completions", {"max_tokens": 2}), 400, "prompt"),
    ("prompt-wrong-type", _cmpl(prompt=5), 400, "prompt"),
    ("prompt-mixed-list", _cmpl(prompt=[1, "a"]), 400, "prompt"),
    ("max-tokens-string", _cmpl(max_tokens="5"), 400, "max_tokens"),
    ("max-tokens-bool", _cmpl(max_tokens=True), 400, "max_tokens"),
    ("max-tokens-float", _cmpl(max_tokens=2.5), 400, "max_tokens"),
    ("temperature-string", _cmpl(temperature="hot"), 400, "temperature"),
    ("stream-string", _cmpl(stream="yes"), 400, "stream"),
    ("stop-int", _cmpl(stop=5), 400, "stop"),
    ("stop-empty-string", _cmpl(stop=[""]), 400, "stop"),
    ("stop-too-many", _cmpl(stop=[f"s{i}" for i in range(65)]), 400, "stop"),
    ("logit-bias-wrong-type", _cmpl(logit_bias="x"), 400, "logit_bias"),
    ("logit-bias-value-too-big", _cmpl(logit_bias={"5": 101.0}), 400, "logit_bias"),
    ("logit-bias-key-not-a-token", _cmpl(logit_bias={"five": 1.0}), 400, "logit_bias"),
    ("logit-bias-negative-token", _cmpl(logit_bias={"-3": 1.0}), 400, "logit_bias"),
    ("logit-bias-out-of-vocab", _cmpl(logit_bias={"100000": 1.0}), 400, "logit_bias"),
    ("logit-bias-value-string", _cmpl(logit_bias={"5": "a"}), 400, "logit_bias"),
    ("chat-logit-bias-value-too-big", _chat(logit_bias={"5": -100.5}), 400, "logit_bias"),
    ("stream-options-wrong-type", _cmpl(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options"),
    ("unknown-model", _cmpl(model="gpt-17"), 404, "model"),
    ("unknown-model-chat", _chat(model="gpt-17"), 404, "model"),
    ("empty-prompt", _cmpl(prompt=""), 400, "prompt"),
    ("empty-prompt-list", _cmpl(prompt=[]), 400, "prompt"),
    ("empty-token-list-in-batch", _cmpl(prompt=[[]]), 400, "prompt"),
    ("token-out-of-vocab", _cmpl(prompt=[5, 100000]), 400, "prompt"),
    ("negative-token", _cmpl(prompt=[5, -1]), 400, "prompt"),
    ("max-tokens-negative", _cmpl(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-zero", _cmpl(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-absurd", _cmpl(max_tokens=10**12), 400, "max_tokens"),
    ("max-tokens-huge-int", _cmpl(max_tokens=10**40), 400, "max_tokens"),
    ("prompt-longer-than-context", _cmpl(prompt=list(range(1, 101))), 400, "prompt"),
    ("prompt-fills-context", _cmpl(prompt=list(range(1, MAX_MODEL_LEN + 1))), 400, "prompt"),
    ("chat-longer-than-context", _chat(messages=[{"role": "user", "content": "word " * 200}]), 400, "messages"),
    ("temperature-negative", _cmpl(temperature=-0.5), 400, "temperature"),
    ("top-p-zero", _cmpl(top_p=0), 400, "top_p"),
    ("top-p-above-one", _cmpl(top_p=1.5), 400, "top_p"),
    ("top-k-below-minus-one", _cmpl(top_k=-2), 400, "top_k"),
    ("min-p-above-one", _cmpl(min_p=2.0), 400, "min_p"),
    ("min-tokens-negative", _cmpl(min_tokens=-1), 400, "min_tokens"),
    ("min-tokens-above-max", _cmpl(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("logprobs-negative", _cmpl(logprobs=-1), 400, "logprobs"),
    ("logprobs-too-many", _cmpl(logprobs=21), 400, "logprobs"),
    ("max-tokens-zero-without-echo", _cmpl(max_tokens=0), 400, "max_tokens"),
    ("n-zero", _cmpl(n=0), 400, "n"),
    ("n-too-many", _cmpl(n=65), 400, "n"),
    ("n-string", _cmpl(n="2"), 400, "n"),
    ("chat-n-zero", _chat(n=0), 400, "n"),
    ("n-times-prompts-too-many", _cmpl(prompt=["a"] * 100, n=20), 400, "n"),
    ("best-of-below-n", _cmpl(n=3, best_of=2), 400, "best_of"),
    ("best-of-zero", _cmpl(best_of=0), 400, "best_of"),
    ("best-of-streamed", _cmpl(best_of=2, stream=True), 400, "best_of"),
    ("suffix", _cmpl(suffix="end"), 400, "suffix"),
    ("presence-penalty-too-big", _cmpl(presence_penalty=2.5), 400, "presence_penalty"),
    ("frequency-penalty-too-small", _cmpl(frequency_penalty=-3), 400, "frequency_penalty"),
    ("frequency-penalty-string", _chat(frequency_penalty="x"), 400, "frequency_penalty"),
    ("repetition-penalty-zero", _cmpl(repetition_penalty=0), 400, "repetition_penalty"),
    ("repetition-penalty-negative", _chat(repetition_penalty=-1.0), 400, "repetition_penalty"),
    ("allowed-token-ids-empty", _cmpl(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("allowed-token-ids-negative", _cmpl(allowed_token_ids=[-1]), 400, "allowed_token_ids"),
    ("allowed-token-ids-out-of-vocab", _cmpl(allowed_token_ids=[100000]), 400, "allowed_token_ids"),
    ("bad-words-empty-string", _cmpl(bad_words=[""]), 400, "bad_words"),
    ("bad-words-not-a-list", _cmpl(bad_words="x"), 400, "bad_words"),
    ("prompt-logprobs-streamed", _cmpl(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("stream-options-without-stream", _cmpl(stream_options={"include_usage": True}), 400, "stream_options"),
    ("chat-stream-options-without-stream", _chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("prompt-logprobs-too-many", _cmpl(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("prompt-logprobs-below-minus-one", _cmpl(prompt_logprobs=-2), 400, "prompt_logprobs"),
    ("prompt-logprobs-whole-vocabulary-over-max-logprobs", _cmpl(prompt_logprobs=-1), 400, "prompt_logprobs"),
    ("echo-logprobs-too-many", _cmpl(echo=True, logprobs=21, max_tokens=0), 400, "logprobs"),
    ("seed-string", _cmpl(seed="x"), 400, "seed"),
    ("stop-token-ids-negative", _cmpl(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop-token-ids-wrong-type", _cmpl(stop_token_ids=["a"]), 400, "stop_token_ids"),
    ("empty-messages", _chat(messages=[]), 400, "messages"),
    ("messages-not-a-list", _chat(messages="hi"), 400, "messages"),
    ("message-without-role", _chat(messages=[{"content": "hi"}]), 400, "messages"),
    ("message-bad-role", _chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    ("message-content-int", _chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("text-part-without-text", _chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
     "messages[0].content"),
    ("image-part", _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages[0].content"),
    ("chat-max-completion-tokens-negative", _chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    ("chat-max-tokens-absurd", _chat(max_tokens=10**9), 400, "max_tokens"),
    ("chat-logprobs-int", _chat(logprobs=3), 400, "logprobs"),
    ("chat-top-logprobs-too-many", _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("chat-top-logprobs-below-minus-one", _chat(logprobs=True, top_logprobs=-2), 400, "top_logprobs"),
    ("chat-top-logprobs-whole-vocabulary-over-max-logprobs", _chat(logprobs=True, top_logprobs=-1), 400,
     "top_logprobs"),
    ("chat-top-logprobs-minus-one-without-logprobs", _chat(top_logprobs=-1), 400, "top_logprobs"),
    ("chat-top-logprobs-without-logprobs", _chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-template-kwargs-wrong-type", _chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("chat-template-kwargs-reserved", _chat(chat_template_kwargs={"tokenize": False}), 400, "chat_template_kwargs"),
    ("chat-template-untrusted", _chat(chat_template="{{ messages }}"), 400, "chat_template"),
    ("chat-beam-search", _chat(use_beam_search=True), 400, "use_beam_search"),
    ("completions-beam-search", _cmpl(use_beam_search=True), 400, "use_beam_search"),
    ("response-format-json-schema-without-schema", _chat(response_format={"type": "json_schema"}), 400,
     "response_format"),
    ("response-format-unknown-type", _chat(response_format={"type": "yaml"}), 400, "response_format"),
    ("response-format-schema-not-an-object", _cmpl(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": "not a schema"}}), 400, "response_format"),
    ("response-format-bad-schema", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), 400, "response_format"),
    ("structured-outputs-two-kinds", _cmpl(structured_outputs={"regex": "a", "choice": ["b"]}), 400,
     "structured_outputs"),
    ("structured-outputs-none", _cmpl(structured_outputs={}), 400, "structured_outputs"),
    ("structured-outputs-unknown-key", _cmpl(structured_outputs={"yaml": "x"}), 400, "structured_outputs"),
    ("structured-outputs-bad-regex", _cmpl(structured_outputs={"regex": "(unclosed"}), 400, "structured_outputs"),
    ("structured-outputs-not-an-object", _cmpl(structured_outputs="json"), 400, "structured_outputs"),
    ("structured-outputs-choice-empty-string", _chat(structured_outputs={"choice": [""]}), 400, "structured_outputs"),
    ("guided-json-invalid-json-text", _cmpl(guided_json="{oops"), 400, "guided_json"),
    ("guided-choice-empty", _cmpl(guided_choice=[]), 400, "guided_choice"),
    ("guided-grammar-bad", _cmpl(guided_grammar="root ::= ("), 400, "guided_grammar"),
    ("two-output-constraints", _chat(response_format={"type": "json_object"}, guided_regex="a+"), 400,
     "guided_regex"),
    ("tool-choice-required", _chat(tool_choice="required"), 400, "tool_choice"),
    # tools and tool_choice (this server has no --tool-call-parser)
    ("tools-not-a-list", _chat(tools="get_weather", tool_choice="none"), 400, "tools"),
    ("tool-not-an-object", _chat(tools=[5], tool_choice="none"), 400, "tools"),
    ("tool-bad-type", _chat(tools=[{"type": "retrieval"}], tool_choice="none"), 400, "tools"),
    ("tool-without-function", _chat(tools=[{"type": "function"}], tool_choice="none"), 400, "tools"),
    ("tool-without-name", _chat(tools=[{"type": "function", "function": {"description": "x"}}], tool_choice="none"),
     400, "tools"),
    ("tool-name-not-string", _chat(tools=[{"type": "function", "function": {"name": 5}}], tool_choice="none"), 400,
     "tools"),
    ("tool-parameters-not-object", _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}],
                                         tool_choice="none"), 400, "tools"),
    ("tools-auto-without-parser", _chat(tools=[TOOL]), 400, "tool_choice"),
    ("tool-choice-auto-without-parser", _chat(tools=[TOOL], tool_choice="auto"), 400, "tool_choice"),
    ("tool-choice-required-without-tools", _chat(tool_choice="required"), 400, "tool_choice"),
    ("tool-choice-unknown-string", _chat(tools=[TOOL], tool_choice="sometimes"), 400, "tool_choice"),
    ("tool-choice-int", _chat(tools=[TOOL], tool_choice=5), 400, "tool_choice"),
    ("tool-choice-named-unknown", _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
     400, "tool_choice"),
    ("tool-choice-named-malformed", _chat(tools=[TOOL], tool_choice={"type": "function"}), 400, "tool_choice"),
    ("tool-choice-named-without-tools", _chat(tool_choice={"type": "function", "function": {"name": "f"}}), 400,
     "tool_choice"),
    ("tool-calls-not-a-list", _chat(messages=MSG + [{"role": "assistant", "tool_calls": "x"}]), 400, "messages"),
    ("tool-call-without-name", _chat(messages=MSG + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]),
     400, "messages[1].tool_calls"),
    ("tool-call-arguments-not-json", _chat(messages=MSG + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{not json"}}]}]),
     400, "messages[1].tool_calls"),
    ("tool-call-arguments-not-object", _chat(messages=MSG + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",
                                                                                   "arguments": "[1]"}}]}]),
     400, "messages[1].tool_calls"),
    ("tool-calls-on-user-message", _chat(messages=[{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400,
     "messages[0].tool_calls"),
    ("tool-call-id-not-string", _chat(messages=MSG + [{"role": "tool", "content": "r", "tool_call_id": 5}]), 400,
     "messages"),
    ("parallel-tool-calls-string", _chat(tools=[TOOL], tool_choice="none", parallel_tool_calls="no"), 400,
     "parallel_tool_calls"),
    ("structural-tag-not-an-object", _chat(structured_outputs={"structural_tag": "[1]"}), 400, "structured_outputs"),
    ("structural-tag-bad-format", _chat(structured_outputs={"structural_tag": {"type": "structural_tag", "format": {
        "type": "no-such-format"}}}), 400, "structured_outputs"),
    # vLLM's tokenizer routes
    ("tokenize-neither-prompt-nor-messages", ("/tokenize", {}), 400, "prompt"),
    ("tokenize-prompt-and-messages", ("/tokenize", {"prompt": "x", "messages": MSG}), 400, "messages"),
    ("tokenize-prompt-wrong-type", ("/tokenize", {"prompt": 5}), 400, "prompt"),
    ("tokenize-prompt-token-ids", ("/tokenize", {"prompt": [1, 2]}), 400, "prompt"),
    ("tokenize-empty-messages", ("/tokenize", {"messages": []}), 400, "messages"),
    ("tokenize-message-bad-role", ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}), 400, "messages"),
    ("tokenize-add-special-tokens-string", ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}), 400,
     "add_special_tokens"),
    ("tokenize-continue-with-generation-prompt", ("/tokenize", {"messages": MSG, "continue_final_message": True}),
     400, "continue_final_message"),
    ("tokenize-reserved-template-kwargs", ("/tokenize", {"messages": MSG, "chat_template_kwargs": {"tokenize": 1}}),
     400, "chat_template_kwargs"),
    ("tokenize-untrusted-template", ("/tokenize", {"messages": MSG, "chat_template": "{{ messages }}"}),
     400, "chat_template"),
    ("tokenize-unknown-model", ("/tokenize", {"prompt": "x", "model": "gpt-17"}), 404, "model"),
    ("detokenize-missing-tokens", ("/detokenize", {}), 400, "tokens"),
    ("detokenize-tokens-not-a-list", ("/detokenize", {"tokens": "abc"}), 400, "tokens"),
    ("detokenize-string-token", ("/detokenize", {"tokens": ["1"]}), 400, "tokens"),
    ("detokenize-negative-token", ("/detokenize", {"tokens": [5, -1]}), 400, "tokens"),
    ("detokenize-token-out-of-vocab", ("/detokenize", {"tokens": [5, 100000]}), 400, "tokens"),
    ("detokenize-huge-token", ("/detokenize", {"tokens": [10**30]}), 400, "tokens"),
    ("detokenize-unknown-model", ("/detokenize", {"tokens": [1], "model": "gpt-17"}), 404, "model"),
    # routes lamina does not serve: a 404 that says why
    ("responses-not-served", ("/v1/responses", {"model": MODEL_NAME, "input": "hi"}), 404, None),
    ("embeddings-not-served", ("/v1/embeddings", {"model": MODEL_NAME, "input": "hi"}), 404, None),
]


# Against a server with --tool-call-parser hermes: tool_choice 'required' / named is enforced with
# structured output, so it takes no other output constraint.
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TOOL_CHOICE_CASES = [
    ("required-with-response-format-json-object", _chat(tools=[TOOL], tool_choice="required",
                                                        response_format={"type": "json_object"}), 400,
     "response_format"),
    ("required-with-response-format-json-schema", _chat(tools=[TOOL], tool_choice="required", response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}), 400, "response_format"),
    ("named-with-response-format", _chat(tools=[TOOL], tool_choice=NAMED, response_format={"type": "json_object"}),
     400, "response_format"),
    ("named-with-structured-outputs", _chat(tools=[TOOL], tool_choice=NAMED, structured_outputs={"regex": "a+"}), 400,
     "structured_outputs"),
    ("required-with-guided-regex", _chat(tools=[TOOL], tool_choice="required", guided_regex="a+"), 400, "guided_regex"),
    ("named-with-guided-json", _chat(tools=[TOOL], tool_choice=NAMED, guided_json={"type": "object"}), 400,
     "guided_json"),
    ("required-tool-schema-not-compilable", _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "no-such-type"}}}], tool_choice="required"), 400, "tools"),
]


@pytest.fixture(scope="module")
def tool_http(qwen3_next_dir):
    from lamina.entrypoints.openai.chat_tools import ChatOptions

    with LLM(str(qwen3_next_dir), device="cpu", max_model_len=MAX_MODEL_LEN, show_progress=False) as llm, \
            RunningServer(llm.engine, chat=ChatOptions(tool_call_parser="hermes")) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("request_, status, param", [c[1:] for c in TOOL_CHOICE_CASES],
                         ids=[c[0] for c in TOOL_CHOICE_CASES])
def test_enforced_tool_choice_bad_input(tool_http, request_, status, param):
    test_bad_input_is_a_4xx_naming_the_problem(tool_http, request_, status, param)


def test_tool_server_healthy_after_bad_input(tool_http):
    r = tool_http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, "tools": [TOOL],
                                                     "tool_choice": "required", "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


@pytest.mark.parametrize("request_, status, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_naming_the_problem(http, request_, status, param):
    path, body = request_
    if isinstance(body, str):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def test_negative_token_id_message_names_the_id(http):
    """A negative id in a token-id prompt: one message naming the id, where it is and the valid range
    (not pydantic's union-member tags such as 'prompt.constrained-str')."""
    for prompt, token, where in (([5, -1], -1, "prompt[1]"), ([[1, 2], [3, -4]], -4, "prompt[1][1]")):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt"
        message = error["message"]
        assert f"token id {token} at {where}" in message and "[0, vocab_size)" in message, message
        assert "constrained" not in message and "more problem" not in message, message


def test_other_http_errors_are_openai_shaped(http):
    for method, path, status in (("GET", "/v1/nothing", 404), ("DELETE", "/v1/completions", 405),
                                 ("GET", "/v1/models/unknown", 404)):
        r = http.request(method, path)
        assert r.status_code == status and "message" in r.json()["error"]
    r = http.post("/v1/completions", content=b"prompt=x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and "error" in r.json()


def test_oversized_body_is_413(http):
    r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_server_healthy_after_bad_input(http):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3.0,
                                           "unknown_field": {"any": ["thing"]}})  # 3.0 is an integer in JSON
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user"}], "max_tokens": 2})
    assert r.status_code == 200  # a missing content is an empty one
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, "tools": [TOOL],
                                                "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []
    history = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2, "tools": [TOOL],
                                                "tool_choice": "none"})
    assert r.status_code == 200, r.text


def test_schemathesis_fuzz_finds_no_5xx(server, http):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
    failures: list[str] = []
    seen = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode, examples in ((GenerationMode.POSITIVE, 15), (GenerationMode.NEGATIVE, 15)):

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                nonlocal seen
                seen += 1
                response = case.call(base_url=server.url, timeout=30)
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.path} {response.status_code}: "
                                    f"{json.dumps(case.body, default=str)[:300]} -> {response.text[:300]}")

            try:
                fuzz()
            except Unsatisfiable:  # nothing negative to generate (no parameters, no body)
                pass
    assert seen > 100
    assert not failures, "\n".join(failures[:5])
    assert http.get("/health").status_code == 200
    assert server.async_engine.is_healthy

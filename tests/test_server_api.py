"""`lamina serve` through the official `openai` client: completions and chat, streaming and not, usage,
logprobs, vLLM's extra sampling fields, metrics, auth."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lamina import LLM, SamplingParams
from lamina.entrypoints.openai.token_text import logprob_token_text
from tests.server_harness import MODEL_NAME, RunningServer

# The copied tokenizer's ChatML template, plus Qwen3's switch: enable_thinking=False closes an empty think block.
THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
PROMPT = "The baker opened the shutters"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def ckpt(qwen3_next_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("q3next_think") / "ckpt"
    shutil.copytree(qwen3_next_dir, dst)
    (dst / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return dst


def _llm(path, **kw):
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=256, show_progress=False, **kw)


@pytest.fixture(scope="module")
def ref(ckpt):
    with _llm(ckpt) as llm:  # offline reference: its own engine, same weights
        yield llm


@pytest.fixture(scope="module")
def server(ckpt):
    # Scheduled asynchronously, as `lamina serve` is on one GPU by default (the other server tests
    # run the CPU default, synchronous): every answer here must equal the synchronous offline one.
    with _llm(ckpt, async_scheduling=True) as llm, RunningServer(llm.engine) as srv:
        assert llm.engine.async_scheduling
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _stream_text(chunks, chat=False):
    text, finish, usage = "", None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_models_version_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert httpx.get(f"{server.url}/health").status_code == 200
    import lamina

    assert httpx.get(f"{server.url}/version").json() == {"version": lamina.__version__}


def test_completion_matches_offline_and_streaming(client, ref):
    expected = ref.generate(PROMPT, _greedy(ignore_eos=True), use_tqdm=False)[0]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert out.choices[0].text == expected.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finish, usage = _stream_text(stream)
    assert text == out.choices[0].text and finish == "length"
    assert usage.model_dump() == out.usage.model_dump()


def test_chat_matches_offline_and_streaming(client, ref):
    expected = ref.chat(MESSAGES, _greedy(ignore_eos=True), use_tqdm=False)[0]
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant" and message.content == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids) and out.usage.completion_tokens == 12
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text, finish, usage = _stream_text(chunks, chat=True)
    assert text == message.content and finish == "length"
    assert usage.model_dump() == out.usage.model_dump()


def test_prompt_logprobs_field_as_vllm_answers(client, ref):
    """vLLM's `prompt_logprobs`: per prompt token None (the first), then {token id: {logprob, rank,
    decoded_token}} with the prompt's token (its true rank, from the engine) and the k likeliest;
    on each completions choice, at the top of a chat answer. Values equal the offline API's."""
    expected = ref.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, n=2,
                                    extra_body={"prompt_logprobs": 2})
    for choice in out.choices:
        field = choice.model_extra["prompt_logprobs"]
        assert len(field) == len(expected.prompt_token_ids) and field[0] is None
        for token, entry, want, rank in zip(expected.prompt_token_ids[1:], field[1:], expected.prompt_logprobs[1:],
                                            expected.prompt_logprob_ranks[1:]):
            assert list(entry)[0] == str(token) and entry[str(token)]["rank"] == rank
            assert {int(t) for t in entry} == set(want) and len(entry) in (2, 3)
            for t, item in entry.items():
                assert item["logprob"] == pytest.approx(want[int(t)], abs=1e-5) and item["decoded_token"]
            ranked = sorted(entry.values(), key=lambda item: -item["logprob"])
            assert ranked[0]["rank"] == 1 and [i["rank"] for i in ranked] == sorted(i["rank"] for i in ranked)
    assert any(r > 2 for r in expected.prompt_logprob_ranks[1:])  # some prompt token lies outside the top 2
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    field = chat.model_extra["prompt_logprobs"]
    assert len(field) == chat.usage.prompt_tokens and field[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in field[1:])


def test_chat_echo_starts_with_the_final_assistant_message(client):
    """vLLM's chat `echo`: with a final assistant message (continued here), the answer's content
    starts with that message's content, streamed (its own delta after the role) and not."""
    messages = MESSAGES + [{"role": "assistant", "content": "The answer is"}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**kwargs, extra_body={**extra, "echo": False}).choices[0].message.content
    echoed = client.chat.completions.create(**kwargs, extra_body=extra).choices[0].message.content
    assert echoed == "The answer is" + plain
    chunks = list(client.chat.completions.create(**kwargs, stream=True, extra_body=extra))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    # the last message is the user's: nothing to echo
    user_last = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                               extra_body={"echo": True, "ignore_eos": True}).choices[0].message.content
    assert user_last == client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                                       extra_body={"ignore_eos": True}).choices[0].message.content


def test_max_completion_tokens_wins_over_max_tokens(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, max_completion_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3  # as in vLLM: OpenAI's current name wins


def test_completions_null_max_tokens_is_the_default_16(client):
    """An explicit null is OpenAI's and vLLM's default of 16, not a generation to the end of the context."""
    for body in ({"max_tokens": None}, {}):
        r = client.post("/completions", cast_to=dict, body={"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0,
                                                             "ignore_eos": True, **body})
        assert r["usage"]["completion_tokens"] == 16, body


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats(client, endpoint):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries its own
    choice's usage so far (with n = 2: the prompt's tokens and that choice's tokens, not the sum over
    the choices), then the usage chunk with no choices closes the stream with the totals."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = dict(model=MODEL_NAME, max_tokens=6, temperature=0, n=2, stream=True, stream_options=options,
                  extra_body={"ignore_eos": True})
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(messages=MESSAGES, **kwargs))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **kwargs))
    *with_choices, last = chunks
    assert not last.choices and last.usage.completion_tokens == 12
    assert all(len(c.choices) == 1 and c.usage is not None for c in with_choices)
    for index in (0, 1):
        counts = [c.usage.completion_tokens for c in with_choices if c.choices[0].index == index]
        assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6, (index, counts)
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_continuous_usage_stats_per_prompt(client):
    """Several prompts: a chunk's prompt_tokens are its own prompt's (vLLM's), the last chunk's the sum."""
    prompts = [[5, 17, 230, 44], [9, 8]]
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=3, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    *with_choices, last = chunks
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (6, 12)
    for chunk in with_choices:
        [choice] = chunk.choices
        assert chunk.usage.prompt_tokens == len(prompts[choice.index // 2]), chunk
        assert 1 <= chunk.usage.completion_tokens <= 3
    finals = {c.choices[0].index: c.usage.completion_tokens for c in with_choices}
    assert finals == {0: 3, 1: 3, 2: 3, 3: 3}


def test_chat_template_kwargs_reach_the_template(client, ref):
    tok = ref.get_tokenizer()
    plain = len(tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)["input_ids"])
    closed = len(tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                         enable_thinking=False)["input_ids"])
    assert closed > plain
    for kwargs, expected in (({}, plain), ({"enable_thinking": False}, closed), ({"enable_thinking": True}, plain)):
        out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                             extra_body={"chat_template_kwargs": kwargs})
        assert out.usage.prompt_tokens == expected


def test_stop_strings_streamed_equals_unstreamed(client, ref):
    base = ref.generate(PROMPT, _greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = base[5:8]
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert out.choices[0].text == base[: base.index(stop)] and out.choices[0].finish_reason == "stop"
    text, finish, _ = _stream_text(client.completions.create(stream=True, **kwargs))
    assert text == out.choices[0].text and finish == "stop"


def test_vllm_extras(client, ref):
    base = ref.generate(PROMPT, _greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[3]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})
    assert out.usage.completion_tokens == base.token_ids.index(stop_id) + 1
    assert out.choices[0].finish_reason == "stop"
    params = dict(top_k=20, min_p=0.01, min_tokens=5, ignore_eos=False)
    sampled = [client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=7,
                                         top_p=0.9, extra_body=params).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    offline = ref.generate(PROMPT, SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, **params),
                           use_tqdm=False)[0].outputs[0].text
    assert sampled[0] == offline


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(isinstance(t, str) and t for t in lp.tokens)  # special tokens show as their text
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and token_lp <= 0
        assert token_lp == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_completion_top_logprobs_hold_the_sampled_token(client):
    """OpenAI's legacy completions and vLLM: each position's top_logprobs holds its own token (first)
    and the `logprobs` likeliest, so up to logprobs + 1 entries; `logprobs: 0` gives the token alone.
    Sampled at temperature 1 (a random model), the token is often not the likeliest; echoed prompt
    positions hold the prompt's token the same way."""
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                       echo=True, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert greedy.top_logprobs[0] is None  # the first prompt token has none
    for token, token_lp, top in zip(greedy.tokens[1:], greedy.token_logprobs[1:], greedy.top_logprobs[1:]):
        assert top == {token: pytest.approx(token_lp)}
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3, logprobs=1,
                  extra_body={"ignore_eos": True})
    lp = client.completions.create(**kwargs).choices[0].logprobs
    outside = 0
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and next(iter(top)) == token and top[token] == pytest.approx(token_lp)
        assert max(top.values()) >= token_lp
        outside += len(top) == 2
    assert outside > 0  # some sampled tokens lie outside the top 1: two entries there
    streamed = [t for chunk in client.completions.create(stream=True, **kwargs) for c in chunk.choices
                if c.logprobs for t in c.logprobs.top_logprobs]
    assert [list(top) for top in streamed] == [list(top) for top in lp.top_logprobs]


def test_completions_echo_logprobs_streamed_as_whole(client):
    """Streamed echo with logprobs: the prompt's entries come first and the generated tokens'
    text offsets count on from the prompt's end, as in the whole answer."""
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    pieces = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(p.text for p in pieces) == whole.text
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert [x for p in pieces if p.logprobs for x in getattr(p.logprobs, field)] == getattr(whole.logprobs, field)
    offsets = whole.logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**kwargs)
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) for entry in content)
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kwargs) for c in chunk.choices
                if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])


def test_batch_prompts_and_echo(client, ref):
    prompts = ["One", "Two words", "Three little words"]
    expected = ref.generate(prompts, _greedy(6, ignore_eos=True), use_tqdm=False)
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [e.outputs[0].text for e in expected]
    assert out.usage.completion_tokens == 18
    assert out.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    streamed = {}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in out.choices]
    echoed = client.completions.create(model=MODEL_NAME, prompt="One", max_tokens=6, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "One" + out.choices[0].text
    ids = [[5, 17, 230, 44], [9, 8]]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    expected = ref.generate([{"prompt_token_ids": p} for p in ids], _greedy(6, ignore_eos=True), use_tqdm=False)
    assert [c.text for c in by_ids.choices] == [e.outputs[0].text for e in expected]
    assert by_ids.usage.prompt_tokens == 6


def _metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def test_metrics_parse_and_move(server, client):
    before = _metrics(server)
    for name in ("lamina_num_requests_waiting", "lamina_num_requests_running", "lamina_kv_cache_usage_ratio",
                 "lamina_time_to_first_token_seconds_count", "lamina_time_per_output_token_seconds_count",
                 "lamina_spec_decode_accepted_tokens_total", "lamina_engine_healthy"):
        assert name in before, name
    assert before["lamina_spec_decode_accepted_tokens_total"] == 0
    assert before["lamina_engine_healthy"] == 1
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, stream=True,
                                        extra_body={"ignore_eos": True}))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=-1)
    after = _metrics(server)
    ok = 'lamina_requests_total{endpoint=%s,outcome=success}'
    assert after[ok % "completions"] == before[ok % "completions"] + 1
    assert after[ok % "chat"] == before[ok % "chat"] + 1
    bad = 'lamina_requests_total{endpoint=completions,outcome=bad_request}'
    assert after[bad] == before[bad] + 1
    assert after["lamina_generation_tokens_total"] == before["lamina_generation_tokens_total"] + 7
    assert after["lamina_time_to_first_token_seconds_count"] == before["lamina_time_to_first_token_seconds_count"] + 2
    assert after["lamina_time_per_output_token_seconds_count"] == \
        before["lamina_time_per_output_token_seconds_count"] + 2
    assert after["lamina_kv_cache_usage_ratio"] == 0 and after["lamina_num_requests_running"] == 0


def _ids(names):
    assert all(n.startswith("token_id:") for n in names), names
    return [int(n.split(":", 1)[1]) for n in names]


def test_return_tokens_as_token_ids(client, ref):
    """vLLM's `return_tokens_as_token_ids`: logprobs name each token `token_id:N`, the ids the model
    generated (and, under echo, the prompt's), with the same logprobs; text offsets still count text,
    and chat's `bytes` stay the token's own."""
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].logprobs
    kwargs["extra_body"] = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    named = client.completions.create(**kwargs).choices[0].logprobs
    expected = ref.generate([PROMPT], _greedy(max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids
    assert _ids(named.tokens) == list(expected)
    assert named.token_logprobs == pytest.approx(plain.token_logprobs)
    assert named.text_offset == plain.text_offset
    for top_named, top_plain in zip(named.top_logprobs, plain.top_logprobs):
        _ids(top_named)
        assert sorted(top_named.values()) == pytest.approx(sorted(top_plain.values()))
    streamed = [t for chunk in client.completions.create(stream=True, **kwargs) for c in chunk.choices
                if c.logprobs for t in c.logprobs.tokens]
    assert streamed == named.tokens
    echoed = client.completions.create(**dict(kwargs, echo=True, max_tokens=1)).choices[0].logprobs
    assert _ids(echoed.tokens)[:-1] == ref.get_tokenizer().encode(PROMPT)

    chat = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**chat, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    named = client.chat.completions.create(
        **chat, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0].logprobs.content
    tokenizer = ref.get_tokenizer()
    for e_named, e_plain, token_id in zip(named, plain, _ids([e.token for e in named])):
        assert logprob_token_text(tokenizer, token_id) == e_plain.token and e_named.bytes == e_plain.bytes
        assert e_named.logprob == pytest.approx(e_plain.logprob)
        _ids([t.token for t in e_named.top_logprobs])


def test_return_tokens_as_token_ids_server_flag(ckpt):
    """`--return-tokens-as-token-ids` makes it every request's default; a request's `false` wins."""
    with _llm(ckpt) as llm, RunningServer(llm.engine, return_tokens_as_token_ids=True) as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1)
            _ids(c.completions.create(**kwargs).choices[0].logprobs.tokens)
            off = c.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": False})
            assert not any(t.startswith("token_id:") for t in off.choices[0].logprobs.tokens)


def test_auth(ckpt):
    with _llm(ckpt) as llm, RunningServer(llm.engine, api_key=("s3cret", "other")) as srv:  # any of them
        assert httpx.get(f"{srv.url}/health").status_code == 200  # stays open
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.get(f"{srv.base_url}/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.post(f"{srv.base_url}/completions", headers=headers, json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 401
        with openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=srv.base_url, api_key="s3cret", max_retries=0) as good:
            assert good.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(f"{srv.base_url}/models", headers={"Authorization": "Bearer other"}).status_code == 200


def test_api_keys_from_the_flag_or_the_environment(monkeypatch):
    from argparse import Namespace

    from lamina.entrypoints.openai.cli_serve import api_keys

    monkeypatch.delenv("LAMINA_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys(Namespace(api_key=None)) == ()  # open
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")  # a vLLM deployment's secret keeps guarding the server
    assert api_keys(Namespace(api_key=None)) == ("from-vllm",)
    monkeypatch.setenv("LAMINA_API_KEY", "from-lamina")
    assert api_keys(Namespace(api_key=None)) == ("from-lamina",)
    assert api_keys(Namespace(api_key=["a", "b"])) == ("a", "b")  # the flag wins, several keys as vLLM's


def test_request_chat_template_with_the_trust_flag(ckpt):
    """`--trust-request-chat-template`: a chat request's (and /tokenize's) own chat_template renders the
    prompt, as in vLLM; without the flag it is a 400 (tests/test_server_bad_input.py)."""
    from lamina.entrypoints.openai.chat_tools import ChatOptions

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    with _llm(ckpt) as llm, RunningServer(llm.engine, chat=ChatOptions(trust_request_chat_template=True)) as srv:
        rendered = "[system] Be brief.[user] Tell me about the river."
        want = llm.get_tokenizer().encode(rendered, add_special_tokens=False)
        r = httpx.post(f"{srv.url}/tokenize", json={"messages": MESSAGES, "chat_template": template})
        assert r.status_code == 200 and r.json()["tokens"] == want, r.text
        with openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0) as client:
            out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1, temperature=0,
                                                 extra_body={"chat_template": template})
            assert out.usage.prompt_tokens == len(want)
            plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1, temperature=0)
            assert plain.usage.prompt_tokens != len(want)  # without it, the checkpoint's template

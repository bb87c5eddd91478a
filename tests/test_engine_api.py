"""The offline API and engine behaviour: stopping, sampling, logprobs, chat, bad input, CLI."""

from __future__ import annotations

import json

import pytest

from lamina import LLM, SamplingParams
from lamina.entrypoints.cli import main as cli_main

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=256, show_progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def default_llm():
    with LLM(device="cpu", show_progress=False) as llm:  # the built-in default model, with its tokenizer
        yield llm


PROMPT = {"prompt_token_ids": [5, 17, 230, 44, 9, 301]}


def test_stop_token_ids(llm):
    base = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = base[4]
    first = base.index(stop_at)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == base[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at


def test_eos_stops_unless_ignored(llm):
    base = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    engine.eos_token_ids = (base[2],)
    try:
        for state_params, expect_len in ((SamplingParams(temperature=0.0, max_tokens=12), 3), (GREEDY, 12)):
            engine.add_request(PROMPT, state_params, request_id=f"eos-{expect_len}")
            outs = []
            while engine.has_unfinished_requests():
                outs += [o for o in engine.step() if o.finished]
            assert len(outs[0].outputs[0].token_ids) == expect_len
            # an EOS id other than the tokenizer's reports its id, as vLLM (which makes it a stop token id)
            assert outs[0].outputs[0].stop_reason == (base[2] if expect_len == 3 else None)
    finally:
        engine.eos_token_ids = llm.engine.eos_token_ids
    # min_tokens bans the stop token until reached
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[base[0]], min_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 3 and base[0] not in out.token_ids[:3]


def test_max_tokens_length_and_max_model_len(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    long_prompt = {"prompt_token_ids": list(range(1, 250))}
    out = llm.generate(long_prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 256 - 249 and out.outputs[0].finish_reason == "length"


def test_stop_string_truncates_text(default_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = default_llm.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    cut = base.text.index(stop)
    out = default_llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = default_llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == base.text[: cut + len(stop)]


SORT = [{"role": "user", "content": "Sort ascending: 12 46 74 7 64 27 4"}]


def test_a_stopping_tokens_text_is_left_out_unless_asked(default_llm):
    """vLLM: the token that ends a request (a stop_token_ids hit, or EOS) stays in token_ids but
    its text is left out of the output text unless include_stop_str_in_output."""
    tok = default_llm.get_tokenizer()
    chat = lambda **kw: default_llm.chat(SORT, SamplingParams(temperature=0.0, max_tokens=32, **kw), use_tqdm=False)[0].outputs[0]
    base = chat(skip_special_tokens=False)  # the trained demo model: "4 7 12 27 46 64 74" then EOS
    assert base.finish_reason == "stop" and base.token_ids[-1] == tok.eos_token_id and base.stop_reason is None
    assert len(base.token_ids) > 4 and "<|im_end|>" not in base.text
    assert base.text == tok.decode(base.token_ids[:-1], skip_special_tokens=False)
    kept = chat(skip_special_tokens=False, include_stop_str_in_output=True)
    assert kept.text == tok.decode(base.token_ids, skip_special_tokens=False) and kept.text.endswith("<|im_end|>")
    stop_at = base.token_ids[3]
    first = base.token_ids.index(stop_at)
    for include in (False, True):
        out = chat(stop_token_ids=[stop_at], include_stop_str_in_output=include)
        assert out.token_ids == base.token_ids[: first + 1] and out.stop_reason == stop_at
        assert out.text == tok.decode(base.token_ids[: first + 1 if include else first]), include


def test_stop_strings_wait_for_min_tokens(default_llm):
    """vLLM: with min_tokens = m, stop strings are looked for once more than m tokens are out, in
    the tail each new token completes: one wholly inside the first m tokens' text is never found."""
    tok = default_llm.get_tokenizer()
    chat = lambda **kw: default_llm.chat(SORT, SamplingParams(temperature=0.0, max_tokens=32, **kw), use_tqdm=False)[0].outputs[0]
    base = chat()
    assert base.text.count(" ") >= 3
    prefix = tok.decode(base.token_ids[:2])
    later = base.text.find(" ", len(prefix))
    assert " " in prefix or later >= 0
    plain = chat(stop=[" "])
    assert plain.text == base.text[: base.text.index(" ")] and plain.stop_reason == " "
    out = chat(stop=[" "], min_tokens=2)
    assert out.text == base.text[:later] and out.finish_reason == "stop"
    out = chat(stop=[" "], min_tokens=len(base.token_ids) - 1)
    assert out.text == base.text and out.finish_reason == "stop" and out.stop_reason is None  # EOS, no match


def test_text_is_incremental_detokenization(default_llm):
    tok = default_llm.get_tokenizer()
    out = default_llm.generate(["Hello there", "Once upon"], GREEDY, use_tqdm=False)
    for o in out:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [3, 4, 5, i]} for i in range(3)]
    mixed = llm.generate(others + [PROMPT], [SamplingParams(temperature=1.0, max_tokens=7)] * 3 + [params], use_tqdm=False)
    assert mixed[-1].outputs[0].token_ids == alone
    unseeded = {tuple(llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
                                   use_tqdm=False)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(unseeded) > 1


def test_logprobs(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and len(entry) == 3
        assert entry[token] == max(entry.values())  # greedy: the sampled token is the most likely
    assert completion.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(completion.token_ids, completion.logprobs)))


def test_logprobs_are_vllm_logprob_objects(default_llm):
    """Each value is a vLLM-style Logprob (.logprob, .rank, .decoded_token) and still the float; the
    sampled token's rank counts the likelier tokens, also when it is outside the top k."""
    from lamina.outputs import Logprob

    tok = default_llm.get_tokenizer()
    params = SamplingParams(temperature=5.0, seed=3, max_tokens=12, logprobs=1, prompt_logprobs=2, ignore_eos=True)
    out = default_llm.generate("Sort ascending: 3 1 2", params, use_tqdm=False)[0]
    ranks = []
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        value = entry[token]
        assert isinstance(value, Logprob) and value.logprob == float(value) and value.decoded_token == tok.decode([token])
        best_id, best = max(entry.items(), key=lambda item: float(item[1]))  # the top-1 entry
        assert best.rank == 1 and (best_id == token) == (value.rank == 1)
        ranks.append(value.rank)
    assert max(ranks) > 1  # at temperature 5 some sampled tokens are not the likeliest
    for token, entry, rank in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], out.prompt_logprob_ranks[1:]):
        assert entry[token].rank == rank and entry[token].decoded_token == tok.decode([token])
        by_value = sorted(entry.values(), key=float, reverse=True)  # the top 2, and the prompt token if not among them
        assert [v.rank for v in by_value] == ([1, 2] if len(entry) == 2 else [1, 2, rank]) and (len(entry) == 2) == (rank <= 2)


def test_truncate_prompt_tokens_and_detokenize(llm):
    """vLLM's truncate_prompt_tokens (the last k prompt tokens; -1: the last max_model_len) and
    detokenize=False (token ids, empty text)."""
    long_prompt = {"prompt_token_ids": list(range(1, 300))}  # longer than max_model_len = 256
    params = SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=6)
    out = llm.generate(long_prompt, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(294, 300)) and out.prompt is None
    tail = llm.generate({"prompt_token_ids": list(range(294, 300))}, SamplingParams(temperature=0.0, max_tokens=4),
                        use_tqdm=False)[0]
    assert out.outputs[0].token_ids == tail.outputs[0].token_ids and out.num_cached_tokens == 0
    text = llm.get_tokenizer().decode(list(range(1, 40)))  # a text prompt keeps its text, as vLLM's
    cut = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=2, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert cut.prompt == text and len(cut.prompt_token_ids) == 5
    engine = llm.engine  # the engine's own add_request keeps it too
    request_id = engine.add_request(text, SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=5))
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished and o.request_id == request_id]
    assert finals[0].prompt == text and len(finals[0].prompt_token_ids) == 5
    with pytest.raises(ValueError, match="no room"):  # -1 keeps max_model_len tokens: nothing left to generate
        llm.generate(long_prompt, SamplingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_detokenize_false(default_llm):
    out = default_llm.chat(SORT, SamplingParams(temperature=0.0, max_tokens=8, detokenize=False), use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) > 2
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def test_chat_applies_template(default_llm):
    messages = [{"role": "user", "content": "Hi"}]
    out = default_llm.chat(messages, GREEDY, use_tqdm=False)[0]
    expected = default_llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert default_llm.get_tokenizer().decode(out.prompt_token_ids) == expected
    with pytest.raises(ValueError, match="at least one message"):
        default_llm.chat([[]], GREEDY)
    # vLLM's positional order (messages, sampling_params, use_tqdm, lora_request, chat_template, ...)
    assert default_llm.chat(messages, GREEDY, False, None)[0].prompt_token_ids == out.prompt_token_ids
    with pytest.raises(ValueError, match="chat_template_content_format = 'openai'"):
        default_llm.chat(messages, GREEDY, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        default_llm.chat(messages, GREEDY, mm_processor_kwargs={"fps": 1})


ARGS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<call {{ call.function.name }}>"
    "{% for k, v in call.function.arguments|items %}{{ k }}={{ v }};{% endfor %}</call>{% endfor %}"
    "{% if not loop.last or not continue_final_message %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_takes_openai_format_messages(default_llm):
    """As vLLM's LLM.chat: text content parts joined, tool-call arguments sent as a JSON string read as
    an object by the template, continue_final_message, and the rendered prompt on the output."""
    tok = default_llm.get_tokenizer()
    plain = [{"role": "user", "content": "Sort ascending: 3 1 2"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Sort ascending:"}, {"type": "text", "text": "3 1 2"}]}]
    out = default_llm.chat(parts, GREEDY, use_tqdm=False)[0]
    expected = tok.apply_chat_template([{"role": "user", "content": "Sort ascending:\n3 1 2"}], tokenize=False,
                                       add_generation_prompt=True)
    assert out.prompt == expected and tok.decode(out.prompt_token_ids) == expected
    assert default_llm.chat(plain, GREEDY, use_tqdm=False)[0].prompt == tok.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    out = default_llm.chat(history, GREEDY, chat_template=ARGS_TEMPLATE, use_tqdm=False)[0]
    assert "<call get>city=Paris;</call>" in out.prompt and history[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    partial = plain + [{"role": "assistant", "content": "1 2"}]
    out = default_llm.chat(partial, GREEDY, chat_template=ARGS_TEMPLATE, add_generation_prompt=False,
                           continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt.endswith("<|im_start|>assistant\n1 2")
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        default_llm.chat(partial, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="final assistant message"):
        default_llm.chat(plain, GREEDY, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="not valid JSON"):
        bad = [dict(history[1], tool_calls=[{"function": {"name": "get", "arguments": "{oops"}}])]
        default_llm.chat(history[:1] + bad, GREEDY)
    with pytest.raises(ValueError, match="part type 'image_url'"):
        default_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": list(range(1, 300))}, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [5, 100000]}, SamplingParams(), "outside the vocabulary"),
        ({"nothing": 1}, SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_prompts_raise_and_engine_keeps_serving(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_one_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([PROMPT, {"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate([PROMPT], [GREEDY, GREEDY])


def test_outputs_taken_by_another_caller_raise(llm, monkeypatch):
    """Another caller stepping the same engine (a server's engine thread) takes the finished outputs:
    generate says so rather than hand back None in their place."""
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: [o for o in step() if not o.finished])
    with pytest.raises(RuntimeError, match="2 of 2 requests finished without their output"):
        llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_vllm_prompt_types_numpy_ids_and_refused_arguments(llm):
    """What a ported vLLM script passes: TokensPrompt / TextPrompt (importable from lamina), numpy token
    ids, `lora_request=None`, zero priorities, chat's positional use_tqdm; what lamina cannot honour
    (images, a LoRA adapter, priorities) is refused, never silently dropped."""
    import numpy as np

    from lamina import TokensPrompt

    base = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    ids = np.array(PROMPT["prompt_token_ids"])
    for prompt in (TokensPrompt(prompt_token_ids=ids), list(ids), {"prompt_token_ids": ids.tolist()}):
        [out] = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=None, priority=[0])
        assert out.outputs[0].token_ids == base and out.prompt_token_ids == PROMPT["prompt_token_ids"]
        assert all(type(t) is int for t in out.prompt_token_ids)
    with pytest.raises(ValueError, match="multi_modal_data: lamina serves the text model"):
        llm.generate({**PROMPT, "multi_modal_data": {"image": object()}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt token ids must be integers, got 1.5"):
        llm.generate({"prompt_token_ids": [5, 1.5]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate(PROMPT, GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="first come, first served"):
        llm.generate([PROMPT, PROMPT], GREEDY, priority=[0, 1])
    assert not llm.engine.has_unfinished_requests()


def test_engine_config_errors(qwen3_next_dir):
    with pytest.raises(ValueError, match="max_model_len = 100000 exceeds"):
        LLM(str(qwen3_next_dir), device="cpu", max_model_len=100000, show_progress=False)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(qwen3_next_dir), device="cpu", block_size=12, show_progress=False)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        LLM(str(qwen3_next_dir), device="cpu", num_gpu_blocks_override=2, show_progress=False)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(qwen3_next_dir), device="cpu", dtype="int3", show_progress=False)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False: lamina always splits"):
        LLM(str(qwen3_next_dir), device="cpu", enable_chunked_prefill=False, show_progress=False)
    with pytest.raises(ValueError, match="tokenizer_mode='mistral': .* Supported: auto"):
        LLM(str(qwen3_next_dir), device="cpu", tokenizer_mode="mistral", show_progress=False)
    # what vLLM scripts commonly pass, accepted
    with LLM(str(qwen3_next_dir), device="cpu", max_model_len=64, show_progress=False, trust_remote_code=True,
             enable_chunked_prefill=True, disable_log_stats=True, tokenizer_mode="auto") as llm:
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_abort_frees_cache(llm):
    engine = llm.engine
    engine.add_request(PROMPT, GREEDY, request_id="to-abort")
    engine.step()
    assert engine.cache.usage() > 0
    engine.abort_request("to-abort")
    assert engine.cache.usage() == 0 and not engine.has_unfinished_requests()


def test_shutdown_releases(qwen3_next_dir):
    llm = LLM(str(qwen3_next_dir), device="cpu", show_progress=False)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPT)


def test_cli_generate_json(capsys):
    assert cli_main(["generate", "--prompt", "Hello", "--max-tokens", "5", "--ignore-eos", "--json", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out.strip().splitlines()[-1])
    assert record["prompt"] == "Hello" and len(record["token_ids"]) == 5 and record["finish_reason"] == "length"


def test_cli_generate_takes_the_generation_config_and_every_chat_prompt(capsys, tmp_path):
    """Unset sampling flags come from --generation-config (else greedy, 32 tokens); a flag wins; --chat
    answers every --prompt, each its own conversation."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    base = ["generate", "--prompt", "Hello", "--ignore-eos", "--json", "--device", "cpu"]

    def token_counts(*flags):
        assert cli_main([*base, *flags]) == 0
        return [len(json.loads(line)["token_ids"]) for line in capsys.readouterr().out.strip().splitlines()]
    assert token_counts("--generation-config", str(tmp_path)) == [3]
    assert token_counts("--generation-config", str(tmp_path), "--max-tokens", "5") == [5]
    assert token_counts("--generation-config", "vllm") == [32]
    assert token_counts("--chat", "--prompt", "Bye", "--max-tokens", "2") == [2, 2]


def test_cli_errors_exit_2(capsys, tmp_path):
    assert cli_main(["generate", "--prompt", "x", "--max-tokens", "0", "--device", "cpu"]) == 2
    assert cli_main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["--help"])


def test_vllm_engine_and_llm_calling_conventions(llm):
    """vLLM's LLMEngine.add_request(request_id, prompt, params) order is taken beside lamina's
    (prompt, params, request_id), told apart by the SamplingParams' place; a wrong params type is a
    clear TypeError; LLM.reset_prefix_cache() is True (no prefix cache, nothing stale); sleep /
    wake_up say lamina has no sleep mode."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert engine.add_request("vllm-order", {"prompt_token_ids": [5, 6, 7]}, params) == "vllm-order"
    assert engine.add_request({"prompt_token_ids": [5, 6, 7]}, params, "lamina-order") == "lamina-order"
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["vllm-order"] == done["lamina-order"] and len(done["vllm-order"]) == 3
    with pytest.raises(TypeError, match="params must be a SamplingParams, got str"):
        engine.add_request("id-1", "a prompt")
    assert llm.reset_prefix_cache() is True
    with pytest.raises(NotImplementedError, match="no sleep mode"):
        llm.sleep()


def test_beam_search(llm):
    """vLLM's LLM.beam_search: width 1 is greedy decoding; wider beams come back best first, each
    beam's cumulative logprob the sum of the model's logprobs of its tokens (checked with
    prompt_logprobs over the whole sequence), its text its tokens decoded."""
    from lamina.sampling_params import BeamSearchParams

    prompt = {"prompt_token_ids": [5, 17, 230, 44]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    [one] = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))
    assert one.sequences[0].tokens == prompt["prompt_token_ids"] + list(greedy)
    [out] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    beams = out.sequences
    assert len(beams) == 3 and len({tuple(b.tokens) for b in beams}) == 3
    scores = [b.cum_logprob / len(b.tokens) for b in beams]
    assert scores == sorted(scores, reverse=True)
    for beam in beams:
        assert beam.tokens[:4] == prompt["prompt_token_ids"] and len(beam.tokens) == 8
        check = llm.generate({"prompt_token_ids": beam.tokens}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                             use_tqdm=False)[0].prompt_logprobs
        assert beam.cum_logprob == pytest.approx(sum(check[p][beam.tokens[p]] for p in range(4, 8)), abs=1e-4)
        assert beam.text == llm.get_tokenizer().decode(beam.tokens) and beam.finish_reason == "length"
    with pytest.raises(ValueError, match="beam_width must be an int >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=2)


def test_beam_search_completes_beams_at_eos():
    """A beam that picks EOS is complete (its text without the EOS); the complete and the live beams
    compete at the end by vLLM's score (cum logprob / length ** length_penalty, the EOS not counted)."""
    import math
    from types import SimpleNamespace

    from lamina.beam_search import BeamSearchParams, beam_search
    from lamina.outputs import Logprob

    eos = 0
    table = {(1,): {eos: math.log(0.6), 2: math.log(0.4)},  # after the prompt [1]: EOS is likeliest
             (1, 2): {3: math.log(0.9), eos: math.log(0.1)}}

    class FakeLLM:
        engine = SimpleNamespace(eos_token_ids=[eos], prepare_prompt=lambda p: (None, p["prompt_token_ids"]),
                                 tokenizer=SimpleNamespace(decode=lambda ids: " ".join(map(str, ids))))

        def generate(self, prompts, params, use_tqdm=False):
            outs = []
            for p in prompts:
                entry = {t: Logprob(v) for t, v in table.get(tuple(p["prompt_token_ids"]), {eos: 0.0}).items()}
                outs.append(SimpleNamespace(outputs=[SimpleNamespace(logprobs=[entry])]))
            return outs

    [out] = beam_search(FakeLLM(), [{"prompt_token_ids": [1]}], BeamSearchParams(beam_width=2, max_tokens=2))
    best, second = out.sequences
    # [1, EOS]: log 0.6 over length 1 = -0.51; [1, 2, 3]: log 0.36 over 3 = -0.34 wins; [1, 2, EOS] log 0.04 / 2
    assert best.tokens == [1, 2, 3] and best.finish_reason == "length" and best.text == "1 2 3"
    assert second.tokens == [1, eos] and second.finish_reason == "stop" and second.text == "1"
    assert second.cum_logprob == pytest.approx(math.log(0.6))

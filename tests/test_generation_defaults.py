"""Default sampling parameters from the model's generation_config.json (vLLM's --generation-config):
requests that set none get its temperature / top_p / top_k / min_p / repetition_penalty /
max_new_tokens, offline and served; "vllm" ignores it; a bad value fails before any weight is read."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from lamina import LLM, SamplingParams
from lamina.engine.generation_defaults import default_sampling

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, show_progress=False)
PROMPT = {"prompt_token_ids": [5, 17, 230, 44, 9, 301]}


@pytest.fixture(scope="module")
def greedy_by_default(qwen3_next_dir, tmp_path_factory):
    """The tiny checkpoint with a generation config that asks for top_k = 1 (greedy) and 5 new tokens."""
    path = shutil.copytree(qwen3_next_dir, tmp_path_factory.mktemp("gen") / "ckpt")
    config = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").exists() else {}
    config.update(temperature=0.7, top_k=1, top_p=0.9, repetition_penalty=1.0, max_new_tokens=5, do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_defaults_are_read_from_the_generation_config(greedy_by_default, tmp_path):
    assert default_sampling("auto", greedy_by_default) == dict(temperature=0.7, top_p=0.9, top_k=1,
                                                                repetition_penalty=1.0, max_tokens=5)
    assert default_sampling("vllm", greedy_by_default) == {}
    assert default_sampling(str(greedy_by_default), tmp_path)["top_k"] == 1  # a folder
    with pytest.raises(ValueError, match="no generation_config.json"):
        default_sampling(str(tmp_path), greedy_by_default)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="top_p"):
        LLM(str(greedy_by_default), generation_config=str(tmp_path), **ENGINE)


def test_offline_requests_without_params_take_them(greedy_by_default):
    with LLM(str(greedy_by_default), **ENGINE) as llm:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.7, 1, 0.9, 5)
        outs = [llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
        greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0].token_ids
        assert outs == [greedy] * 3  # top_k = 1: the greedy tokens, 5 of them
    with LLM(str(greedy_by_default), generation_config="vllm", **ENGINE) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_served_requests_take_them_for_fields_they_leave_out(greedy_by_default):
    import openai  # the server's modules: imported here, so the GPU machine (no openai) collects this file

    from tests.server_harness import MODEL_NAME, RunningServer

    with LLM(str(greedy_by_default), **ENGINE) as llm:
        greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(greedy_by_default), **ENGINE) as llm, RunningServer(llm.engine) as srv, \
            openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60) as client:
        create = lambda **kw: client.completions.create(model=MODEL_NAME, prompt=PROMPT["prompt_token_ids"],
                                                        extra_body={"return_token_ids": True, **kw.pop("extra", {})}, **kw)
        out = create().choices[0]
        assert out.model_extra["token_ids"] == greedy[:5] and out.finish_reason == "length"  # top_k 1, max_new_tokens 5
        out = create(max_tokens=8).choices[0]
        assert out.model_extra["token_ids"] == greedy[:5]  # max_new_tokens caps the request's too (vLLM)
        out = create(max_tokens=3).choices[0]
        assert out.model_extra["token_ids"] == greedy[:3]
        ids = {tuple(create(extra={"top_k": 0}, seed=s).choices[0].model_extra["token_ids"]) for s in range(4)}
        assert len(ids) > 1  # the request's top_k wins: sampled at 0.7 again


def test_vllm_engine_arguments_scripts_pass(qwen3_next_dir):
    """vLLM scripts pass trust_remote_code (no effect here) and enable_prefix_caching (a bool)."""
    with LLM(str(qwen3_next_dir), trust_remote_code=True, enable_prefix_caching=False, **ENGINE) as llm:
        assert llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="enable_prefix_caching='yes': expected True or False"):
        LLM(str(qwen3_next_dir), enable_prefix_caching="yes", **ENGINE)
    with pytest.raises(TypeError, match="unknown argument"):
        LLM(str(qwen3_next_dir), no_such_argument=1, **ENGINE)


def test_served_truncate_prompt_tokens(qwen3_next_dir):
    """vLLM's truncate_prompt_tokens on the server: the last k prompt tokens are the prompt."""
    import openai

    from tests.server_harness import MODEL_NAME, RunningServer

    prompt = list(range(1, 200))  # with max_tokens 16: longer than max_model_len = 128 allows
    with LLM(str(qwen3_next_dir), **ENGINE) as llm:
        tail = llm.generate({"prompt_token_ids": prompt[-6:]}, SamplingParams(temperature=0.0, max_tokens=4),
                            use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(qwen3_next_dir), **ENGINE) as llm, RunningServer(llm.engine) as srv, \
            openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60) as client:
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body={"truncate_prompt_tokens": 6, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == tail and out.usage.prompt_tokens == 6
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                      extra_body={"truncate_prompt_tokens": 0})


def test_override_generation_config(greedy_by_default, tmp_path):
    """vLLM's override_generation_config: laid over the file's defaults ("auto"), or alone ("vllm");
    a field lamina does not read, or a bad value, fails before any weight is read."""
    assert default_sampling("auto", greedy_by_default, {"temperature": 0.3, "max_new_tokens": 9}) == dict(
        temperature=0.3, top_p=0.9, top_k=1, repetition_penalty=1.0, max_tokens=9)
    assert default_sampling("vllm", greedy_by_default, {"top_k": 4}) == {"top_k": 4}
    with pytest.raises(ValueError, match=r"\['do_sample'\] are not sampling defaults lamina reads"):
        default_sampling("auto", greedy_by_default, {"do_sample": False})
    with pytest.raises(ValueError, match="override_generation_config: its sampling defaults are not valid.*top_p"):
        LLM(str(greedy_by_default), override_generation_config={"top_p": 2.0}, **ENGINE)
    with LLM(str(greedy_by_default), override_generation_config={"max_new_tokens": 3}, **ENGINE) as llm:
        params = llm.get_default_sampling_params()
        assert (params.top_k, params.max_tokens) == (1, 3)
        assert len(llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_vllm_only_engine_options(qwen3_next_dir, caplog):
    """vLLM's options for what lamina lacks (lm-evaluation-harness sends swap_space and
    tokenizer_revision): accepted where harmless, refused where they ask for a missing feature;
    seed None is 0, as vLLM's V1 engine."""
    import logging

    with caplog.at_level(logging.INFO, logger="lamina.vllm_compat"), \
            LLM(str(qwen3_next_dir), swap_space=4, tokenizer_revision=None, enable_lora=False, max_lora_rank=16,
                compilation_config={"level": 3}, disable_custom_all_reduce=True, cpu_offload_gb=0, task="generate",
                distributed_executor_backend="mp", limit_mm_per_prompt={"image": 0}, seed=None,
                reasoning_parser="qwen3", scheduling_policy="fcfs", **ENGINE) as llm:
        assert llm.engine.args.seed == 0
        seeded = llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    assert "swap_space=4: no effect" in caplog.text
    with LLM(str(qwen3_next_dir), seed=0, **ENGINE) as llm:
        assert llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids == seeded
    for kwargs, message in (({"enable_lora": True}, "enable_lora=True is not supported; valid: false"),
                            ({"cpu_offload_gb": 4}, "cpu_offload_gb=4 is not supported"),
                            ({"tokenizer_revision": "v2"}, "tokenizer_revision='v2' is not supported"),
                            ({"limit_mm_per_prompt": {"image": 1}}, "zero items of every modality"),
                            ({"scheduling_policy": "priority"}, "valid: fcfs")):
        with pytest.raises(ValueError, match=re.escape(message)):
            LLM(str(qwen3_next_dir), **kwargs, **ENGINE)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_engine_leaves_the_callers_torch_rng_alone(qwen3_next_dir, device):
    """Unseeded requests draw from the engine's own stream (lamina.worker.sampling_rng), as vLLM's
    engine runs in a process of its own: building an engine and generating neither reseeds nor
    advances the caller's global torch RNG, and the caller's torch.manual_seed does not steer sampling
    (the engine's seed does)."""
    import torch

    engine = ENGINE | {"device": device}
    torch.manual_seed(1234)
    expected = torch.rand(3), (torch.rand(3, device=device) if device == "cuda" else None)
    torch.manual_seed(1234)
    sampled = SamplingParams(temperature=1.0, max_tokens=6)
    with LLM(str(qwen3_next_dir), seed=7, **engine) as llm:
        after_start = torch.get_rng_state(), (torch.cuda.get_rng_state() if device == "cuda" else None)
        first = llm.generate(PROMPT, sampled, use_tqdm=False)[0].outputs[0].token_ids
        assert torch.equal(torch.get_rng_state(), after_start[0])  # generating leaves it alone
        if device == "cuda":
            assert torch.equal(torch.cuda.get_rng_state(), after_start[1]), "generating moved the CUDA RNG"
        assert torch.equal(torch.rand(3), expected[0])  # not reseeded, not advanced
        if device == "cuda":
            assert torch.equal(torch.rand(3, device=device), expected[1]), "starting the engine moved the CUDA RNG"
        torch.manual_seed(99)
        second = llm.generate(PROMPT, sampled, use_tqdm=False)[0].outputs[0].token_ids
        torch.manual_seed(99)
        third = llm.generate(PROMPT, sampled, use_tqdm=False)[0].outputs[0].token_ids
    assert second != third  # the stream goes on: the caller's seed does not replay it
    with LLM(str(qwen3_next_dir), seed=7, **engine) as llm:  # the engine's seed replays it
        assert llm.generate(PROMPT, sampled, use_tqdm=False)[0].outputs[0].token_ids == first

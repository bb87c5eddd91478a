"""Qwen3-Next / Qwen3.5-MoE against transformers on tiny random checkpoints (CPU, float32)."""

from __future__ import annotations

import random

import pytest
import torch

from lamina import LLM, SamplingParams
from tests.reference import assert_greedy_agrees, lamina_logits, load_reference, reference_logits

MODELS = ["qwen3_next_dir", "qwen3_next_mixed_dir", "qwen3_5_moe_dir", "qwen3_5_moe_vl_dir", "qwen3_next_fused_dir"]
PROMPT_LENS = [1, 6, 17, 31, 45, 58]


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 990) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=MODELS)
def model_pair(request):
    path = request.getfixturevalue(request.param)
    return path, load_reference(path)


@pytest.mark.parametrize("chunks", [None, [13, 1, 30, 20]])
def test_per_position_logits_close(model_pair, chunks):
    path, ref = model_pair
    tokens = make_prompts(1)[-1] + make_prompts(2)[2][:6]  # 64 tokens
    with LLM(str(path), device="cpu", dtype="float32", show_progress=False) as llm:
        ours = lamina_logits(llm, tokens, chunks)
    theirs = reference_logits(ref, tokens)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)


def _check_outputs(ref, prompts, outputs, max_tokens):
    exact = total = 0
    for prompt, out in zip(prompts, outputs):
        ids = out.outputs[0].token_ids
        assert out.prompt_token_ids == prompt
        assert len(ids) == max_tokens and out.outputs[0].finish_reason == "length"
        exact += assert_greedy_agrees(ref, prompt, ids)
        total += len(ids)
    assert exact >= total - 2, f"only {exact}/{total} greedy tokens are the exact reference argmax"


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_greedy_chunked_prefill_mixed_with_decode(model_pair):
    path, ref = model_pair
    prompts = make_prompts(3)
    with LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=16, block_size=8, show_progress=False) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    _check_outputs(ref, prompts, outputs, GREEDY.max_tokens)


def test_greedy_requests_join_while_others_decode(model_pair):
    path, ref = model_pair
    prompts = make_prompts(4)
    with LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=24, show_progress=False) as llm:
        engine = llm.engine
        finished = {}
        for i, p in enumerate(prompts[:2]):
            engine.add_request({"prompt_token_ids": p}, GREEDY, request_id=f"r{i}")
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            steps += 1
            if steps == 6:  # the first two are decoding by now
                for i, p in enumerate(prompts[2:], start=2):
                    engine.add_request({"prompt_token_ids": p}, GREEDY, request_id=f"r{i}")
    outputs = [finished[f"r{i}"] for i in range(len(prompts))]
    _check_outputs(ref, prompts, outputs, GREEDY.max_tokens)


def test_greedy_with_preemption(model_pair):
    path, ref = model_pair
    prompts = make_prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(
        str(path), device="cpu", dtype="float32", block_size=4, max_model_len=96,
        num_gpu_blocks_override=40, max_num_batched_tokens=64, show_progress=False,
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"
        assert llm.engine.cache.usage() == 0.0
    _check_outputs(ref, prompts, outputs, params.max_tokens)

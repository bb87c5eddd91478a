"""`kv_cache_dtype="fp8"` (vLLM's option): the attention layers' paged cache in FP8 (CPU, float32
model, tiny checkpoints).

The cache holds keys and values clamped and rounded to the format (scale 1.0), and every attention
read, a step's own keys included, reads them from the cache: so a request's result does not depend
on how its prompt was chunked or batched, stays close to the float32 cache's, is the same on the
Triton kernels as on the references, under TP2 as on one rank, and with MTP as without.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from lamina import LLM, SamplingParams
from tests import tiny_checkpoints as tc

ENGINE = dict(device="cpu", dtype="float32", show_progress=False, max_model_len=96)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)


def _prompts(seed=0, lens=(3, 11, 26)):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(0, 990) for _ in range(n)]} for n in lens]


def _run(path, prompts=None, params=PARAMS, alone=False, **kw):
    """Per prompt: (tokens, sampled logprobs, prompt logprobs of the prompt's tokens)."""
    prompts = prompts or _prompts()
    with LLM(str(path), **ENGINE, **kw) as llm:
        outs = [o for p in prompts for o in llm.generate([p], params, use_tqdm=False)] if alone else \
            llm.generate(prompts, params, use_tqdm=False)
    results = []
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        sampled = [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]
        scored = [lp[t] for lp, t in zip(out.prompt_logprobs[1:], prompt["prompt_token_ids"][1:])]
        results.append((list(c.token_ids), sampled, scored))
    return results


def _assert_same(ours, theirs, tol):
    for (t1, s1, p1), (t2, s2, p2) in zip(ours, theirs):
        assert t1 == t2
        assert max((abs(a - b) for a, b in zip(s1 + p1, s2 + p2)), default=0.0) <= tol


def test_the_cache_is_fp8_and_a_quarter_of_float32(qwen3_5_moe_dir):
    """FP8 K/V tensors for every paged layer, drafter included; a block's bytes a quarter of the
    float32 cache's."""
    sizes = {}
    for kv in ("auto", "fp8_e5m2", "fp8"):
        with LLM(str(qwen3_5_moe_dir), **ENGINE, kv_cache_dtype=kv) as llm:
            runner = llm.engine.executor.runner
            tensors = [t for m in runner.paged_cache_modules() for t in m.paged_cache_tensors()]
            want = {"auto": torch.float32, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
            assert tensors and all(t.dtype == want for t in tensors)
            sizes[kv] = runner.paged_cache_bytes_per_block(16)
            assert runner.kv_cache_bytes == sum(t.numel() * t.element_size() for t in tensors)
    assert sizes["fp8"] == sizes["fp8_e5m2"] == sizes["auto"] // 4


def test_plan_counts_the_fp8_cache(qwen3_5_moe_dir, capsys):
    from lamina.entrypoints.cli import main

    per_token = {}
    for kv in ("auto", "fp8"):
        assert main(["plan", str(qwen3_5_moe_dir), "--device", "cpu", "--dtype", "bfloat16", "--json",
                     "--kv-cache-dtype", kv]) == 0
        estimate = json.loads(capsys.readouterr().out)["ranks"][0]["estimate"]
        per_token[kv] = estimate["kv_bytes_per_token"]
        assert estimate["kv_cache_dtype"] == {"auto": "bfloat16", "fp8": "float8_e4m3fn"}[kv]
    assert per_token["fp8"] * 2 == per_token["auto"] > 0


def test_results_do_not_depend_on_chunks_or_batch(qwen3_next_dir):
    """All prompts in one step, against each alone in chunks of 5 tokens: the same tokens and
    logprobs. (Were a chunk's own keys read unrounded, the two would differ by FP8's rounding.)"""
    whole = _run(qwen3_next_dir, kv_cache_dtype="fp8")
    chunked = _run(qwen3_next_dir, kv_cache_dtype="fp8", alone=True, max_num_batched_tokens=5)
    _assert_same(chunked, whole, 1e-5)


def test_close_to_the_float32_cache(qwen3_next_dir):
    """Teacher-forced prompt logprobs and sampled logprobs near the float32 cache's (e4m3: 3
    mantissa bits per key and value), e5m2 (2 bits) further; both differ from it somewhere."""
    exact = _run(qwen3_next_dir)
    flat = [x for _, s, p in exact for x in s + p]
    for kv, bound in (("fp8", 0.02), ("fp8_e5m2", 0.08)):  # measured 0.005 and 0.027
        ours = _run(qwen3_next_dir, kv_cache_dtype=kv)
        theirs = [x for _, s, p in ours for x in s + p]
        diffs = [abs(a - b) for a, b in zip(theirs, flat)]
        assert 0 < max(diffs) <= bound, (kv, max(diffs))


def test_triton_kernels_match_the_references(qwen3_5_moe_dir, monkeypatch):
    """The Triton kernel set (q/k prep writing FP8, the paged decode and varlen kernels reading it;
    Triton's interpreter here) against the torch references on the same FP8 cache."""
    prompts = _prompts(1, lens=(5, 19))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    reference = _run(qwen3_5_moe_dir, prompts, params, kv_cache_dtype="fp8")
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    ours = _run(qwen3_5_moe_dir, prompts, params, kv_cache_dtype="fp8", enforce_eager=True)
    _assert_same(ours, reference, 1e-4)


def test_tp2_and_mtp_match_one_rank(qwen3_next_dir, tmp_path):
    """TP2 (each rank holds its KV heads in FP8) gives the single rank's FP8 results; MTP (K = 2, the
    drafter's cache FP8 too) gives plain decoding's greedy tokens."""
    single = _run(qwen3_next_dir, kv_cache_dtype="fp8")
    _assert_same(_run(qwen3_next_dir, kv_cache_dtype="fp8", tensor_parallel_size=2), single, 1e-4)
    path = tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "mtp"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), **ENGINE, kv_cache_dtype="fp8") as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    with LLM(str(path), **ENGINE, kv_cache_dtype="fp8",
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
        assert llm.engine.spec_decode_metrics.num_draft_tokens > 0
    assert tokens == expected


def test_qwen4_exp_indexer_keys_stay_in_the_model_dtype(tmp_path):
    """Qwen4-Exp: K/V in FP8, the QSA indexer's raw keys (which choose the blocks) in float32."""
    path = tc.make_qwen4_exp(tmp_path / "q4")
    with LLM(str(path), **ENGINE, kv_cache_dtype="fp8") as llm:
        runner = llm.engine.executor.runner
        indexed = [m for m in runner.paged_cache_modules() if hasattr(m, "indexer")]
        assert indexed
        for m in indexed:
            assert m.k_cache.dtype == m.v_cache.dtype == torch.float8_e4m3fn
            assert m.indexer.key_cache.dtype == torch.float32
        [out] = llm.generate(_prompts(lens=(30,)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 6


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, .*fp8_e5m2; got 'int8'"):
        LLM(device="cpu", kv_cache_dtype="int8")

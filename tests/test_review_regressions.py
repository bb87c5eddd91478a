"""Regressions found in review: each case crashed or was refused before its fix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import torch

from lamina import LLM, SamplingParams
from tests import tiny_checkpoints as tc

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", show_progress=False)


def test_mtp_k2_with_a_prompt_longer_than_the_token_budget(qwen3_next_dir, tmp_path):
    """A step that only holds part of a prompt samples nothing; the drafter must not run an
    empty MoE (it used to raise on a 0-row reshape)."""
    path = tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "mtp"))
    prompt = {"prompt_token_ids": list(range(3, 40))}
    with LLM(str(path), max_num_batched_tokens=16, **ENGINE) as llm:
        plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(str(path), max_num_batched_tokens=16, speculative_config=spec, **ENGINE) as llm:
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == plain


def test_abort_flush_step_under_expert_parallel(qwen3_next_dir):
    """Aborting the last request leaves an all-empty lockstep step; EP ranks must not run a 0-row MoE."""
    with LLM(str(qwen3_next_dir), data_parallel_size=2, enable_expert_parallel=True, **ENGINE) as llm:
        engine = llm.engine
        engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY, request_id="a")
        engine.step()
        engine.abort_request("a")
        assert engine.step() == []
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8


def test_tied_embeddings_under_pipeline_parallel(tmp_path):
    """The last stage has no embedding: it loads its own copy of the tied head from embed_tokens."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(9)
    config = Qwen3NextConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                             intermediate_size=96, **dict(tc.COMMON, tie_word_embeddings=True))
    path = tc._save(Qwen3NextForCausalLM(config), tmp_path / "tied", 9)
    prompt = {"prompt_token_ids": [9, 8, 7, 6, 5]}
    with LLM(str(path), **ENGINE) as llm:
        single = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(path), pipeline_parallel_size=2, **ENGINE) as llm:
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == single


def test_config_rejected_by_transformers_exits_2(qwen3_next_dir, tmp_path):
    shutil.copytree(qwen3_next_dir, tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    config["layer_types"] = config["layer_types"][:3]
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "lamina.entrypoints.cli", "plan", str(tmp_path / "bad")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr


def test_stop_strings_without_a_tokenizer_are_refused(qwen3_next_dir, tmp_path):
    path = shutil.copytree(qwen3_next_dir, tmp_path / "notok")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (path / name).unlink(missing_ok=True)
    with LLM(str(path), **ENGINE) as llm:
        try:
            llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop=["x"]), use_tqdm=False)
        except ValueError as e:
            assert "stop strings need a tokenizer" in str(e)
        else:
            raise AssertionError("stop strings without a tokenizer were accepted")


def test_speculation_memory_is_reserved_from_the_kv_budget(qwen3_next_dir, tmp_path):
    path = tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "mtp"))
    budget = dict(kv_cache_memory_bytes=1 << 20, max_model_len=256, max_num_seqs=8, **ENGINE)
    with LLM(str(path), **budget) as llm:
        plain_blocks = llm.engine.num_kv_blocks
    with LLM(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **budget) as llm:
        engine = llm.engine
        reserve = engine._speculation_reserve(8)
        runner = engine.executor.runner
        assert reserve == 8 * 3 * (runner.state_bytes // 8 + engine.model_config.vocab_size * 4)
        per_block = runner.paged_cache_bytes_per_block(16)
        assert engine.num_kv_blocks == min(128, ((1 << 20) - reserve) // per_block) < plain_blocks


def test_seeded_sampling_with_mtp_is_independent_of_batch_composition(qwen3_next_dir, tmp_path):
    """A seeded request draws random numbers per draft; cutting its drafts to another request's
    leftover token budget used to change its draws, so its text depended on the batch."""
    import random

    path = tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "mtp"))
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(0, 990) for _ in range(n)]} for n in (6, 7, 8)]
    seeded = SamplingParams(temperature=0.9, top_k=50, max_tokens=12, ignore_eos=True, seed=123)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(str(path), max_num_batched_tokens=8, speculative_config=spec, **ENGINE) as llm:
        for i in range(3):
            alone = llm.generate(prompts[i], seeded, use_tqdm=False)[0].outputs[0].token_ids
            batch = llm.generate(prompts, seeded, use_tqdm=False)
            assert batch[i].outputs[0].token_ids == alone, i


def test_token_budget_must_hold_a_verification_step(qwen3_next_dir, tmp_path):
    path = tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "mtp"))
    try:
        LLM(str(path), max_num_batched_tokens=3, speculative_config={"method": "mtp", "num_speculative_tokens": 3},
            **ENGINE)
    except ValueError as e:
        assert "max_num_batched_tokens = 3" in str(e) and "at least 4" in str(e)
    else:
        raise AssertionError("a token budget smaller than K+1 was accepted")


def test_seeded_text_does_not_depend_on_speculation(qwen3_next_dir, tmp_path):
    """A seeded request's noise is keyed by its output index and verification couples drafts to
    it: the text is the plain seeded text whatever K is, fixed or auto (whose k follows the batch
    size), so it does not depend on the batch through the number of drafts either."""
    import random

    path = tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "mtp"))
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(0, 990) for _ in range(n)]} for n in (5, 9)]
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=14, ignore_eos=True, seed=s) for s in (7, 8)]
    with LLM(str(path), **ENGINE) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
    specs = [{"num_speculative_tokens": k} for k in (1, 3)]
    specs.append({"num_speculative_tokens": 2, "policy": "auto", "auto_cost": "model", "auto_draft_cost": 0.0})
    for spec in specs:
        with LLM(str(path), speculative_config={"method": "mtp", **spec}, **ENGINE) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
            assert got == plain, spec
            assert llm.generate(prompts[1], seeded[1], use_tqdm=False)[0].outputs[0].token_ids == plain[1], spec
    # drafts that are the plain text are all accepted, wrong ones never; the text stays the same
    for right in (True, False):
        def override(request, proposed):
            ref = plain[[p["prompt_token_ids"] for p in prompts].index(list(request.prompt_token_ids))]
            n = len(request.output_token_ids)
            drafts = list(ref[n : n + len(proposed)])
            return drafts if right else [(t + 1) % 990 for t in drafts]

        with LLM(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **ENGINE) as llm:
            llm.engine.draft_override = override
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
            metrics = llm.engine.spec_decode_metrics
        assert got == plain, right
        assert metrics.num_draft_tokens > 10
        assert metrics.num_accepted_tokens == (metrics.num_draft_tokens if right else 0), (right, metrics)

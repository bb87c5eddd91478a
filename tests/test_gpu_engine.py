"""The engine on a GPU (run there with `pytest -m gpu`; skipped without CUDA): bf16 greedy output
agrees with transformers in float32 on the CPU (near-tie rule) for every family, and CUDA-graph
decode gives exactly the tokens of eager decode on the same kernels; prefill and mixed steps never
sync the host."""

from __future__ import annotations

import random

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.kernels.selection import GdnPrefillKernels
from lamina.layers.gated_delta_net import GatedDeltaNet
from lamina.worker.mixed_graphs import MIXED_GRAPHS_ENV
from tests import tiny_checkpoints as tc
from tests.reference import load_reference, reference_logits

pytestmark = pytest.mark.gpu

FAMILIES = {
    "qwen3_next": lambda p: tc.make_qwen3_next(p),
    "qwen3_5_moe": lambda p: tc.make_qwen3_5_moe(p),
    "qwen4_exp": lambda p: tc.make_qwen4_exp(p, hc_count=4, ple_layer_ids=(1, 4)),
}


def _prompts(n: int = 4) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(0, 990) for _ in range(length)] for length in (1, 9, 23, 40)[:n]]


def _generate(path, prompts, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), device="cuda", show_progress=False, **kwargs) as llm:
        graphs = llm.engine.cuda_graphs
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], graphs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_gpu_greedy_agrees_with_fp32_reference(family, tmp_path):
    path = FAMILIES[family](tmp_path / family)
    ref = load_reference(path)
    prompts = _prompts()
    outputs, graphs = _generate(path, prompts, dtype="bfloat16")
    assert graphs  # every family decodes in CUDA graphs (Qwen4-Exp: QSA's fixed-shape decode)
    exact = total = 0
    for prompt, out in zip(prompts, outputs):
        logits = reference_logits(ref, prompt + out)
        for j, token in enumerate(out):
            row = logits[len(prompt) + j - 1]
            assert row[token] >= row.max() - 0.05, f"{family}: token {j} is {row.max() - row[token]:.4f} below the max"
            exact += int(row.argmax() == token)
            total += 1
    assert exact >= 0.9 * total


@pytest.mark.parametrize("num_prompts", [1, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_equals_eager_decode(qwen3_5_moe_dir, num_prompts, dtype, monkeypatch):
    """Batch sizes that are capture sizes, so both runs multiply matrices of the same shapes. The
    prompts run eagerly in both (the prefill graphs' padded shapes round differently:
    tests/test_mixed_graphs.py compares those with their own eager replay)."""
    monkeypatch.setenv(MIXED_GRAPHS_ENV, "0")
    prompts = _prompts(num_prompts)
    graphed, graphs = _generate(qwen3_5_moe_dir, prompts, dtype=dtype)
    eager, no_graphs = _generate(qwen3_5_moe_dir, prompts, dtype=dtype, enforce_eager=True)
    assert graphs and not no_graphs
    assert graphed == eager


def test_prefill_and_mixed_steps_never_sync_the_host(qwen3_5_moe_dir, monkeypatch):
    """The model's forward in prompt chunks and mixed steps (decodes beside a chunk) reads nothing
    back from the device (decode-only steps replay graphs): bf16 on the Triton kernel set, fla-core's prefill
    (chunk indices from the host), the varlen attention for fresh and continued chunks, the fused
    MoE on prefill chunks. Each forward runs under `torch.cuda.set_sync_debug_mode("error")`. The
    first pass runs unchecked (fla-core autotunes at its first shapes, which synchronises); the
    checked pass repeats those shapes with other prompts. The one read of the sampled ids happens
    after the forward and is not checked. The eager path: prefill graphs off (a capture would fail
    on a sync anyway)."""
    monkeypatch.setenv(MIXED_GRAPHS_ENV, "0")
    rng = random.Random(5)
    lengths = (40, 9, 23, 1, 70)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(qwen3_5_moe_dir), device="cuda", dtype="bfloat16", show_progress=False,
             max_num_batched_tokens=32, max_num_seqs=8) as llm:
        model = llm.engine.executor.runner.model
        delta_nets = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        assert delta_nets and all(m.prefill_kernels == GdnPrefillKernels("fla", "triton") for m in delta_nets)
        forward = model.forward
        checked = {"on": False, "calls": 0}

        def forward_without_syncs(*args, **kwargs):
            if not checked["on"]:
                return forward(*args, **kwargs)
            checked["calls"] += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return forward(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        model.forward = forward_without_syncs  # the runner calls model(...), which calls this
        for check in (False, True):
            checked["on"] = check
            prompts = [[rng.randrange(0, 990) for _ in range(n)] for n in lengths]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        assert checked["calls"] >= 5  # 143 prompt tokens at 32 a step: prompt chunks, some beside decodes


@pytest.mark.parametrize("kv_cache_dtype,tol", [("fp8_e4m3", 0.1), ("fp8_e5m2", 0.2)])
def test_fp8_kv_cache_on_the_gpu(qwen3_5_moe_dir, kv_cache_dtype, tol, monkeypatch):
    """bf16 model, FP8 paged cache: the cache tensors are FP8, CUDA-graph decode gives exactly the
    tokens of eager decode, and every token is within `tol` of the float32 reference's best logit
    (bf16 alone: 0.05; e5m2 keeps 2 mantissa bits). Prompts eagerly in both runs (as above)."""
    monkeypatch.setenv(MIXED_GRAPHS_ENV, "0")
    ref = load_reference(qwen3_5_moe_dir)
    prompts = _prompts()
    want = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        with LLM(str(qwen3_5_moe_dir), device="cuda", dtype="bfloat16", show_progress=False,
                 kv_cache_dtype=kv_cache_dtype, enforce_eager=eager) as llm:
            runner = llm.engine.executor.runner
            dtypes = {t.dtype for m in runner.paged_cache_modules() for t in m.paged_cache_tensors()}
            assert dtypes == {want}
            assert bool(llm.engine.cuda_graphs) != eager
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            runs[eager] = [o.outputs[0].token_ids for o in outs]
    assert runs[False] == runs[True]
    for prompt, out in zip(prompts, runs[False]):
        logits = reference_logits(ref, prompt + out)
        for j, token in enumerate(out):
            row = logits[len(prompt) + j - 1]
            assert row[token] >= row.max() - tol, f"token {j} is {row.max() - row[token]:.4f} below the max"

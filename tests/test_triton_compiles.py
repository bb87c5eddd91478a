"""lamina's Triton kernels compile for an H100 / H200 (sm90) as a bf16 engine launches them, checked
on the CPU: CI runs them under Triton's interpreter, which does not type-check (tests/
triton_compile_check.py records the interpreted launches and builds their Triton IR in a process
without the interpreter). The launches of bf16 engines with an FP8 KV cache and MTP, with FP8
experts and seeded top-k / top-p and top-p-only sampling, of Qwen4-Exp, and of the opt-in kernels (lamina.kernels.
selection's switches); each also with programmatic dependent launch on. And those of the rank
processes of TP2 engines (with and without EP), whose shards' sizes no single-rank run launches. Every launch asks for FP
contraction (lamina.kernels.launch_options). A control kernel that only the compiler refuses must be reported."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.kernels import selection
from lamina.kernels.triton_align import align_pairs_blocked
from tests import tiny_checkpoints as tc
from tests.fp8_checkpoint import fp8_copy
from tests.triton_compile_check import (CONTROL_RECORD, compile_recorded, distinct, record_launches,
                                        start_rank_recording, stop_rank_recording)

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile for real"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records the interpreter's launches"),
]

PROMPTS = [{"prompt_token_ids": [5, 17, 300, 9, 9]}, {"prompt_token_ids": [1, 2, 3]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=4, ignore_eos=True)
NUCLEUS = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, ignore_eos=True)  # top-p alone
ENGINE = dict(device="cpu", dtype="bfloat16", show_progress=False)


def _generate(path, params, graphs_k: int | None = None, **kw):
    """`graphs_k`: first capture the decode and verification graphs' static buffers (as on a GPU;
    replayed eagerly here) for K = graphs_k, which also launches the pending-token fill."""
    with LLM(str(path), **ENGINE, **kw) as llm:
        if graphs_k is not None:
            engine = llm.engine
            assert engine.executor.runner.capture_decode_graphs(engine.max_num_seqs, engine.max_model_len,
                                                                num_speculative_tokens=graphs_k, static_off_cuda=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def _clear_switch_caches() -> None:
    selection.nucleus_cut_enabled.cache_clear()
    selection.gemv_fma.cache_clear()
    selection.moe_gemv_fma_max_tokens.cache_clear()


@contextlib.contextmanager
def _switched(monkeypatch, switches: dict):
    """Environment switches set for the block (those read once per process re-read in and after it)."""
    try:
        with monkeypatch.context() as patch:
            for name, value in switches.items():
                patch.setenv(name, value)
            _clear_switch_caches()
            yield
    finally:
        _clear_switch_caches()


def test_bf16_engine_kernels_compile_for_sm90(tmp_path, mtp_short_dir, qwen3_5_moe_short_dir, monkeypatch):
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    fp8_experts = fp8_copy(qwen3_5_moe_short_dir, tmp_path / "fp8")
    qwen4 = tc.make_qwen4_exp(tmp_path / "q4", hc_count=2, ple_layer_ids=(1,))
    with record_launches() as records:
        _generate(mtp_short_dir, GREEDY, kv_cache_dtype="fp8", graphs_k=2, max_num_seqs=2,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        # the MoE's pair sort for prefill chunks beyond one program's 4,096 pairs, on a few pairs
        align_pairs_blocked(torch.tensor([[3, 1], [0, 3]], dtype=torch.int32), 8, 0, 16, 64)
        with _switched(monkeypatch, dict(LAMINA_NUCLEUS_CUT="1")):
            _generate(fp8_experts, [SEEDED, NUCLEUS])
        _generate(qwen4, GREEDY)
        # the opt-in kernels (lamina.kernels.selection): one-launch delta-net decode and routing, the
        # split-K GEMV, the MoE GEMVs on tl.dot; then routing in the router GEMV's last program
        for switches in (dict(LAMINA_FUSED_GDN_DECODE="1", LAMINA_FUSED_ROUTER="1", LAMINA_GEMV_FMA="0",
                              LAMINA_MOE_GEMV_FMA="0"), dict(LAMINA_GEMV_ROUTE="1")):
            with _switched(monkeypatch, switches):
                _generate(qwen3_5_moe_short_dir, GREEDY)
    kernels = {(r["module"], r["name"]) for r in records}
    assert len(kernels) >= 15, sorted(kernels)  # the engines really ran on the Triton kernels
    opt_in = {"_search_cut_kernel", "_window_cut_kernel", "_fused_gdn_decode_kernel", "_router_kernel",
              "_gemv_splitk_kernel", "_gemv_gate_up_kernel", "_gemv_down_pipelined_kernel"}
    assert opt_in <= {name for _, name in kernels}, sorted(opt_in - {name for _, name in kernels})
    assert any(r["name"] == "_gemv_splitk_kernel" and r["args"]["ROUTE"]["value"] for r in records)  # gemv_route
    # every launch asked for FP contraction (lamina.kernels.launch_options), and compiles with it
    unfused = sorted({f"{r['module']}.{r['name']}" for r in records
                      if r["options"].get("enable_fp_fusion") is not True})
    assert not unfused, unfused
    result = compile_recorded(records + [CONTROL_RECORD], tmp_path)
    if "unsupported" in result:
        pytest.skip(f"this Triton's compiler internals differ: {result['unsupported']}")
    control = [e for e in result["errors"] if "_retyped_in_a_branch" in e]
    errors = [e for e in result["errors"] if "_retyped_in_a_branch" not in e]
    assert control, "the control kernel compiled: the check would not see a compile error"
    assert not errors, "\n\n".join(errors)
    assert result["compiled"] >= len(distinct(records))


def test_tensor_parallel_ranks_kernels_compile_for_sm90(tmp_path, qwen3_5_moe_short_dir, monkeypatch):
    """The launches of tensor-parallel ranks carry their shards' sizes (local heads, the MoE's
    intermediate size / TP, local experts under EP) as constexprs that no single-rank run
    launches (29 of the 35 distinct launches here, when written): each rank of a TP2 engine and of
    a TP2 engine with EP records its launches, which must compile for sm90 too (Triton's GPU
    compiler refuses some shapes the interpreter runs, e.g. a dot below its minimum size)."""
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    per_rank = []
    for layout in (dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)):
        with LLM(str(qwen3_5_moe_short_dir), **ENGINE, **layout) as llm:
            llm.engine.executor.collective_rpc(start_rank_recording)
            assert all(len(o.outputs[0].token_ids) == 4 for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False))
            per_rank += llm.engine.executor.collective_rpc(stop_rank_recording)
    assert len(per_rank) == 4 and all(per_rank), [len(r) for r in per_rank]  # every rank ran Triton kernels
    records = distinct([r for rank in per_rank for r in rank])
    result = compile_recorded(records + [CONTROL_RECORD], tmp_path)
    if "unsupported" in result:
        pytest.skip(f"this Triton's compiler internals differ: {result['unsupported']}")
    errors = [e for e in result["errors"] if "_retyped_in_a_branch" not in e]
    assert len(errors) < len(result["errors"]), "the control kernel compiled: the check would not see a compile error"
    assert not errors, "\n\n".join(errors)
    assert result["compiled"] >= len(records)

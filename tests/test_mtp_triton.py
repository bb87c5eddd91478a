"""MTP speculative decoding on the Triton kernel set: verification steps (K + 1 tokens per request)
run the Q-token kernels (lamina.kernels.triton_verify), under Triton's CPU interpreter where there
is no GPU, eagerly and through the verification graphs' static buffers (captured as CUDA graphs
on a GPU). Greedy output must equal plain decoding's and the reference kernels' MTP run.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

pytest.importorskip("triton")

from lamina import LLM, SamplingParams  # noqa: E402
from lamina.kernels import triton_verify  # noqa: E402
from tests import tiny_checkpoints as tc  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 300], [9] * 11, list(range(40, 61))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory, qwen3_5_moe_dir):
    return tc.add_mtp_weights(shutil.copytree(qwen3_5_moe_dir, tmp_path_factory.mktemp("mtp_triton") / "q35"),
                              fused_experts=True)


def _run(path, monkeypatch, *, kernels: str, k: int = 0, graphs: bool = False, override=None, **kw):
    """Greedy tokens, and how many verification launches (delta rule with Q > 1) ran."""
    monkeypatch.setenv("LAMINA_KERNELS", kernels)
    calls = []
    original = triton_verify.gated_delta_rule_verify

    def counting(*args, **kwargs):
        calls.append(args[8])  # queries
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_verify, "gated_delta_rule_verify", counting)
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
    with LLM(str(path), device=DEVICE, dtype="float32", show_progress=False, enforce_eager=not graphs,
             max_num_seqs=4, **spec, **kw) as llm:
        runner = llm.engine.executor.runner
        if graphs and DEVICE == "cpu":
            assert runner.capture_decode_graphs(llm.engine.max_num_seqs, llm.engine.max_model_len, static_off_cuda=True)
        assert (getattr(runner, "verify_graphs", None) is not None) == (graphs and k > 0)
        if override is not None:
            llm.engine.draft_override = override
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [q for q in calls if q > 1]


def _planted(reference):
    """Drafts = the plain continuation, with the second draft spoiled (partial acceptance)."""

    def override(request, proposed):
        ahead = reference[PROMPTS.index(list(request.prompt_token_ids))][len(request.output_token_ids):]
        drafts = (ahead + [0] * len(proposed))[: len(proposed)]
        if len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 900
        return drafts

    return override


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_mtp_greedy_on_triton_verify_kernels(mtp_dir, monkeypatch, graphs):
    plain, _ = _run(mtp_dir, monkeypatch, kernels="reference")
    for k in (1, 3):
        ref_mtp, ref_calls = _run(mtp_dir, monkeypatch, kernels="reference", k=k)
        assert ref_mtp == plain and not ref_calls
        ours, calls = _run(mtp_dir, monkeypatch, kernels="triton", k=k, graphs=graphs, override=_planted(plain))
        assert ours == plain, f"K={k}"
        # verification steps ran on the Q-token kernels (fewer drafts near max_tokens)
        assert k + 1 in calls and max(calls) == k + 1

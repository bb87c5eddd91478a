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
PROMPTS = [[5, 17, 300], [9] * 6, list(range(40, 49))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory, qwen3_5_moe_dir):
    """The five-layer checkpoint with MTP weights (the GPU test)."""
    return tc.add_mtp_weights(shutil.copytree(qwen3_5_moe_dir, tmp_path_factory.mktemp("mtp_triton") / "q35"),
                              fused_experts=True)


def _run(path, monkeypatch, *, kernels: str, k: int = 0, graphs: bool = False, override=None, prompts=PROMPTS, **kw):
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
            assert runner.capture_decode_graphs(llm.engine.max_num_seqs, llm.engine.max_model_len,
                                                num_speculative_tokens=k, static_off_cuda=True)
        assert (runner.verify_graphs is not None) == (graphs and k > 0)
        for pool in (t for m in runner.model.state_modules() for t in m.state_tensors()):
            pool.zero_()  # on CUDA the engine's warm-up requests left states behind
        owned = set()  # state slots of the requests replayed from the verify graphs
        if runner.verify_graphs is not None:
            replay = runner.verify_graphs.run

            def replaying(chunks, q, capture, *rest):
                calls.append(-q)
                owned.update(c.state_slot for c in chunks)
                return replay(chunks, q, capture, *rest)

            monkeypatch.setattr(runner.verify_graphs, "run", replaying)
        if override is not None:
            llm.engine.draft_override = override
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        if owned:  # padding rows wrote no state: every other slot is still zeros (Q = 1 may write the spare)
            for pool in (t for m in runner.model.state_modules() for t in m.state_tensors()):
                for slot in set(range(pool.shape[0])) - owned - {runner.spare_state_slot}:
                    assert not pool[slot].any(), f"state slot {slot} written"
    replays = [-q for q in calls if q < 0]
    return [list(o.outputs[0].token_ids) for o in outs], [q for q in calls if q > 1], replays


def _planted(reference, prompts=PROMPTS):
    """Drafts = the plain continuation, with the second draft spoiled (partial acceptance)."""

    def override(request, proposed):
        ahead = reference[prompts.index(list(request.prompt_token_ids))][len(request.output_token_ids):]
        drafts = (ahead + [0] * len(proposed))[: len(proposed)]
        if len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 900
        return drafts

    return override


_PLAIN: dict = {}


def _plain(path, monkeypatch, prompts=PROMPTS):
    """Plain (no MTP) greedy tokens on the reference kernels, computed once per checkpoint and prompt list."""
    key = (str(path), tuple(map(tuple, prompts)))
    if key not in _PLAIN:
        _PLAIN[key] = _run(path, monkeypatch, kernels="reference", prompts=prompts)[0]
    return _PLAIN[key]


@pytest.mark.parametrize("k", [3])  # Q = 2 and 3: the kernel tests and the graph-buffer test (k = 2)
def test_mtp_greedy_on_triton_verify_kernels(mtp_short_dir, monkeypatch, k):
    """Eager: the reference kernels' MTP run and the Triton one (planted drafts, partly accepted)
    both give plain decoding's greedy tokens; verification steps run the Q-token kernels."""
    plain = _plain(mtp_short_dir, monkeypatch)
    ref_mtp, ref_calls, _ = _run(mtp_short_dir, monkeypatch, kernels="reference", k=k)
    assert ref_mtp == plain and not ref_calls
    ours, calls, replays = _run(mtp_short_dir, monkeypatch, kernels="triton", k=k, override=_planted(plain))
    assert ours == plain
    assert k + 1 in calls and max(calls) == k + 1 and not replays  # fewer drafts near max_tokens


@pytest.mark.parametrize("k", [2])
@pytest.mark.parametrize("ssm", ["auto", "bfloat16"])
def test_mtp_greedy_through_verify_graph_buffers(mtp_short_dir, monkeypatch, k, ssm):
    """The verification graphs' static buffers, padding (3 requests run as 4) and persistent
    capture rows (replayed as CUDA graphs on a GPU; run eagerly from the same buffers here), with
    the recurrent pool and its capture rows in float32 and in bfloat16 (mamba_ssm_cache_dtype)."""
    plain = _plain(mtp_short_dir, monkeypatch)
    ours, calls, replays = _run(mtp_short_dir, monkeypatch, kernels="triton", k=k, graphs=True,
                                override=_planted(plain), mamba_ssm_cache_dtype=ssm)
    assert ours == plain
    assert k + 1 in replays


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("ssm", ["auto", "bfloat16"])
def test_verify_graphs_match_eager_on_gpu(mtp_dir, monkeypatch, k, ssm):
    """On CUDA: verification steps replayed from CUDA graphs give exactly the eager Triton run's
    tokens (the same kernels, drafts planted so that acceptance is partial). Four requests: a
    capture size, so both runs multiply matrices of the same shapes."""
    prompts = PROMPTS + [[700, 3, 3, 8, 1]]
    plain = _plain(mtp_dir, monkeypatch, prompts)
    eager, eager_calls, no_replays = _run(mtp_dir, monkeypatch, kernels="triton", k=k, override=_planted(plain, prompts),
                                          prompts=prompts, mamba_ssm_cache_dtype=ssm)
    graphed, _, replays = _run(mtp_dir, monkeypatch, kernels="triton", k=k, graphs=True,
                               override=_planted(plain, prompts), prompts=prompts, mamba_ssm_cache_dtype=ssm)
    assert k + 1 in eager_calls and not no_replays
    assert k + 1 in replays
    assert graphed == eager


def test_decode_query_len_from_host_ints():
    from types import SimpleNamespace

    from lamina.kernels.selection import decode_query_len, is_one_token_decode
    from lamina.layers.metadata import StateCapture

    cpu = torch.device("cpu")

    def meta(lens, capture=None):
        return SimpleNamespace(num_reqs=len(lens), num_tokens=sum(lens), max_query_len=max(lens, default=0),
                               state_capture=capture)

    verify = StateCapture.from_host([0, 0, 1, 1], [0, 1, 0, 1], cpu)  # two requests, K = 2 each
    assert decode_query_len(meta([1, 1, 1])) == 1 and is_one_token_decode(meta([1, 1, 1]))
    assert decode_query_len(meta([3, 3], verify)) == 3 and not is_one_token_decode(meta([3, 3], verify))
    assert decode_query_len(meta([3, 3])) is None  # Q > 1 without drafts: prefill chunks
    assert decode_query_len(meta([3, 2], verify)) is None  # ragged
    assert decode_query_len(meta([3, 3], StateCapture.from_host([0, 0, 1], [0, 1, 0], cpu))) is None
    assert decode_query_len(meta([3, 3], StateCapture.from_host([0, 1, 0, 1], [0, 0, 1, 1], cpu))) is None
    assert decode_query_len(meta([9] * 2, StateCapture.from_host([0] * 8 + [1] * 8, list(range(8)) * 2, cpu))) is None
    assert decode_query_len(meta([])) is None


def test_verify_graph_batch_cap(monkeypatch):
    from lamina.worker.verify_graphs import max_verify_batch

    monkeypatch.delenv("LAMINA_VERIFY_GRAPH_MAX_BATCH", raising=False)
    assert max_verify_batch(256) == 64 and max_verify_batch(8) == 8
    monkeypatch.setenv("LAMINA_VERIFY_GRAPH_MAX_BATCH", "16")
    assert max_verify_batch(256) == 16
    monkeypatch.setenv("LAMINA_VERIFY_GRAPH_MAX_BATCH", "lots")
    with pytest.raises(ValueError, match="LAMINA_VERIFY_GRAPH_MAX_BATCH"):
        max_verify_batch(4)


def test_verify_graph_capture_lets_out_of_memory_through(mtp_dir, monkeypatch):
    """A failed capture of the verification graphs is rewrapped with the --enforce-eager hint, except
    out-of-memory, which reaches the engine unchanged (it names the memory plan that left too little)."""
    from lamina.worker import verify_graphs

    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with LLM(str(mtp_dir), device="cpu", dtype="float32", show_progress=False, enforce_eager=True, max_num_seqs=2,
             speculative_config=spec) as llm:
        runner = llm.engine.executor.runner
        for error, caught in ((torch.OutOfMemoryError("CUDA out of memory"), torch.OutOfMemoryError),
                              (RuntimeError("operation not permitted when stream is capturing"), RuntimeError)):
            def fail(self, error=error):
                raise error

            monkeypatch.setattr(verify_graphs.VerifyGraphs, "capture", fail)
            with pytest.raises(caught) as info:
                runner.capture_decode_graphs(2, llm.engine.max_model_len, num_speculative_tokens=1, static_off_cuda=True)
            assert (info.value is error) == (caught is torch.OutOfMemoryError)
            if caught is RuntimeError:
                assert "--enforce-eager" in str(info.value) and info.value.__cause__ is error

"""Decode graphs on every rank of a TP / PP layout (lamina.worker.cuda_graphs.multirank_graphs_reason).

On the CPU (CI) the ranks run the graphs' static buffers and padding eagerly on the Triton kernels
under Triton's interpreter, with gloo collectives: the same packing, padding and per-rank replay
path as on GPUs, checked against the single-rank run. On two GPUs (`-m gpu`) the ranks capture
real CUDA graphs with their NCCL collectives inside and must give one GPU's tokens.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

pytest.importorskip("triton")

from lamina import LLM, SamplingParams  # noqa: E402
from lamina.worker.cuda_graphs import multirank_graphs_reason  # noqa: E402

PROMPTS = [[5, 17, 300], [9] * 5, list(range(40, 47))]
# Different lengths: under DP the replica of the first and third request runs out two steps before
# the other's (with EP it then replays padding rows to join the MoE's collectives).
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 5, 2)]
_single: dict[str, list[list[int]]] = {}


def _tokens(llm, params=PARAMS):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_multirank_graphs_reason(monkeypatch):
    plan = types.SimpleNamespace(pp=2, dp=1, ep_enabled=False, sp=False)
    monkeypatch.delenv("LAMINA_MULTIRANK_GRAPHS", raising=False)
    assert "opt-in" in multirank_graphs_reason(plan, speculative=False)
    monkeypatch.setenv("LAMINA_MULTIRANK_GRAPHS", "1")
    assert multirank_graphs_reason(plan, speculative=False) is None
    assert multirank_graphs_reason(types.SimpleNamespace(pp=1, dp=2, ep_enabled=True, sp=True), speculative=False) is None
    assert "sequence-parallel" in multirank_graphs_reason(types.SimpleNamespace(pp=2, dp=2, ep_enabled=True, sp=True),
                                                          speculative=False)
    assert multirank_graphs_reason(types.SimpleNamespace(pp=1, dp=2, ep_enabled=False, sp=False), speculative=False) is None
    assert multirank_graphs_reason(types.SimpleNamespace(pp=1, dp=2, ep_enabled=True, sp=False), speculative=False) is None
    assert "speculative" in multirank_graphs_reason(plan, speculative=True)  # MTP across pipeline stages
    assert multirank_graphs_reason(types.SimpleNamespace(pp=1, dp=2, ep_enabled=False, sp=False), speculative=True) is None
    for ep_layout in (dict(dp=2), dict(dp=1)):  # MTP graphs without EP only (tested layouts: TP2, DP2)
        assert "speculative" in multirank_graphs_reason(types.SimpleNamespace(pp=1, ep_enabled=True, sp=False, **ep_layout),
                                                        speculative=True)
    monkeypatch.setenv("LAMINA_MULTIRANK_GRAPHS", "yes")
    with pytest.raises(ValueError, match="LAMINA_MULTIRANK_GRAPHS = 'yes' must be 0 or 1"):
        multirank_graphs_reason(plan, speculative=False)


LAYOUTS = [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2), dict(data_parallel_size=2),
           dict(data_parallel_size=2, enable_expert_parallel=True), dict(tensor_parallel_size=2, enable_expert_parallel=True),
           dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),  # SP MoE (auto)
           dict(tensor_parallel_size=2, enable_expert_parallel=True, sequence_parallel_moe="on")]  # SP on two ranks
LAYOUT_IDS = ["tp2", "pp2", "dp2", "dp2-ep", "tp2-ep", "dp2-tp2-ep-sp", "tp2-ep-sp"]


def _world_size(layout: dict) -> int:
    return (layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1)
            * layout.get("data_parallel_size", 1))


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_ranks_replay_their_decode_graphs_like_one_rank(qwen3_5_moe_short_dir, layout, monkeypatch):
    """Greedy tokens of TP2 / PP2 / DP2 / DP2 with EP / TP2 with EP (experts split over the TP
    ranks) / SP MoE (DP2 x TP2, and TP2 forced on) on the Triton kernels whose ranks run decode
    steps through their graphs' static buffers (3 requests padded to 4; on PP the stream handed
    from the first stage's replay to the second's input buffer; on DP each replica replays its own
    share, 2 and 1 requests, from its own graphs; with EP both replicas one common size, the one
    whose requests finished replaying padding) equal the single-rank run's; every rank replayed."""
    if torch.cuda.is_available():
        pytest.skip("the CPU static-buffer path; tests/test_multirank_graphs.py's gpu test covers CUDA")
    engine = dict(device="cpu", dtype="float32", max_num_seqs=4, show_progress=False)
    if str(qwen3_5_moe_short_dir) not in _single:  # one rank on the reference kernels (the Triton set agrees with them)
        monkeypatch.setenv("LAMINA_KERNELS", "reference")
        with LLM(str(qwen3_5_moe_short_dir), **engine) as one:
            _single[str(qwen3_5_moe_short_dir)] = _tokens(one)
    want = _single[str(qwen3_5_moe_short_dir)]
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    with LLM(str(qwen3_5_moe_short_dir), **engine, **layout) as llm:
        executor = llm.engine.executor
        per_rank = executor.capture_decode_graphs(4, llm.engine.max_model_len, static_off_cuda=True)
        assert all(ok for ok, _ in per_rank), per_rank
        got = _tokens(llm)
        replays = executor.graph_replays()
    assert got == want
    assert all(n > 0 for n in replays), replays
    if layout.get("data_parallel_size"):  # the replicas' requests take 2 and 4 (or 1 and 4, ...) decode steps
        lockstep = layout.get("enable_expert_parallel", False)
        assert (len(set(replays)) == 1) == lockstep, replays  # with EP the finished replica replayed padding


def _reference_kernels_on_tp_rank_one(runner):  # collective_rpc: one rank's layers off the Triton set
    if runner.model.ctx.tp_rank == 1:
        for module in runner.model.modules():
            if hasattr(module, "kernels"):
                module.kernels = "reference"
    return runner.why_no_graphs(static_off_cuda=True)


def _rank_graphs(runner):
    return runner.decode_graphs is not None, runner.no_graphs_reason


def test_ranks_capture_all_or_none_when_one_cannot(qwen3_5_moe_short_dir, monkeypatch):
    """Every rank is asked whether it can capture before any does: one that skipped while its TP
    peer captured would leave the peer's captured collectives waiting for it (on two GPUs a hang
    until the NCCL timeout; e.g. Qwen4-Exp's PLE table kept on the host of one rank only). Here TP
    rank 1's layers are moved off the Triton kernel set: no rank captures, and each says why."""
    if torch.cuda.is_available():
        pytest.skip("the CPU static-buffer path")
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    with LLM(str(qwen3_5_moe_short_dir), device="cpu", dtype="float32", max_num_seqs=4, show_progress=False,
             tensor_parallel_size=2) as llm:
        executor = llm.engine.executor
        own = executor.collective_rpc(_reference_kernels_on_tp_rank_one)
        per_rank = executor.capture_decode_graphs(4, llm.engine.max_model_len, static_off_cuda=True)
        kept = executor.collective_rpc(_rank_graphs)
    assert own[0] is None and "every layer on the Triton kernel set" in own[1], own
    assert per_rank == [(False, f"not captured, as another rank cannot (rank 1: {own[1]})"), (False, own[1])], per_rank
    assert kept == per_rank  # rank 0 never started a capture


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(data_parallel_size=2)], ids=["tp2", "dp2"])
def test_mtp_ranks_replay_their_verify_graphs(mtp_short_dir, layout, monkeypatch):
    """MTP K=2 on TP2 / DP2: every rank runs the target's verification steps (Q = 1..3 tokens per
    request) through its verification graphs' static buffers, then verifies and drafts; with
    drafts planted from plain decoding (the second spoiled, so acceptance is partial and states are
    rolled back) the greedy tokens equal plain single-rank decoding's. One length for all requests:
    a step replays only when its requests verify as many drafts each."""
    if torch.cuda.is_available():
        pytest.skip("the CPU static-buffer path; the two-GPU test covers CUDA")
    engine = dict(device="cpu", dtype="float32", max_num_seqs=4, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    monkeypatch.setenv("LAMINA_KERNELS", "reference")
    with LLM(str(mtp_short_dir), **engine) as one:
        plain = _tokens(one, params)
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(str(mtp_short_dir), **engine, **layout, speculative_config=spec) as llm:
        executor = llm.engine.executor
        per_rank = executor.capture_decode_graphs(4, llm.engine.max_model_len, num_speculative_tokens=2,
                                                  static_off_cuda=True)
        assert all(ok for ok, _ in per_rank), per_rank

        def planted(request, proposed):  # the plain continuation, its second draft spoiled
            ahead = plain[PROMPTS.index(list(request.prompt_token_ids))][len(request.output_token_ids):]
            drafts = (ahead + [0] * len(proposed))[: len(proposed)]
            if len(drafts) > 1:
                drafts[1] = (drafts[1] + 1) % 900
            return drafts

        llm.engine.draft_override = planted
        got = _tokens(llm, params)
        replays = executor.graph_replays()
        accepted = llm.engine.spec_decode_metrics.num_accepted_tokens
    assert got == plain
    assert all(n > 0 for n in replays), replays
    assert accepted > 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_graphs_on_two_gpus_match_one_gpu(qwen3_5_moe_short_dir, layout, monkeypatch):
    """TP2 (NCCL collectives captured), PP2 (a stage's stream sent between replays), DP2 (each
    replica its own graphs), DP2 with EP (the MoE's gathers captured, replicas in lockstep) and SP
    MoE (each TP rank's token shard of the padded batch; on two GPUs the TP2 layout with SP forced
    on) with CUDA graphs give one GPU's float32 greedy tokens. Layouts of more ranks than the
    machine has GPUs are skipped."""
    if torch.cuda.device_count() < _world_size(layout):
        pytest.skip(f"needs {_world_size(layout)} GPUs, {torch.cuda.device_count()} here")
    monkeypatch.setenv("LAMINA_MULTIRANK_GRAPHS", "1")
    monkeypatch.setenv("LAMINA_GDN_PREFILL", "reference")
    engine = dict(device="cuda", dtype="float32", max_num_seqs=4, show_progress=False)
    with LLM(str(qwen3_5_moe_short_dir), **engine) as one:
        want = _tokens(one)
    with LLM(str(qwen3_5_moe_short_dir), **layout, **engine) as llm:
        assert llm.engine.cuda_graphs, llm.engine.no_graphs_reason
        got = _tokens(llm)
        replays = llm.engine.executor.graph_replays()
    assert got == want
    assert all(n > 0 for n in replays), replays


@pytest.mark.gpu
def test_mtp_verify_graphs_on_two_gpus_match_one_gpu(mtp_short_dir, monkeypatch):
    """MTP K=2 on TP2 with the verification graphs captured on both GPUs (NCCL inside) gives one
    GPU's float32 greedy tokens."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv("LAMINA_MULTIRANK_GRAPHS", "1")
    monkeypatch.setenv("LAMINA_GDN_PREFILL", "reference")
    engine = dict(device="cuda", dtype="float32", max_num_seqs=4, show_progress=False,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(mtp_short_dir), **engine) as one:
        want = _tokens(one, params)
    with LLM(str(mtp_short_dir), tensor_parallel_size=2, **engine) as llm:
        assert llm.engine.cuda_graphs, llm.engine.no_graphs_reason
        got = _tokens(llm, params)
        replays = llm.engine.executor.graph_replays()
    assert got == want
    assert all(n > 0 for n in replays), replays

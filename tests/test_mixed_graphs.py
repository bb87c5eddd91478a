"""CUDA graphs of short prefill and mixed steps (lamina.worker.mixed_graphs).

On the CPU (CI) the graphs' static buffers and padding run eagerly on the Triton kernels under
Triton's interpreter (`static_off_cuda`), against the reference kernels; on a GPU the captured
graphs replay, against the same padded forward run eagerly (the same kernels and shapes: the same
bits) and against eager steps with the near-tie rule.
"""

from __future__ import annotations

import os

import itertools

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

pytest.importorskip("triton")

from lamina.sampling_params import SamplingParams  # noqa: E402
from lamina.step_plan import ScheduledChunk  # noqa: E402
from lamina.worker import mixed_graphs  # noqa: E402
from lamina.worker.mixed_graphs import MixedGraphs, mixed_graph_max_tokens, request_buckets, token_buckets  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _ShortModel(torch.nn.Module):
    """What MixedGraphs reads of a model for its shapes: one delta-net layer's short-chunk limit."""

    def __init__(self, limit: int):
        super().__init__()
        self.layer = torch.nn.Module()
        self.layer.short_prefill_tokens = limit


def _chunk(request_id, num_tokens, start, table, slot, sample=True, **kwargs):
    return ScheduledChunk(request_id, list(range(100, 100 + num_tokens)), start, table, slot, sample,
                          SamplingParams(), 0, **kwargs)


def test_buckets_and_the_switch(monkeypatch):
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(8) == []
    assert request_buckets(5) == [2, 4, 6]
    assert request_buckets(8) == [2, 4, 8, 9]
    monkeypatch.delenv(mixed_graphs.MIXED_GRAPHS_ENV, raising=False)
    assert mixed_graph_max_tokens() == 512
    for value, expected in (("0", 0), ("100", 128), ("3", 16), ("256", 256)):
        monkeypatch.setenv(mixed_graphs.MIXED_GRAPHS_ENV, value)
        assert mixed_graph_max_tokens() == expected
    for bad in ("-1", "yes"):
        monkeypatch.setenv(mixed_graphs.MIXED_GRAPHS_ENV, bad)
        with pytest.raises(ValueError, match="LAMINA_MIXED_GRAPHS = .* must be a token count >= 0"):
            mixed_graph_max_tokens()
    monkeypatch.delenv(mixed_graphs.AT_START_ENV, raising=False)
    assert mixed_graphs.mixed_graphs_at_start()
    monkeypatch.setenv(mixed_graphs.AT_START_ENV, "0")
    assert not mixed_graphs.mixed_graphs_at_start()
    monkeypatch.setenv(mixed_graphs.AT_START_ENV, "yes")
    with pytest.raises(ValueError, match="LAMINA_MIXED_GRAPHS_AT_START = 'yes' must be 0 or 1"):
        mixed_graphs.mixed_graphs_at_start()


def test_shapes_pad_within_the_query_bound():
    graphs = MixedGraphs(_ShortModel(64), device=torch.device("cpu"), max_tokens=256, max_reqs=8, block_size=4,
                         max_blocks_per_seq=32, spare_state_slot=99, vocab_size=8)
    assert graphs.shape_for(10, 1) == (16, 2)
    assert graphs.shape_for(16, 1) == (16, 2)  # a padding request with no tokens
    assert graphs.shape_for(17, 3) == (32, 4)
    assert graphs.shape_for(8, 8) == (16, 9)
    assert graphs.shape_for(8, 9) is None  # no padding request left
    assert graphs.shape_for(300, 2) is None  # beyond the largest token bucket
    # 129 tokens -> 256: the 127 padding tokens need at least two padding requests of at most 64 each
    assert graphs.shape_for(129, 3) == (256, 8)  # 4 - 3 = 1 padding request would hold 64 only
    assert graphs.shape_for(129, 1) == (256, 4)  # 2 - 1 too; 4 - 1 = 3 hold them
    bs = graphs.block_size
    chunks = [_chunk("a", 1, 9, [3, 5, 7], 2), _chunk("b", 6, 0, [4, 6], 0, sample=False)]
    assert graphs.fits(chunks)
    assert not graphs.fits([_chunk("a", 1, 9, [3, 5, 7], 2)])  # a plain decode: the decode graphs'
    assert not graphs.fits([_chunk("c", 65, 0, [1] * 17, 1)])  # longer than the short-chunk limit
    assert not graphs.fits([_chunk("c", 5, 0, [1, 2], 1, num_prompt_tokens=5)])  # prompt logprobs
    assert graphs.shape_for(7, 2) == (16, 4)
    graphs._pack([_chunk("x", 2, 20, [1, 2, 3, 4, 5, 6], 1), _chunk("y", 2, 20, [1, 2, 3, 4, 5, 6], 3)], (16, 4), None)
    graphs._pack(chunks, (16, 4), None)
    host = graphs.host_np
    qsl = graphs._qsl(host, 4)
    assert qsl.tolist() == [0, 1, 7, 12, 16]  # 9 padding tokens over two padding requests: 5 + 4
    assert graphs._token(host, "request_index", 16).tolist() == [0] + [1] * 6 + [2] * 5 + [3] * 4
    positions = graphs._token(host, "positions", 16).tolist()
    assert positions == [9, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    slots = graphs._token(host, "slot_mapping", 16).tolist()
    assert slots[:7] == [7 * bs + 1, 4 * bs, 4 * bs + 1, 4 * bs + 2, 4 * bs + 3, 6 * bs, 6 * bs + 1]
    assert slots[7:] == [-1] * 9  # padding tokens write no KV
    assert graphs._token(host, "token_ids", 16).tolist() == [100] + list(range(100, 106)) + [0] * 9
    assert graphs._request(host, "seq_lens", 4).tolist() == [10, 6, 5, 4]
    assert graphs._request(host, "state_slots", 4).tolist() == [2, 0, 99, 99]
    assert graphs._request(host, "keep", 4).tolist() == [1, 0, 0, 0]
    tables = graphs._tables(host, 4)
    assert tables[0, :3].tolist() == [3, 5, 7] and tables[1, :2].tolist() == [4, 6]
    assert not np.any(tables[2:, :2])  # the padding requests' blocks (5 tokens: 2 blocks of 4): block 0
    # (entries past a row's context are not cleared: nothing reads them)


def test_reachable_shapes_are_those_steps_take(monkeypatch):
    """`reachable_shapes` (a closed form per token bucket and request count) is exactly the set of
    shapes `shape_for` gives every step of at most the budget's tokens in at most max_reqs requests
    of chunks within the query bound; `capture_all` captures each once, largest first."""
    for max_tokens, max_reqs, limit, budget in itertools.product((16, 64), (1, 3, 8, 20), (1, 5, 16, 24), (16, 40, 8192)):
        graphs = MixedGraphs(_ShortModel(limit), device=torch.device("cpu"), max_tokens=max_tokens, max_reqs=max_reqs,
                             block_size=4, max_blocks_per_seq=64, spare_state_slot=99, vocab_size=8)
        every = {graphs.shape_for(t, r) for t in range(1, min(graphs.max_tokens, budget) + 1)
                 for r in range(1, min(t, max_reqs) + 1) if t <= r * graphs.max_query_len} - {None}
        shapes = graphs.reachable_shapes(budget)
        assert set(shapes) == every and shapes == sorted(shapes, reverse=True), (max_tokens, max_reqs, limit, budget)
    graphs = MixedGraphs(_ShortModel(256), device=torch.device("cpu"), max_tokens=512, max_reqs=256, block_size=16,
                         max_blocks_per_seq=64, spare_state_slot=99, vocab_size=8)
    shapes = graphs.reachable_shapes(8192)
    monkeypatch.setattr(MixedGraphs, "_forward", lambda self, shape: None)  # a capture's warm-up: no model here
    assert len(shapes) == 43 and shapes[0] == (512, 257) and (512, 2) not in shapes  # one chunk holds 256 at most
    graphs.failed.add((16, 2))
    assert graphs.capture_all(8192) == 42 and list(graphs.graphs) == [s for s in shapes if s != (16, 2)]
    assert graphs.capture_all(8192) == 0


def test_the_query_bound_keeps_padding_inside_a_block_table():
    """A short max_model_len (block tables of 2 x 4 entries): no padding request is longer than its
    table holds, so shapes needing longer ones do not fit."""
    graphs = MixedGraphs(_ShortModel(64), device=torch.device("cpu"), max_tokens=64, max_reqs=3, block_size=4,
                         max_blocks_per_seq=2, spare_state_slot=9, vocab_size=8)
    assert graphs.max_query_len == 8
    assert graphs.shape_for(8, 1) == (16, 2)  # 8 padding tokens in one request of 8
    assert graphs.shape_for(7, 1) == (16, 4)  # 9 padding tokens: two requests
    assert graphs.shape_for(17, 3) is None  # 15 padding tokens, one padding request of at most 8
    assert not graphs.fits([_chunk("a", 9, 0, [1, 2, 3], 0)])


def test_uploads_carry_only_the_rows_a_shape_reads():
    """The decode and mixed graphs upload their fields and the replayed size's table (and history)
    rows, not every row's max_model_len-wide table."""
    from types import SimpleNamespace

    from lamina.worker.cuda_graphs import DecodeGraphs

    decode = DecodeGraphs(SimpleNamespace(token_history_len=2), device=torch.device("cpu"), max_batch=8,
                          block_size=4, max_blocks_per_seq=5, spare_state_slot=9)
    mixed = MixedGraphs(_ShortModel(64), device=torch.device("cpu"), max_tokens=32, max_reqs=8, block_size=4,
                        max_blocks_per_seq=5, spare_state_slot=9, vocab_size=8)
    for graphs, upload, rows in ((decode, lambda: decode._upload(2), 2), (mixed, lambda: mixed._upload((16, 2), False), 2)):
        graphs.host.copy_(torch.arange(1, graphs.host.numel() + 1))
        graphs.inputs.zero_()
        upload()
        end = graphs._tables_at + rows * 5
        assert torch.equal(graphs.inputs[:end], graphs.host[:end])
        rest = graphs.inputs[end:]
        if graphs is decode:
            h = decode._history_at
            assert torch.equal(decode.inputs[h : h + 4], decode.host[h : h + 4])
            rest = torch.cat([decode.inputs[end:h], decode.inputs[h + 4 :]])
        assert not rest.any()


def test_why_not_capturable(qwen3_5_moe_short_dir, monkeypatch):
    from lamina.worker.model_loader import build_model, read_model_config
    from lamina.parallel.context import ParallelContext

    def reason(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        device = torch.device(DEVICE)  # the Triton set on the CPU needs the interpreter (on in CI)
        ctx = ParallelContext.single(device)
        model, _, _ = build_model(str(qwen3_5_moe_short_dir), read_model_config(str(qwen3_5_moe_short_dir), None), ctx,
                                  dtype=torch.float32, device=device, progress=False)
        return mixed_graphs.why_not_capturable(model)

    assert reason(LAMINA_KERNELS="triton") is None
    assert "Triton kernel set" in reason(LAMINA_KERNELS="reference")
    assert "LAMINA_GDN_SHORT_PREFILL" in reason(LAMINA_KERNELS="triton", LAMINA_GDN_SHORT_PREFILL="8")
    monkeypatch.delenv("LAMINA_GDN_SHORT_PREFILL")
    assert "varlen kernel" in reason(LAMINA_KERNELS="triton", LAMINA_PREFILL_ATTENTION="sdpa")


def _generate(path, prompts, monkeypatch, *, kernels, mixed_tokens=0, max_tokens=3, at_start=None, **kwargs):
    """Greedy tokens and logprobs; `mixed_tokens` > 0: decode and mixed graphs (on the CPU their
    static buffers, eagerly); `at_start`: LAMINA_MIXED_GRAPHS_AT_START (the CPU engine runs its
    start-up capture here, as a CUDA engine does after its warm-up). Returns (outputs, the runner's
    mixed replays, (shapes captured, the shapes, how many of them before the first request))."""
    from lamina import LLM

    monkeypatch.setenv("LAMINA_KERNELS", kernels)
    # (every chunk here is short: the delta rule's short-chunk kernel, never fla-core's chunked one)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    graphs = mixed_tokens > 0
    monkeypatch.setenv(mixed_graphs.MIXED_GRAPHS_ENV, str(mixed_tokens))
    if at_start is not None:
        monkeypatch.setenv(mixed_graphs.AT_START_ENV, str(int(at_start)))
    with LLM(str(path), device=DEVICE, dtype="float32", show_progress=False, enforce_eager=not graphs,
             **kwargs) as llm:
        runner = llm.engine.executor.runner
        if graphs and DEVICE == "cpu":
            assert runner.capture_decode_graphs(llm.engine.max_num_seqs, llm.engine.max_model_len, static_off_cuda=True,
                                                mixed_max_tokens=mixed_tokens)
            llm.engine._capture_mixed_graphs_at_start()
        assert (runner.mixed_graphs is not None) == graphs, runner.no_mixed_graphs_reason
        before = len(runner.mixed_graphs.graphs) if graphs else 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        captured = runner.mixed_graphs.captures if graphs else 0
        shapes = sorted(runner.mixed_graphs.graphs) if graphs else []
    results = [(o.outputs[0].token_ids, [float(next(iter(d.values()))) for d in o.outputs[0].logprobs]) for o in outs]
    return results, runner.mixed_replays, (captured, shapes, before)


def test_engine_through_mixed_graphs_matches_reference(qwen3_5_moe_short_dir, monkeypatch):
    """Prompts chunked over several steps (a 12-token budget), so steps hold fresh prompts, continued
    chunks and decodes together, through the mixed graphs' static buffers and padding (with
    asynchronous scheduling: pending tokens filled in the static buffer), give the reference
    kernels' tokens and logprobs."""
    path = qwen3_5_moe_short_dir
    prompts = [[5, 17, 300], list(range(40, 57)), [9] * 6]
    options = dict(max_num_seqs=4, max_num_batched_tokens=12)
    ref, _, _ = _generate(path, prompts, monkeypatch, kernels="reference", **options)
    real_pack = MixedGraphs._pack
    pending = []

    def pack(self, chunks, shape, pending_rows):
        pending.append(pending_rows is not None and any(row >= 0 for row in pending_rows))
        real_pack(self, chunks, shape, pending_rows)

    monkeypatch.setattr(MixedGraphs, "_pack", pack)
    ours, replays, (captured, shapes, before) = _generate(path, prompts, monkeypatch, kernels="triton", mixed_tokens=32,
                                                          at_start=True, async_scheduling=True, **options)
    assert before == len(shapes), (before, shapes)  # every shape at start-up, none mid-serving
    assert replays >= 3, replays  # the prompt steps and the steps where decodes ride the last chunks
    assert any(pending), pending  # a decode's pending token filled in the mixed graphs' static buffer
    assert shapes and all(t == 16 for t, _ in shapes), shapes
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, ours):
        assert ids == ref_ids
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)


def test_a_failed_capture_runs_that_shape_eagerly(qwen3_5_moe_short_dir, monkeypatch):
    """A shape whose capture fails (out of memory mid-serving, say) runs eagerly, then and at every
    later step of that shape, with the same results; other shapes still replay."""
    path = qwen3_5_moe_short_dir
    prompts = [[5, 17, 300], list(range(40, 57)), [9] * 6, list(range(200, 230))]  # the last ends alone
    options = dict(max_num_seqs=4, max_num_batched_tokens=12)
    real_capture = MixedGraphs._capture
    attempts = []

    def first_fails(self, shape):
        attempts.append(shape)
        if len(attempts) == 1:
            raise torch.OutOfMemoryError("injected: no room for the graph's pool")
        real_capture(self, shape)

    monkeypatch.setattr(MixedGraphs, "_capture", first_fails)
    ref, _, _ = _generate(path, prompts, monkeypatch, kernels="reference", **options)
    ours, replays, (_, shapes, _) = _generate(path, prompts, monkeypatch, kernels="triton", mixed_tokens=32,
                                              at_start=False, **options)
    assert len(attempts) == len(set(attempts)) == len(shapes) + 1  # the failed shape was never tried again
    assert attempts[0] not in shapes and replays > 0
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, ours):
        assert ids == ref_ids
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)


def _mtp_generate(path, prompts, monkeypatch, *, graphs: bool, k: int = 2, first_steps_drafts: list[int] = ()):
    """MTP K = `k`, greedy on the Triton kernels, eagerly or with the verification and prefill /
    mixed graphs (static buffers on the CPU); `first_steps_drafts`: the drafts the engine decides to
    propose in the first steps of the generation (then `k`), as the auto policy may. Returns (tokens
    and logprobs, every proposal of the drafter, the runner's mixed replays while generating, each
    step's chunks as (tokens, drafts, sampled))."""
    from lamina import LLM
    from lamina.engine.llm_engine import LLMEngine
    from lamina.worker.model_runner import ModelRunner
    from lamina.worker.proposer import MTPProposer

    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    monkeypatch.setenv(mixed_graphs.MIXED_GRAPHS_ENV, "32")
    proposals = []
    real_propose = getattr(MTPProposer.propose, "unwrapped", MTPProposer.propose)  # not an earlier call's wrapper

    def propose(self, *args, **kwargs):
        tokens, probs = real_propose(self, *args, **kwargs)
        proposals.append([t.tolist() for t in tokens])
        return tokens, probs

    propose.unwrapped = real_propose
    monkeypatch.setattr(MTPProposer, "propose", propose)
    decisions = iter(())  # the generation's first steps' (the warm-up's steps decide as configured)
    real_decide = getattr(LLMEngine._decide_num_draft_tokens, "unwrapped", LLMEngine._decide_num_draft_tokens)

    def decide(self):
        decided = real_decide(self)
        forced = next(decisions, None)
        if forced is not None and decided:
            self.num_draft_tokens = decided = forced
        return decided

    decide.unwrapped = real_decide
    monkeypatch.setattr(LLMEngine, "_decide_num_draft_tokens", decide)
    steps = []
    real_launch = getattr(ModelRunner.launch, "unwrapped", ModelRunner.launch)

    def launch(self, plan):
        steps.append([(c.num_tokens, c.num_draft_tokens, c.sample) for c in plan.chunks])
        return real_launch(self, plan)

    launch.unwrapped = real_launch
    monkeypatch.setattr(ModelRunner, "launch", launch)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(str(path), device=DEVICE, dtype="float32", show_progress=False, enforce_eager=not graphs,
             max_num_seqs=4, max_num_batched_tokens=16, speculative_config=spec) as llm:
        runner = llm.engine.executor.runner
        if graphs and DEVICE == "cpu":
            assert runner.capture_decode_graphs(llm.engine.max_num_seqs, llm.engine.max_model_len, num_speculative_tokens=k,
                                                static_off_cuda=True, mixed_max_tokens=32)
        assert (runner.mixed_graphs is not None) == graphs, runner.no_mixed_graphs_reason
        if graphs and DEVICE == "cpu":  # as a CUDA engine: shapes captured by the warm-up's steps, then the rest
            llm.generate([{"prompt_token_ids": [3, 1, 4]}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            assert list(runner.mixed_graphs.graphs) == [(16, 2)]
            llm.engine._capture_mixed_graphs_at_start()
        if graphs:  # every capture went through (a failed one runs eagerly from then on)
            assert not runner.mixed_graphs.failed and len(runner.mixed_graphs.graphs) > 1
        proposals.clear()  # (a CUDA engine's warm-up proposed and replayed too)
        steps.clear()
        warm_up_replays = runner.mixed_replays
        decisions = iter(first_steps_drafts)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = [(o.outputs[0].token_ids, [float(next(iter(d.values()))) for d in o.outputs[0].logprobs]) for o in outs]
    return results, proposals, runner.mixed_replays - warm_up_replays, steps


def test_mtp_prompt_steps_through_mixed_graphs(mtp_short_dir, monkeypatch):
    """MTP engines replay prefill / mixed graphs for steps without drafts (the graph keeps the final
    hidden states; the drafter's first pass and the sampling run eagerly over the padded step): the
    eager run's tokens, logprobs and every proposal of the drafter (its KV history written from the
    padded step). Steps holding drafts run as before."""
    prompts = [[5, 17, 300], list(range(40, 49)), [9] * 3]  # one 15-token step, then decodes with drafts
    eager, eager_proposals, none, _ = _mtp_generate(mtp_short_dir, prompts, monkeypatch, graphs=False)
    ours, proposals, replays, _ = _mtp_generate(mtp_short_dir, prompts, monkeypatch, graphs=True)
    assert none == 0 and replays == 1, replays
    assert proposals == eager_proposals and len(proposals) > 2
    for (eager_ids, eager_lp), (ids, lp) in zip(eager, ours):
        assert ids == eager_ids
        torch.testing.assert_close(lp, eager_lp, atol=1e-4, rtol=0)


def test_mtp_decodes_without_drafts_beside_prompt_chunks_through_mixed_graphs(mtp_short_dir, monkeypatch):
    """MTP steps where requests decode without drafts (the auto policy's k = 0 steps) beside another
    request's prompt chunks replay the prefill / mixed graphs too: the eager run's tokens, logprobs
    and proposals. Steps 1-2 propose no drafts, step 3 proposes k: step 1 holds both prompts, steps 2
    and 3 the first request's draft-free decode beside the second prompt's chunks (step 3 then
    drafts from the padded step), later steps verify drafts."""
    prompts = [[5, 17, 300], list(range(40, 80))]  # 16-token budget: 3 + 13, 1 + 15, 1 + 12 tokens
    eager, eager_proposals, none, eager_steps = _mtp_generate(mtp_short_dir, prompts, monkeypatch, graphs=False,
                                                              first_steps_drafts=[0, 0])
    ours, proposals, replays, steps = _mtp_generate(mtp_short_dir, prompts, monkeypatch, graphs=True,
                                                    first_steps_drafts=[0, 0])
    # On a GPU the graphed engine plans verification steps ahead (asynchronous scheduling), so its later
    # steps may group requests otherwise; the first three steps (those under test) are the same anyway.
    compared = len(eager_steps) if DEVICE == "cpu" else 3
    assert steps[:compared] == eager_steps[:compared] and len(steps) >= compared
    assert eager_steps[:3] == [[(3, 0, True), (13, 0, False)], [(1, 0, True), (15, 0, False)],
                               [(1, 0, True), (12, 0, True)]], eager_steps
    assert any(d for step in eager_steps[3:] for _, d, _ in step)  # then drafts are verified
    assert none == 0 and replays == 3, replays
    assert proposals[:compared] == eager_proposals[:compared] and len(proposals) > 2
    for (eager_ids, eager_lp), (ids, lp) in zip(eager, ours):
        assert ids == eager_ids
        torch.testing.assert_close(lp, eager_lp, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_mixed_graphs_equal_their_eager_replay(qwen3_5_moe_short_dir, monkeypatch):
    """On a GPU: the captured graphs give exactly the tokens and logprobs of the same padded forward
    run eagerly (each shape's graph dropped, so `run` executes its static-buffer forward), and agree
    with eager steps (different kernels for decodes riding a prompt chunk: near ties only)."""
    path = qwen3_5_moe_short_dir
    prompts = [[5, 17, 300], list(range(40, 90)), [9] * 20, list(range(7, 140))]
    options = dict(max_num_seqs=4, max_num_batched_tokens=48, max_tokens=6)
    graphed, replays, (captured, shapes, before) = _generate(path, prompts, monkeypatch, kernels="triton",
                                                             mixed_tokens=64, **options)
    assert replays >= 4 and captured == len(shapes) >= 2, (replays, captured, shapes)
    assert before == len(shapes)  # every shape at start-up: none mid-serving
    real_capture = MixedGraphs._capture

    def no_graph(self, shape):
        real_capture(self, shape)
        self.graphs[shape] = None  # replays run the padded forward eagerly

    monkeypatch.setattr(MixedGraphs, "_capture", no_graph)
    static, static_replays, _ = _generate(path, prompts, monkeypatch, kernels="triton", mixed_tokens=64, **options)
    assert static_replays == replays
    assert graphed == static
    eager, _, _ = _generate(path, prompts, monkeypatch, kernels="triton", **options)
    for (ids, lp), (eager_ids, eager_lp) in zip(graphed, eager):
        assert ids == eager_ids
        torch.testing.assert_close(lp, eager_lp, atol=1e-4, rtol=0)


def test_vllm_cudagraph_mode_maps_to_the_graphs(monkeypatch):
    """vLLM's compilation_config cudagraph_mode: NONE runs eagerly, FULL_DECODE_ONLY keeps the decode
    graphs only, the other modes (and a level, or no mode) keep both; an unknown mode is refused before
    any weight is read, from LLM() and from `lamina serve`'s flags."""
    import argparse

    from lamina import LLM
    from lamina.entrypoints import llm as llm_module
    from lamina.entrypoints.cli import engine_kwargs
    from lamina.vllm_compat import cudagraph_overrides

    assert cudagraph_overrides({"cudagraph_mode": "NONE"}) == {"enforce_eager": True}
    assert cudagraph_overrides('{"cudagraph_mode": "full_decode_only"}') == {"prefill_graphs": False}
    for value in ({"cudagraph_mode": "FULL_AND_PIECEWISE"}, {"cudagraph_mode": "PIECEWISE"}, {"level": 3}, 3, "3",
                  None, type("Config", (), {"cudagraph_mode": "FULL"})()):
        assert cudagraph_overrides(value) == {}
    with pytest.raises(ValueError, match="cudagraph_mode 'SOMETIMES' is not one of NONE, PIECEWISE"):
        cudagraph_overrides({"cudagraph_mode": "sometimes"})
    made = []
    monkeypatch.setattr(llm_module, "LLMEngine", lambda args: made.append(args))
    LLM("/m", compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
    LLM("/m", compilation_config={"cudagraph_mode": "NONE"})
    LLM("/m", compilation_config={"level": 3})
    assert [(a.enforce_eager, a.prefill_graphs) for a in made] == [(False, False), (True, True), (False, True)]
    with pytest.raises(ValueError, match="compilation_config=.*is not supported; valid: .*cudagraph_mode one of"):
        LLM("/m", compilation_config={"cudagraph_mode": "sometimes"})
    assert len(made) == 3
    serve_args = argparse.Namespace(compilation_config='{"cudagraph_mode": "FULL_DECODE_ONLY"}', tokenizer=None,
                                    device="cpu", dtype="auto", max_model_len=None, max_num_seqs=None,
                                    max_num_batched_tokens=None, block_size=16, seed=0, num_gpu_blocks_override=None,
                                    gpu_memory_utilization=0.9, ple_table_device="auto", load_format="auto",
                                    enforce_eager=False)
    assert engine_kwargs(serve_args)["prefill_graphs"] is False


def test_graph_forwards_take_the_captured_paths(qwen3_5_moe_short_dir, mtp_short_dir, monkeypatch):
    """Every forward of the decode, verification and prefill / mixed graphs (warm-up, capture, the
    static-buffer stand-in run here on the CPU) runs under `in_graph_forward()`, which keeps kernels
    on the path a capture records (the fused MoE's opt-in grouped GEMM stays out of graphs), and no
    eager step does."""
    from lamina.kernels.graph_forward import in_graph_forward
    from lamina.models.qwen3_next import HybridDecoderLayer
    from lamina.worker.cuda_graphs import DecodeGraphs
    from lamina.worker.verify_graphs import VerifyGraphs

    seen = []  # (the layer ran inside a graph class's forward, in_graph_forward() there)
    inside = [None]
    for cls in (DecodeGraphs, VerifyGraphs, MixedGraphs):
        real = cls._forward

        def spy(self, *args, _real=real, _name=cls.__name__):
            inside[0] = _name
            try:
                return _real(self, *args)
            finally:
                inside[0] = None

        monkeypatch.setattr(cls, "_forward", spy)
    real_layer = HybridDecoderLayer.forward

    def layer(self, *args, **kwargs):
        seen.append((inside[0], in_graph_forward()))
        return real_layer(self, *args, **kwargs)

    monkeypatch.setattr(HybridDecoderLayer, "forward", layer)
    prompts = [[5, 17, 300], list(range(40, 57)), [9] * 6]
    _generate(qwen3_5_moe_short_dir, prompts, monkeypatch, kernels="triton", mixed_tokens=32, max_num_seqs=4,
              max_num_batched_tokens=12)
    _mtp_generate(mtp_short_dir, [[5, 17, 300], list(range(40, 49))], monkeypatch, graphs=True)
    assert all((name is not None) == flag for name, flag in seen), sorted(set(seen), key=str)
    assert {name for name, _ in seen} == {"DecodeGraphs", "VerifyGraphs", "MixedGraphs", None}
    assert not in_graph_forward()

"""Speculative decoding under asynchronous scheduling (lamina.engine.async_scheduling): step N+1 is
planned before step N's accepted counts reach the host, as if every draft were accepted; the
verification graphs fill in its tokens (N's target token and drafts) and move its positions back
on the device, and the runner commits N's recurrent states from N's accepted counts on the device.

Checked on the CPU through the verification graphs' static buffers (Triton's interpreter; the
same buffers are replayed as CUDA graphs on a GPU), with drafts planted on the device from the
plain greedy continuation (one of them spoiled), so that acceptance is partial and varies: the
tokens and finish reasons of greedy, seeded random, stop-token and max_tokens-limited requests
equal those of the synchronous engine and of plain decoding, and steps really were planned ahead.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

pytest.importorskip("triton")

from lamina import LLM, SamplingParams  # noqa: E402
from lamina.step_plan import PENDING_TOKEN_ID  # noqa: E402
from lamina.worker.verify_graphs import VerifyGraphs  # noqa: E402

SHIFTS: list[int] = []  # position shifts of pending chunks in the last overlapped runs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 300], [9] * 6, list(range(40, 49)), [700, 3, 3, 8, 1]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _plant_drafts(runner, sequences: dict[str, list[int]]) -> None:
    """Replace the drafter's proposals, on the device, by each request's `sequences` entry (its
    prompt and plain greedy continuation, by position) at the positions the drafts will take,
    made wrong at every third position: acceptance is then partial and varies from step to step."""

    def propose(plan, meta, index, last_pos, max_pos, capacity, capacity_on_device, h_logits, h_next, batch,
                is_sampler, first_output_index=None):
        chunks = [c for c in plan.chunks if c.sample]
        if not chunks or not plan.num_draft_tokens:
            return [], []
        table = torch.tensor([sequences[c.request_id] for c in chunks], device=last_pos.device)  # [B, L]
        drafts = []
        for j in range(plan.num_draft_tokens):  # draft j + 1 sits at position last_pos + 2 + j
            position = (last_pos + 2 + j).clamp(max=table.shape[1] - 1)  # [B]
            token = table.gather(1, position[:, None])[:, 0]  # [B]
            drafts.append(torch.where(position % 3 == 0, (token + 1) % 500, token))
        return drafts, [None] * len(drafts)

    runner.spec.proposer.propose = propose


def _run(path, monkeypatch, requests, *, overlap: bool, k: int, references=None, max_num_seqs: int = 4,
         preemptions: list | None = None, max_queries: int | None = None, logprobs: list | None = None,
         fill_kernels: str | None = None, **options):
    """Tokens and finish reason per request, and how many launched plans verified pending drafts
    (`shifts` collects the position shifts the verification graphs applied to pending chunks)."""
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
    planned_ahead = 0
    fill = VerifyGraphs._fill_pending

    def recording_fill(self, *args):
        shift = fill(self, *args)
        SHIFTS.extend(shift.tolist())
        return shift

    monkeypatch.setattr(VerifyGraphs, "_fill_pending", recording_fill)
    with LLM(str(path), device=DEVICE, dtype="float32", show_progress=False, max_num_seqs=max_num_seqs,
             async_scheduling=overlap, **spec, **options) as llm:
        engine = llm.engine
        runner = engine.executor.runner
        if k and DEVICE == "cpu":
            assert runner.capture_decode_graphs(engine.max_num_seqs, engine.max_model_len, num_speculative_tokens=k,
                                                static_off_cuda=True)
        assert runner.sampler_kernels == "triton"  # seeded rows draw the one-launch kernel's noise here
        if fill_kernels is not None:
            assert runner.verify_graphs.fill_kernels == fill_kernels
        if max_queries is not None:  # graphs for fewer tokens a request than K + 1 (as when K + 1 > 8)
            runner.verify_graphs.max_queries = max_queries
        launch = engine.executor.launch

        def spy(plan):
            nonlocal planned_ahead
            planned_ahead += any(c.num_draft_tokens and c.token_ids[-1] == PENDING_TOKEN_ID for c in plan.chunks)
            return launch(plan)

        engine.executor.launch = spy
        ids = [engine.add_request({"prompt_token_ids": p}, params) for p, params in requests]
        if references is not None:
            _plant_drafts(runner, {i: (list(p) + list(ref) + [0] * 64)[:64] for i, (p, _), ref in zip(ids, requests, references)})
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        assert engine._inflight is None
        if preemptions is not None:
            preemptions.append(engine.num_preemptions)
    results = [(list(finals[i].outputs[0].token_ids), finals[i].outputs[0].finish_reason) for i in ids]
    if logprobs is not None:
        logprobs.extend(finals[i].outputs[0].logprobs for i in ids)
    return results, planned_ahead


@pytest.fixture(scope="module")
def plain_greedy(mtp_short_dir):
    """Plain greedy continuations (no MTP) of PROMPTS, long enough for every test."""
    with pytest.MonkeyPatch.context() as mp:
        results, _ = _run(mtp_short_dir, mp, [(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
                                              for p in PROMPTS], overlap=False, k=0)
    return [tokens for tokens, _ in results]


@pytest.mark.parametrize("k, fill", [(3, "triton"), (2, "torch")])
def test_planned_ahead_greedy_equals_plain(mtp_short_dir, monkeypatch, plain_greedy, k, fill):
    """`fill`: the planned-ahead step filled in by the Triton kernel (the default) or its torch form
    (LAMINA_PENDING_FILL=torch). (The synchronous engine's tokens are plain decoding's too: the
    tests below compare it with the overlapped one.)"""
    monkeypatch.setenv("LAMINA_PENDING_FILL", fill)
    SHIFTS.clear()
    overlapped, ahead = _run(mtp_short_dir, monkeypatch, [(p, GREEDY) for p in PROMPTS], overlap=True, k=k,
                             references=plain_greedy, fill_kernels=fill)
    assert ahead > 0
    assert any(SHIFTS) and 0 in SHIFTS  # planned ahead of partly and of wholly accepted verifications
    assert [tokens for tokens, _ in overlapped] == [ref[:9] for ref in plain_greedy]


def test_planned_ahead_stops_limits_and_seeded_sampling(mtp_short_dir, monkeypatch, plain_greedy):
    """A stop token met mid-way (the request rides a step planned ahead, whose tokens are
    dropped), max_tokens reached inside a verification (optimistic counts at the limit), seeded
    random sampling (the same draws as without overlap), logprobs, and a fifth request that waits
    for a free slot (steps are not planned ahead while it waits)."""
    requests = [
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[plain_greedy[0][4]])),
        (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)),
        (PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2)),
        (PROMPTS[0][:2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
    ]
    references = plain_greedy + [plain_greedy[0]]
    sync_lps, overlapped_lps = [], []
    sync, ahead_sync = _run(mtp_short_dir, monkeypatch, requests, overlap=False, k=2, references=references,
                            logprobs=sync_lps)
    overlapped, ahead = _run(mtp_short_dir, monkeypatch, requests, overlap=True, k=2, references=references,
                             logprobs=overlapped_lps)
    assert ahead_sync == 0 and ahead > 0
    assert overlapped == sync
    # logprobs of verified rows come back through the pinned copies (PendingVerify); batch sizes
    # differ (a stopped request rides a step planned ahead): float32 GEMM rounding
    for entry_a, entry_b in zip(sync_lps[3], overlapped_lps[3], strict=True):
        assert entry_a.keys() == entry_b.keys()
        torch.testing.assert_close([float(v) for v in entry_a.values()], [float(v) for v in entry_b.values()], atol=1e-4, rtol=0)
    assert overlapped[0] == (plain_greedy[0][:5], "stop")
    assert overlapped[1] == (plain_greedy[1][:5], "length")


def test_planned_ahead_under_preemptions(mtp_short_dir, monkeypatch, plain_greedy):
    """Greedy and seeded random requests and a cache too small for all of them: requests are
    preempted while their verification is in flight (and recompute from scratch once its tokens
    are known), and, since planning ahead reserves KV blocks as if every draft were accepted, at
    other steps than in the synchronous run. A preempted request keeps its drafts and its
    recomputation verifies them, so its random draws, and its tokens, do not depend on when it was
    preempted: the tokens equal the synchronous run's, and the greedy ones plain decoding's."""
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=9, ignore_eos=True) for i in range(2)]
    requests = [(PROMPTS[0], GREEDY), (PROMPTS[1], seeded[0]), (PROMPTS[2], GREEDY), (PROMPTS[3], seeded[1])]
    options = dict(num_gpu_blocks_override=12, block_size=4, max_model_len=32)
    sync_counts, counts = [], []
    sync, _ = _run(mtp_short_dir, monkeypatch, requests, overlap=False, k=2, references=plain_greedy,
                   preemptions=sync_counts, **options)
    overlapped, ahead = _run(mtp_short_dir, monkeypatch, requests, overlap=True, k=2, references=plain_greedy,
                             preemptions=counts, **options)
    assert ahead > 0 and sync_counts[0] > 0 and counts[0] > 0
    assert overlapped == sync
    assert [overlapped[0][0], overlapped[2][0]] == [plain_greedy[0][:9], plain_greedy[2][:9]]


def test_fill_is_warmed_at_capture_and_writes_nothing(mtp_short_dir, monkeypatch):
    """Graph capture runs the fill once per Q with nothing pending (so the first step planned
    ahead finds its Triton kernel compiled); that run leaves the staged inputs as they were."""
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    with LLM(str(mtp_short_dir), device=DEVICE, dtype="float32", show_progress=False, max_num_seqs=4,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        engine = llm.engine
        runner = engine.executor.runner
        if DEVICE == "cpu":
            assert runner.capture_decode_graphs(engine.max_num_seqs, engine.max_model_len, num_speculative_tokens=2,
                                                static_off_cuda=True)
        graphs = runner.verify_graphs
        assert graphs.fill_kernels == "triton"
        calls = []
        fill = graphs._fill
        graphs._fill = lambda *args: calls.append(args[0].shape) or fill(*args)
        inputs = graphs.inputs.clone()
        graphs._warm_fill()
        assert calls == [(1, 1), (1, 2), (1, 3)]
        source = graphs._request_field(graphs.inputs, "source_rows", 1)
        assert source.tolist() == [-1]
        source.copy_(graphs._request_field(inputs, "source_rows", 1))
        assert torch.equal(graphs.inputs, inputs)


def test_no_planning_ahead_past_the_verification_graphs(mtp_short_dir, monkeypatch, plain_greedy):
    """Verification graphs for at most 2 tokens a request, K = 3: steps of 4 tokens run eagerly
    and are never planned ahead (the runner could not fill their pending tokens in); steps the
    graphs take (the K = 1 tail near max_tokens, or none) may be. Tokens stay plain decoding's."""
    requests = [(p, GREEDY) for p in PROMPTS]
    overlapped, ahead = _run(mtp_short_dir, monkeypatch, requests, overlap=True, k=3, references=plain_greedy,
                             max_queries=2)
    assert [tokens for tokens, _ in overlapped] == [ref[:9] for ref in plain_greedy]

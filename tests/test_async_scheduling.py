"""Asynchronous scheduling (lamina.engine.async_scheduling): step N+1 is planned and launched before
step N's tokens are read back, with the pending tokens filled in on the device. Checked on the CPU
(where the same code runs without any overlap in time): the tokens, finish reasons and logprobs of
every kind of request equal those of the synchronous engine, the overlap really happened (plans
carried pending tokens), and requests the overlap cannot serve (penalties, grammars, prompt
logprobs) still get their exact tokens. The decode graphs' static buffers with pending tokens are
covered in tests/test_triton_kernels.py (the engine test on the Triton kernels runs overlapped)."""

from __future__ import annotations

import itertools

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.engine.async_scheduling import resolve_async_scheduling
from lamina.step_plan import PENDING_TOKEN_ID

PROMPTS = [[5, 17, 300], [9] * 11, list(range(40, 61)), [3, 1, 4, 1, 5, 9, 2, 6]]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _run(path, requests, *, overlap: bool, steps_before_abort: int | None = None, counters: dict | None = None,
         **kwargs):
    """(token ids, finish reason, logprobs) per request, and how many pending tokens each launched plan
    had; `counters` gets the engine's count of steps launched with one still in flight."""
    pending = []
    with LLM(str(path), device="cpu", dtype="float32", show_progress=False, async_scheduling=overlap, **kwargs) as llm:
        engine = llm.engine
        assert engine.async_scheduling == overlap
        launch = engine.executor.launch

        def spy(plan):
            pending.append(sum(t == PENDING_TOKEN_ID for c in plan.chunks for t in c.token_ids))
            return launch(plan)

        engine.executor.launch = spy
        ids = [engine.add_request({"prompt_token_ids": p}, params) for p, params in requests]
        finals, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            steps += 1
            if steps == steps_before_abort:
                engine.abort_request(ids[0])
        assert not engine.has_unfinished_requests() and engine._inflight is None
        if counters is not None:
            counters["overlapped_steps"] = engine.num_overlapped_steps
    results = []
    for request_id in ids:
        out = finals.get(request_id)
        if out is None:
            results.append(None)
            continue
        completions = [(c.token_ids, c.finish_reason, c.logprobs) for c in out.outputs]
        if out.prompt_logprobs is not None:
            completions.append(([], None, out.prompt_logprobs[1:]))
        results.append(completions)
    return results, pending


def _assert_same(sync, overlapped):
    for a, b in zip(sync, overlapped):
        assert (a is None) == (b is None)
        if a is None:
            continue
        for (ids_a, reason_a, lp_a), (ids_b, reason_b, lp_b) in zip(a, b):
            assert ids_a == ids_b and reason_a == reason_b
            if lp_a is not None:
                for entry_a, entry_b in zip(lp_a, lp_b):
                    assert entry_a.keys() == entry_b.keys()
                    # batch sizes differ (a stopped request still rides one step): float32 GEMM rounding
                    torch.testing.assert_close([float(v) for v in entry_a.values()], [float(v) for v in entry_b.values()], atol=1e-4, rtol=0)


def test_resolution_rules():
    common = dict(single_rank=True, token_history_len=0)
    assert resolve_async_scheduling(None, device_type="cuda", **common)
    assert not resolve_async_scheduling(None, device_type="cpu", **common)
    assert resolve_async_scheduling(True, device_type="cpu", **common)
    assert not resolve_async_scheduling(False, device_type="cuda", **common)
    for bad in ({"single_rank": False}, {"token_history_len": 4}):
        with pytest.raises(ValueError, match="async_scheduling = True is not supported"):
            resolve_async_scheduling(True, device_type="cuda", **{**common, **bad})


def test_overlapped_engine_matches_synchronous(qwen3_5_moe_dir):
    """Greedy with logprobs, seeded sampling, a stop token met mid-way (its request rides one more
    step whose token is dropped), min_tokens, n=2 children forked from one prefill, and a request
    with a penalty (its steps are not overlapped) - all in one batch."""
    greedy = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2)
    (base,), _ = _run(qwen3_5_moe_dir, [(PROMPTS[0], greedy)], overlap=False)
    stop_at = base[0][0][2]  # the third greedy token of PROMPTS[0]
    requests = [
        (PROMPTS[0], greedy),
        (PROMPTS[1], SamplingParams(temperature=0.8, seed=3, max_tokens=9, logprobs=1)),
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[stop_at])),
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=9, min_tokens=4, stop_token_ids=[stop_at])),
        (PROMPTS[2], SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=6)),
        (PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=5, presence_penalty=0.5, frequency_penalty=0.3)),
        (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)),
    ]
    sync, _ = _run(qwen3_5_moe_dir, requests, overlap=False, max_num_seqs=8)
    overlapped, pending = _run(qwen3_5_moe_dir, requests, overlap=True, max_num_seqs=8)
    _assert_same(sync, overlapped)
    assert sync[2][0][1] == "stop" and len(sync[2][0][0]) == 3
    assert len(sync[3][0][0]) > 3
    assert max(pending) > 0, "no step was planned ahead of its predecessor's tokens"


def test_overlap_waits_for_host_tokens_where_needed(qwen3_5_moe_dir):
    """A penalty request alone never overlaps (its sampler reads its tokens); a plain one does."""
    penalty = SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.3)
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    sync, _ = _run(qwen3_5_moe_dir, [(PROMPTS[1], penalty)], overlap=False)
    counters = {}
    overlapped, pending = _run(qwen3_5_moe_dir, [(PROMPTS[1], penalty)], overlap=True, counters=counters)
    _assert_same(sync, overlapped)
    assert max(pending) == 0 and counters["overlapped_steps"] == 0
    _, pending = _run(qwen3_5_moe_dir, [(PROMPTS[1], plain)], overlap=True, counters=counters)
    assert pending == [0] + [1] * 5  # the prefill, then every decode step planned ahead
    assert counters["overlapped_steps"] == 5  # each launched while the step before it was in flight


def test_overlap_with_preemption_and_abort(qwen3_5_moe_dir):
    """Few KV blocks force preemptions (recompute) while tokens are pending, and a request aborted
    with a step in flight: the others' tokens equal the synchronous run's."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [(p, params) for p in PROMPTS]
    options = dict(max_num_seqs=4, num_gpu_blocks_override=12, block_size=4, max_model_len=36)
    sync, _ = _run(qwen3_5_moe_dir, requests, overlap=False, **options)
    overlapped, _ = _run(qwen3_5_moe_dir, requests, overlap=True, **options)
    _assert_same(sync, overlapped)
    with LLM(str(qwen3_5_moe_dir), device="cpu", dtype="float32", show_progress=False, async_scheduling=True,
             **options) as llm:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert llm.engine.num_preemptions > 0
    sync, _ = _run(qwen3_5_moe_dir, requests, overlap=False, steps_before_abort=4)
    overlapped, _ = _run(qwen3_5_moe_dir, requests, overlap=True, steps_before_abort=4)
    assert overlapped[0] is None or overlapped[0][0][1] == "abort"
    _assert_same(sync[1:], overlapped[1:])


def test_warm_up_steps_reach_the_token_budget():
    """Steps as large as the budget even when one prompt cannot be (max_model_len), never more
    requests than max_num_seqs, never a prompt longer than max_model_len - 1."""
    from types import SimpleNamespace

    from lamina.engine.llm_engine import LLMEngine
    from lamina.engine.warm_up import _cut_prompt_lengths

    def steps(budget, model_len, seqs, num_tokens=256):
        engine = SimpleNamespace(max_num_batched_tokens=budget, max_model_len=model_len, max_num_seqs=seqs)
        return LLMEngine.warm_up_steps(engine, num_tokens)

    got = steps(8192, 1296, 128)  # bench throughput's engine: 1024 + 256 + 16
    # 32, 256 and the budget as one request and one token short over two; the other powers of two
    # from 8 to 512 (the fused MoE's alignment buckets) once; last, whole prompts 16 tokens short of
    # the budget and one the budget cuts after its first 16 tokens
    assert [sum(s) for s in got] == [8, 16, 32, 31, 64, 128, 256, 255, 512, 8192, 8191, 8176 + 1295]
    assert [len(s) for s in got] == [1, 1, 1, 2, 1, 1, 1, 2, 1, 7, 7, 8] and max(map(max, got)) <= 1295
    assert got[-1] == [1168] * 7 + [1295]
    # one request at a time, prompts of at most 511 tokens: a budget of 8192 never cuts a prompt
    got = steps(8192, 512, 1)
    assert got == [[8], [16], [32], [31], [64], [128], [256], [255], [511], [510]]
    assert steps(8192, 20000, 64, num_tokens=1) == [[1], [8], [16], [32], [16, 15], [64], [128], [512], [8192],
                                                    [4096, 4095], [16384]]  # one prompt: a whole budget continues it
    assert steps(2048, 20000, 1)[-1] == [4096]
    assert steps(8192, 16384, 64)[-1] == [16383]  # 8192 tokens, then 8191 that continue them
    # 10 prompts of at most 1023 tokens: 8 whole ones of 8176 tokens, and a 9th cut after 16
    assert steps(8192, 1024, 10)[-1] == [1022] * 8 + [1023]
    # 5 prompts of at most 1800 tokens: 4 whole ones before the cut one, which the budget cuts after 992
    assert steps(8192, 1801, 5)[-1] == [1800] * 5
    assert _cut_prompt_lengths(8192, 4, 1800) == []  # 4 x 1800 tokens fit the budget: no prompt is ever cut
    for budget, model_len, seqs in itertools.product((16, 48, 2048, 8192), (3, 17, 49, 1025, 2049, 8193, 16384),
                                                     (1, 2, 3, 10, 64)):
        per_request = model_len - 1
        cut = _cut_prompt_lengths(budget, seqs, per_request)
        if per_request * seqs <= budget:
            assert cut == []
            continue
        ends = list(itertools.accumulate(cut))  # where each prompt ends in the step's token order
        assert len(cut) <= seqs and 1 <= min(cut) and max(cut) <= per_request
        assert budget not in ends and ends[-1] > budget, (budget, model_len, seqs, cut)  # one prompt straddles it


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
def test_warm_up_leaves_the_engine_as_it_was(qwen3_5_moe_dir, overlap):
    """The constructor's warm-up on CUDA (a throwaway prefill so the first request does not pay the
    kernel compiles), run here by hand: no request left, every KV block free, counters reset, and
    the next requests get the tokens a fresh engine gives."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    # the warm-up's steps: 8 and 16 tokens, then 32, 40 and the whole budget (48), each as one
    # request and one token short over two, then a 96-token prompt the budget cuts at 48
    options = dict(device="cpu", dtype="float32", show_progress=False, async_scheduling=overlap,
                   max_num_batched_tokens=48)
    with LLM(str(qwen3_5_moe_dir), **options) as llm:
        fresh = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(qwen3_5_moe_dir), **options) as llm:
        engine = llm.engine
        seen, chunks = [], []
        add_request = engine.add_request
        engine.add_request = lambda prompt, *a, **k: (seen.append(len(prompt["prompt_token_ids"])), add_request(prompt, *a, **k))[1]
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda *a, **k: (lambda plan: (chunks.extend(
            (c.start_position, len(c.token_ids)) for c in plan.chunks), plan)[1])(schedule(*a, **k))
        engine.warm_up(num_tokens=40)
        del engine.add_request, engine.scheduler.schedule
        assert engine.warm_up_steps(40) == [[8], [16], [32], [16, 15], [40], [20, 19], [48], [24, 23], [96]]
        assert seen == [8, 16, 32, 16, 15, 40, 20, 19, 48, 24, 23, 96]
        assert chunks[-2:] == [(0, 48), (48, 48)]  # the cut prompt's rest runs over its cached context
        assert not engine.has_unfinished_requests() and engine.cache_usage() == 0
        assert engine.num_prompt_tokens_processed == engine.num_generation_tokens_processed == 0
        assert not engine.step_token_counts
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert engine.num_generation_tokens_processed == 10
    assert after == fresh


def test_warm_up_cuts_a_prompt_when_prompts_are_shorter_than_the_budget(qwen3_5_moe_dir):
    """Prompts of at most 19 tokens and a budget of 48: two whole prompts of 16, then one of 19 that
    the budget cuts after 16 tokens; the scheduler's next step continues it over its cache."""
    with LLM(str(qwen3_5_moe_dir), device="cpu", dtype="float32", show_progress=False, max_num_batched_tokens=48,
             max_model_len=20) as llm:
        engine = llm.engine
        assert engine.warm_up_steps(40)[-1] == [16, 16, 19]
        chunks = []
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda *a, **k: (lambda plan: (chunks.append(
            [(c.start_position, len(c.token_ids)) for c in plan.chunks]), plan)[1])(schedule(*a, **k))
        engine.warm_up(num_tokens=40)
        del engine.scheduler.schedule
        assert chunks[-2][-3:] == [(0, 16), (0, 16), (0, 16)] and chunks[-1] == [(16, 3)]
        assert not engine.has_unfinished_requests() and engine.cache_usage() == 0


def test_a_stopped_request_id_taken_again_while_its_step_runs(qwen3_5_moe_dir):
    """A request that stops at step N still rides step N+1 (in flight when its stop is seen); a new
    request that takes its id before N+1 reports must not receive N+1's token for the old one."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (base,), _ = _run(qwen3_5_moe_dir, [(PROMPTS[0], greedy)], overlap=False)
    stops = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[base[0][0][2]])
    (second,), _ = _run(qwen3_5_moe_dir, [(PROMPTS[2], greedy)], overlap=False)
    with LLM(str(qwen3_5_moe_dir), device="cpu", dtype="float32", show_progress=False, async_scheduling=True) as llm:
        engine = llm.engine
        engine.add_request({"prompt_token_ids": PROMPTS[0]}, stops, request_id="r")
        finished = []
        while not finished:
            finished = [o for o in engine.step() if o.finished]
        assert finished[0].outputs[0].token_ids == base[0][0][:3]
        assert engine._inflight is not None  # the step after the stop is still running
        engine.add_request({"prompt_token_ids": PROMPTS[2]}, greedy, request_id="r")
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
        assert outputs["r"].outputs[0].token_ids == second[0][0]

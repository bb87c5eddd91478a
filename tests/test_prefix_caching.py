"""Prefix caching (`enable_prefix_caching`, lamina/engine/prefix_cache.py): a prompt that starts with
a kept prefix starts at its end, sharing its KV blocks and copying its recurrent state, and computes
exactly what it computes without the cache (float32 CPU: chunking does not change the references'
arithmetic), in every family, with MTP, and on every rank of a parallel layout.
"""

from __future__ import annotations

import json

import pytest

from lamina import LLM, SamplingParams
from lamina.engine.cache_manager import CacheManager
from lamina.engine.request import Request, RequestStatus
from lamina.engine.scheduler import Scheduler, SchedulerConfig
from tests import tiny_checkpoints as tc
from tests.test_prefill_sharing import _advance as _run  # a step done: computed tokens, a sampled 5

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, show_progress=False, block_size=4,
              max_num_batched_tokens=8)
CACHING = dict(enable_prefix_caching=True, prefix_cache_min_tokens=4)
SYSTEM = [(11 * i + 5) % 997 for i in range(18)]  # a shared start: 4 whole blocks and 2 tokens
FIRST = SYSTEM + [3, 1, 4]
SECOND = SYSTEM + [2, 7, 1, 8, 2, 8]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def qwen4_exp_dir(tmp_path_factory):
    return tc.make_qwen4_exp(tmp_path_factory.mktemp("q4_prefix") / "ckpt")


def rounds(llm, prompt_rounds, params):
    """Each round's prompts, generated together; [(tokens, cumulative logprob, cached tokens)]."""
    out = []
    for prompts in prompt_rounds:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        out.append([(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob, o.num_cached_tokens) for o in outs])
        assert llm.engine.cache_usage() == 0.0 and not llm.engine.has_unfinished_requests()
    return out


def assert_same_tokens(got, expected):
    for round_got, round_expected in zip(got, expected, strict=True):
        for (tokens, logprob, _), (ref_tokens, ref_logprob, _) in zip(round_got, round_expected, strict=True):
            assert tokens == ref_tokens
            assert (logprob is None) == (ref_logprob is None)
            if logprob is not None:
                assert logprob == pytest.approx(ref_logprob, abs=1e-4)


# A first round keeps FIRST's prefixes; the second starts from them: the same prompt again, a longer
# conversation (FIRST, its answer, more), a prompt sharing only SYSTEM's blocks, and an unrelated one;
# the third repeats the conversation and SECOND (from the prefixes the second round kept one token
# short of their ends, inside a block: shared blocks and a copied partial one).
def prompt_rounds(first_answer: list[int]) -> list[list[list[int]]]:
    turn = FIRST + first_answer + [9, 9, 9, 9, 9]
    return [[FIRST], [FIRST, turn, SECOND, [5, 6, 7, 8, 9, 10]], [turn, SECOND]]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe", "qwen4_exp"])
def test_tokens_equal_the_uncached_engine(arch, request):
    path = str(request.getfixturevalue(f"{arch}_dir"))
    with LLM(path, **ENGINE) as plain:
        answer = plain.generate({"prompt_token_ids": FIRST}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        expected = {name: rounds(plain, prompt_rounds(answer), params) for name, params in
                    (("greedy", GREEDY), ("seeded", SEEDED))}
    with LLM(path, **ENGINE, **CACHING) as cached:
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            assert cached.reset_prefix_cache()
            got = rounds(cached, prompt_rounds(answer), params)
            assert_same_tokens(got, expected[name])
            first, second, third = got
            assert first[0][2] == 0  # nothing kept yet
            cached_tokens = [c for _, _, c in second]
            # the same prompt: all but its last token; the conversation: at least that; SECOND:
            # SYSTEM's 4 whole blocks (FIRST's budget-cut chunk ended there); the unrelated prompt: nothing
            assert cached_tokens[0] == 20 and cached_tokens[1] >= 20 and cached_tokens[2] == 16
            assert cached_tokens[3] == 0
            assert [c for _, _, c in third] == [len(FIRST) + len(answer) + 4, len(SECOND) - 1]
        engine = cached.engine
        assert engine.num_prefix_cache_hits > 0 and engine.num_prefix_cache_queries > engine.num_prefix_cache_hits


def test_prompts_sharing_a_system_prompt_meet_at_their_junction(qwen3_next_dir):
    """Whole prompts in one chunk (no budget cut): SECOND shares only SYSTEM with FIRST, so it ends a
    chunk where they part (16 tokens, SYSTEM's whole blocks) and a third prompt with the same system
    prompt starts there; tokens equal the uncached engine's. Without junctions it starts at 0."""
    third = SYSTEM + [6, 6, 6, 6, 6, 6, 6]
    prompt_rounds = [[FIRST], [SECOND], [third], [third]]
    whole = dict(ENGINE, max_num_batched_tokens=64)
    with LLM(str(qwen3_next_dir), **whole) as plain:
        expected = rounds(plain, prompt_rounds, SEEDED)
    for junctions, cached_tokens in ((True, [0, 0, 16, len(third) - 1]), (False, [0, 0, 0, len(third) - 1])):
        with LLM(str(qwen3_next_dir), **whole, **CACHING, prefix_cache_junctions=junctions) as cached:
            got = rounds(cached, prompt_rounds, SEEDED)
        assert_same_tokens(got, expected)
        assert [r[0][2] for r in got] == cached_tokens, junctions


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_with_mtp_speculative_decoding(qwen3_next_dir, tmp_path, async_scheduling):
    """The MTP drafter's paged cache lives in the same blocks: shared with the prefix too; with
    asynchronous scheduling the state copies are planned while the chunk that ends there runs."""
    import shutil

    path = str(tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "ckpt")))
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}, "async_scheduling": async_scheduling}
    with LLM(path, **ENGINE, **spec) as plain:
        answer = plain.generate({"prompt_token_ids": FIRST}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        expected = [rounds(plain, prompt_rounds(answer), p) for p in (GREEDY, SEEDED)]
    with LLM(path, **ENGINE, **CACHING, **spec) as cached:
        for params, ref in zip((GREEDY, SEEDED), expected):
            cached.reset_prefix_cache()
            got = rounds(cached, prompt_rounds(answer), params)
            assert_same_tokens(got, ref)
            assert [c for _, _, c in got[1]][:3] == [20, got[1][1][2], 16] and got[1][1][2] >= 20
        if not async_scheduling:
            _check_metrics(cached, got)


def _check_metrics(llm, last_rounds):
    """LLM.get_metrics (vLLM's reader types): the engine's counters, with prefix caching and MTP."""
    from lamina.engine.metrics_reader import Counter, Gauge, Histogram, Vector

    metrics = {m.name: m for m in llm.get_metrics()}
    engine = llm.engine
    assert isinstance(metrics["vllm:num_requests_running"], Gauge) and metrics["vllm:num_requests_running"].value == 0
    assert metrics["vllm:prompt_tokens"].value == engine.num_prompt_tokens_processed > 0
    assert metrics["vllm:generation_tokens"].value == engine.num_generation_tokens_processed > 0
    hits = metrics["vllm:prefix_cache_hits"]
    assert isinstance(hits, Counter) and hits.value == engine.num_prefix_cache_hits >= sum(c for _, _, c in last_rounds[-1])
    assert metrics["vllm:prefix_cache_queries"].value > hits.value
    steps = metrics["vllm:iteration_tokens_total"]
    assert isinstance(steps, Histogram) and steps.count > 0 and list(steps.buckets)[-1] == "+Inf"
    assert steps.buckets["+Inf"] == steps.count and steps.sum == engine.iteration_tokens.total
    assert metrics["vllm:cache_config_info"].labels["enable_prefix_caching"] == "True"
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and len(per_pos.values) == 2
    assert sum(per_pos.values) == metrics["vllm:spec_decode_num_accepted_tokens"].value
    assert all(m.labels["engine"] == "0" and m.labels["model_name"] for m in metrics.values())


@pytest.mark.parametrize("layout", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)], ids=["pp2", "tp2"])
def test_parallel_layout_gives_single_rank_tokens(qwen3_next_dir, layout):
    """Every rank copies the kept states (its own layers' slots) before its forward."""
    with LLM(str(qwen3_next_dir), **ENGINE) as plain:
        answer = plain.generate({"prompt_token_ids": FIRST}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        expected = rounds(plain, prompt_rounds(answer), SEEDED)
    with LLM(str(qwen3_next_dir), **ENGINE, **CACHING, **layout) as cached:
        got = rounds(cached, prompt_rounds(answer), SEEDED)
    assert_same_tokens(got, expected)
    assert got[1][0][2] == 20


def test_prompt_logprobs_requests_compute_every_position(qwen3_next_dir):
    """A request asking prompt logprobs never starts from a kept prefix (it needs every position)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    with LLM(str(qwen3_next_dir), **ENGINE) as plain:
        expected = plain.generate({"prompt_token_ids": FIRST}, params, use_tqdm=False)[0]
    with LLM(str(qwen3_next_dir), **ENGINE, **CACHING) as cached:
        cached.generate({"prompt_token_ids": FIRST}, GREEDY, use_tqdm=False)
        got = cached.generate({"prompt_token_ids": FIRST}, params, use_tqdm=False)[0]
    assert got.num_cached_tokens == 0
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    for a, b in zip(got.prompt_logprobs, expected.prompt_logprobs, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert {t: lp.logprob for t, lp in a.items()} == pytest.approx({t: lp.logprob for t, lp in b.items()}, abs=1e-5)


def test_cache_salt_keeps_requests_apart(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), **ENGINE, **CACHING) as llm:
        def cached(salt):
            prompt = {"prompt_token_ids": FIRST} if salt is None else {"prompt_token_ids": FIRST, "cache_salt": salt}
            return llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens

        assert [cached("a"), cached("a"), cached("b"), cached(None), cached(None), cached("b")] == [0, 20, 0, 0, 20, 20]
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt_token_ids": FIRST, "cache_salt": 3}, GREEDY, use_tqdm=False)


def test_tiny_cache_evicts_and_preempts(qwen3_next_dir):
    """Kept prefixes give their blocks and slots back to requests that need them: with a cache
    of 12 blocks and 2 slots, requests preempt each other and evict entries, tokens unchanged."""
    prompts = [FIRST, SECOND, FIRST + [1, 2, 3, 4], SECOND[:14]]
    small = dict(ENGINE, max_num_seqs=2, num_gpu_blocks_override=12, max_model_len=48)
    with LLM(str(qwen3_next_dir), **small) as plain:
        expected = rounds(plain, [prompts, prompts[::-1]], GREEDY)
    with LLM(str(qwen3_next_dir), **small, **CACHING) as cached:
        got = rounds(cached, [prompts, prompts[::-1]], GREEDY)
        cache = cached.engine.cache
        assert cached.engine.scheduler.num_preemptions > 0 or cache.prefix.entries
        assert cache.slots.num_free + len(cache.prefix.all_entries()) == cache.slots.num_slots
    assert_same_tokens(got, expected)


# ---- scheduler and cache (no model) -----------------------------------------------------------------
def _request(rid: str, tokens: list[int], **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=3, **params),
                   arrival_index=0, max_tokens=3)


def _scheduler(num_blocks=32, max_num_seqs=4, budget=64, min_tokens=4) -> Scheduler:
    cache = CacheManager(num_blocks, 4, max_num_seqs, prefix_caching=True, prefix_cache_min_tokens=min_tokens)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 128), cache)


def test_last_chunk_stops_one_token_short():
    sched = _scheduler()
    a = _request("a", range(1, 23))  # 22 tokens
    sched.add(a)
    plan = sched.schedule()
    assert [(c.start_position, c.num_tokens, c.sample) for c in plan.chunks] == [(0, 21, False)]
    slot, table = sched.cache.state_slot("a"), sched.cache.block_table("a")
    [entry] = sched.cache.prefix.all_entries()
    assert entry.num_tokens == 21 and entry.blocks[:5] == table[:5] and entry.blocks[5] not in table
    assert all(sched.cache.blocks.refs(b) == 2 for b in table[:5]) and sched.cache.blocks.refs(table[5]) == 1
    _run(sched, plan)
    plan = sched.schedule()  # the last token samples; the copies run before this step's forward
    assert [(c.start_position, c.num_tokens, c.sample) for c in plan.chunks] == [(21, 1, True)]
    assert plan.state_copies == [(slot, entry.slot)] and plan.block_copies == [(table[5], entry.blocks[5])]
    _run(sched, plan)
    # the same prompt again: not before the copies have run (the plan after them), then from 21
    b = _request("b", range(1, 23))
    sched.add(b)
    plan = sched.schedule()
    b_table = sched.cache.block_table("b")
    assert (b.num_computed_tokens, b.num_cached_tokens) == (21, 21)
    assert plan.state_copies == [(entry.slot, sched.cache.state_slot("b"))]
    assert plan.block_copies == [(entry.blocks[5], b_table[5])] and b_table[:5] == entry.blocks[:5]
    assert [(c.request_id, c.start_position, c.num_tokens) for c in plan.chunks][-1] == ("b", 21, 1)


def test_entry_is_not_served_or_evicted_before_its_copy_ran():
    sched = _scheduler(max_num_seqs=3)
    sched.add(_request("a", range(1, 10)))  # boundary 8
    plan = sched.schedule()
    [entry] = sched.cache.prefix.all_entries()
    assert entry.usable_from_step == plan.step_id + 2
    sched.add(_request("b", range(1, 10)))
    _run(sched, plan)
    plan = sched.schedule()  # b may not start from it yet: the copy is only planned now
    b_chunk = next(c for c in plan.chunks if c.request_id == "b")
    assert b_chunk.start_position == 0 and sched.cache.prefix.evictable(plan.step_id) is None


def test_budget_cut_chunks_end_on_block_boundaries_and_short_prefixes_are_not_kept():
    sched = _scheduler(budget=10, min_tokens=12)
    a = _request("a", range(1, 31))
    sched.add(a)
    ends = []
    while True:
        plan = sched.schedule()
        if plan.chunks[0].sample:
            break
        ends.append(plan.chunks[0].end_position)
        _run(sched, plan)
    assert ends == [8, 16, 24, 29]  # a 10-token budget cut to 8; 29: one token short of 30
    assert sorted(e.num_tokens for e in sched.cache.prefix.all_entries()) == [16, 24, 29]  # 8 < 12: not kept


def test_prompt_logprobs_request_does_not_start_from_a_prefix():
    sched = _scheduler()
    sched.add(_request("a", range(1, 10)))
    for _ in range(3):
        _run(sched, sched.schedule())
    sched.add(_request("b", range(1, 10), prompt_logprobs=1))
    plan = sched.schedule()
    assert next(c for c in plan.chunks if c.request_id == "b").start_position == 0


def test_requests_evict_least_recently_used_entries():
    sched = _scheduler(num_blocks=8, max_num_seqs=3, min_tokens=8)
    for rid, first in (("a", 100), ("b", 200)):
        r = _request(rid, range(first, first + 9))
        sched.add(r)
        for _ in range(3):
            _run(sched, sched.schedule())
        sched.finish(r, RequestStatus.FINISHED_STOPPED)
    cache = sched.cache
    assert len(cache.prefix.entries) == 2 and cache.slots.num_free == 1 and cache.usage() == 0.0
    sched.add(_request("x", range(400, 403)))  # takes the free slot (too short to be kept)
    sched.schedule()
    c = _request("c", range(300, 307))  # needs a slot: a's entry (least recently used) goes; c too short to keep
    sched.add(c)
    sched.schedule()
    assert sorted(e.token_ids[0] for e in cache.prefix.all_entries()) == [200]
    cache.reset_prefix_cache()
    in_use = len(cache.block_table("c")) + len(cache.block_table("x"))
    assert not cache.prefix.entries and cache.blocks.num_free == cache.num_blocks - in_use


# ---- server --------------------------------------------------------------------------------------
def test_server_reports_cached_tokens_and_separates_salts(qwen3_next_dir):
    """--enable-prefix-caching --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens
    as vLLM's (only when some came from kept prefixes); a request's cache_salt keeps it apart;
    /metrics counts the lookups and hits."""
    import httpx

    from lamina.entrypoints.openai.serving import FrontendOptions
    from tests.server_harness import MODEL_NAME, RunningServer

    body = {"model": MODEL_NAME, "prompt": FIRST, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    with LLM(str(qwen3_next_dir), **ENGINE, **CACHING) as llm, \
            RunningServer(llm.engine, frontend=FrontendOptions(prompt_tokens_details=True)) as srv:
        def usage(extra=None, stream=False):
            url = f"{srv.base_url}/completions"
            if not stream:
                return httpx.post(url, json=body | (extra or {}), timeout=60).json()["usage"]
            text = httpx.post(url, json=body | (extra or {}) | {"stream": True, "stream_options": {"include_usage": True}},
                              timeout=60).text
            return json.loads([line for line in text.splitlines() if line.startswith("data: {")][-1][6:])["usage"]

        first = usage()
        assert "prompt_tokens_details" not in first
        assert usage()["prompt_tokens_details"] == {"cached_tokens": 20}
        assert usage(stream=True)["prompt_tokens_details"] == {"cached_tokens": 20}
        assert "prompt_tokens_details" not in usage({"cache_salt": "tenant-a"})
        assert usage({"cache_salt": "tenant-a"})["prompt_tokens_details"] == {"cached_tokens": 20}
        bad = httpx.post(f"{srv.base_url}/completions", json=body | {"cache_salt": ""}, timeout=60)
        assert bad.status_code == 400
        metrics = httpx.get(f"{srv.url}/metrics", timeout=60).text
        hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
        assert hits and float(hits[0].split()[-1]) == 60.0
        assert 'enable_prefix_caching="True"' in metrics


def test_usage_counts_blocks_requests_hold():
    """usage(): blocks some request's table holds, once however many share it; blocks only entries
    hold count as free (they are given back on demand)."""
    sched = _scheduler(num_blocks=16)
    a = _request("a", range(1, 10))
    sched.add(a)
    for _ in range(2):
        _run(sched, sched.schedule())
    cache = sched.cache
    assert cache.usage() == len(cache.block_table("a")) / 16
    b = _request("b", range(1, 10))
    sched.add(b)
    sched.schedule()  # b shares a's first two blocks
    shared = set(cache.block_table("a")) | set(cache.block_table("b"))
    assert cache.usage() == len(shared) / 16 < (len(cache.block_table("a")) + len(cache.block_table("b"))) / 16
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    assert cache.usage() == len(cache.block_table("b")) / 16
    sched.finish(b, RequestStatus.FINISHED_STOPPED)
    assert cache.usage() == 0.0 and cache.prefix.entries


def test_beam_search_starts_beams_from_kept_prefixes(qwen3_next_dir):
    """Each beam search step submits every beam's whole sequence: with prefix caching they start
    from the prefixes earlier steps kept, and the beams are the uncached engine's."""
    from lamina.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    prompt = {"prompt_token_ids": FIRST}
    with LLM(str(qwen3_next_dir), **ENGINE) as plain:
        [expected] = plain.beam_search([prompt], params)
    with LLM(str(qwen3_next_dir), **ENGINE, **CACHING) as cached:
        [got] = cached.beam_search([prompt], params)
        assert cached.engine.num_prefix_cache_hits >= 20 * 2 * 2  # every later step's beams, from 20 tokens on
    assert [s.tokens for s in got.sequences] == [s.tokens for s in expected.sequences]
    assert [s.cum_logprob for s in got.sequences] == pytest.approx([s.cum_logprob for s in expected.sequences], abs=1e-4)


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp2"])
def test_gpu_prompt_from_its_kept_prefix_repeats_its_first_run(qwen3_next_dir, tmp_path, mtp):
    """On CUDA (bf16, decode graphs, asynchronous scheduling): a prompt's first run computes [0, P)
    and [P, N) (its last chunk cut one token short, P = N - 1); run again it starts at P from the kept prefix
    (shared blocks, the copied partial block and state): its tokens and logprobs are the first run's,
    bit for bit. The conversation's next turn starts there too. (Exactness against the uncached
    engine is the CPU tests': in bf16 a chunk boundary moves the rounding.)"""
    import shutil

    path = str(tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "ckpt")) if mtp else qwen3_next_dir)
    gpu = dict(device="cuda", dtype="bfloat16", max_model_len=128, show_progress=False)
    if mtp:
        gpu["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 2}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    with LLM(path, **gpu, **CACHING) as llm:
        assert llm.engine.cuda_graphs
        first, again = (llm.generate({"prompt_token_ids": FIRST}, params, use_tqdm=False)[0] for _ in range(2))
        assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 20)
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert again.outputs[0].cumulative_logprob == first.outputs[0].cumulative_logprob
        assert [{t: lp.logprob for t, lp in d.items()} for d in again.outputs[0].logprobs] == \
               [{t: lp.logprob for t, lp in d.items()} for d in first.outputs[0].logprobs]
        turn = FIRST + list(first.outputs[0].token_ids) + [9, 9, 9, 9, 9]
        longer = llm.generate({"prompt_token_ids": turn}, GREEDY, use_tqdm=False)[0]
        assert longer.num_cached_tokens == 20 and len(longer.outputs[0].token_ids) == GREEDY.max_tokens
        assert llm.engine.cache_usage() == 0.0


def _finish(sched: Scheduler, request: Request) -> None:
    """Run plans until the request has sampled its first token, then end it."""
    while not request.output_token_ids:
        _run(sched, sched.schedule())
    sched.finish(request, RequestStatus.FINISHED_STOPPED)


def test_prompts_that_share_only_their_start_cut_once_where_they_part():
    """Junctions: B shares A's first 3 blocks and then differs; nothing of A ended there, so B's
    chunk ends at 12 (a non-sampling chunk end: an entry), and C, with the same start, starts there."""
    sched = _scheduler(min_tokens=8)
    start = list(range(100, 112))  # 3 blocks of 4
    a = _request("a", start + [1, 2, 3, 4, 5, 6, 7])
    sched.add(a)
    _finish(sched, a)
    assert sorted(e.num_tokens for e in sched.cache.prefix.all_entries()) == [18]  # a's last chunk, one token short
    b = _request("b", start + [9, 9, 9, 9, 9, 9])
    sched.add(b)
    plan = sched.schedule()
    assert b.prefix_junction == 12
    assert [(c.start_position, c.num_tokens, c.sample) for c in plan.chunks] == [(0, 12, False)]
    assert 12 in [e.num_tokens for e in sched.cache.prefix.all_entries()]
    _run(sched, plan)
    plan = sched.schedule()  # then on to one token short of its end, as any prompt
    assert [(c.start_position, c.num_tokens) for c in plan.chunks] == [(12, 5)]
    _finish(sched, b)
    c = _request("c", start + [7, 7, 7, 7, 7, 7, 7, 7])
    sched.add(c)
    plan = sched.schedule()
    assert (c.num_cached_tokens, c.prefix_junction) == (12, 12)  # no cut: it starts at its junction
    assert [(ch.start_position, ch.num_tokens) for ch in plan.chunks] == [(12, 7)]


def test_junction_cut_only_worth_min_tokens_and_not_when_held_or_switched_off():
    start = list(range(100, 112))
    for junctions, min_tokens, expected in ((True, 16, 0), (False, 8, 0), (True, 8, 12)):
        cache = CacheManager(32, 4, 4, prefix_caching=True, prefix_cache_min_tokens=min_tokens,
                             prefix_cache_junctions=junctions)
        sched = Scheduler(SchedulerConfig(4, 64, 128), cache)
        a = _request("a", start + [1, 2, 3, 4, 5, 6, 7])
        sched.add(a)
        _finish(sched, a)
        b = _request("b", start + [9, 9, 9, 9, 9, 9])
        sched.add(b)
        plan = sched.schedule()
        assert b.prefix_junction == (12 if junctions else 0)
        cut = plan.chunks[0].num_tokens
        assert cut == (expected or 17), (junctions, min_tokens)  # no junction: one token short of 18
    # B and D in one plan: B's cut keeps the entry at 12, so D (whose junction is 12 too, and which
    # cannot start from an entry made in its own plan) is not cut; a reset forgets the prompts seen
    sched = _scheduler(min_tokens=8)
    a = _request("a", start + [1, 2, 3, 4, 5, 6, 7])
    sched.add(a)
    _finish(sched, a)
    b, d = _request("b", start + [9, 9, 9, 9, 9, 9]), _request("d", start + [4, 4, 4, 4, 4, 4])
    sched.add(b)
    sched.add(d)
    plan = sched.schedule()
    assert (b.prefix_junction, d.prefix_junction) == (12, 12)
    assert [(c.request_id, c.start_position, c.num_tokens) for c in plan.chunks] == [("b", 0, 12), ("d", 0, 17)]
    for r in (b, d):
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert sched.cache.reset_prefix_cache() and not sched.cache.prefix.seen
    e = _request("e", start + [5, 5, 5, 5, 5, 5])
    sched.add(e)
    assert sched.schedule().chunks[0].num_tokens == 17 and e.prefix_junction == 0


def test_reset_drops_entries_and_their_unplanned_copies():
    sched = _scheduler()
    a = _request("a", range(1, 10))
    sched.add(a)
    sched.schedule()  # a's first 8 tokens kept; the copy into the entry's slot is planned by the next plan
    cache = sched.cache
    assert cache.prefix.entries and cache.prefix.pending_state_copies
    assert cache.reset_prefix_cache()
    assert not cache.prefix.entries and not cache.prefix.pending_state_copies
    assert cache.slots.num_free == cache.slots.num_slots - 1  # a's own slot only
    assert all(cache.blocks.refs(b) == 1 for b in cache.block_table("a"))
    assert not sched.schedule().state_copies


# ---- review regressions ----------------------------------------------------------------------------
def _drive(sched: Scheduler, requests: dict, plans: int) -> list:
    """Run plans, ending requests at their max_tokens; each plan's [(request id, start, tokens)]."""
    seen = []
    for _ in range(plans):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        sched.on_step_done(plan)
        seen.append([(c.request_id, c.start_position, c.num_tokens) for c in plan.chunks])
        for c in plan.chunks:
            r = requests[c.request_id]
            if c.sample:
                r.append_output(7)
                if len(r.output_token_ids) >= r.max_tokens:
                    sched.finish(r, RequestStatus.FINISHED_LENGTH)
    return seen


def test_a_prefix_whose_slot_is_the_last_one_is_taken_over():
    """max_num_seqs = 2, one request generating at length, the other slot held by the entry a new
    prompt starts from: the request takes the entry itself over (its slot and blocks, no copies)
    instead of waiting for the long request to end."""
    sched = Scheduler(SchedulerConfig(2, 64, 256), CacheManager(64, 4, 2, prefix_caching=True, prefix_cache_min_tokens=6))
    x, long, b = _request("x", range(1, 11)), _request("long", range(100, 103)), _request("b", range(1, 11))
    x.max_tokens, long.max_tokens, b.max_tokens = 1, 100, 1
    requests = {"x": x, "long": long, "b": b}
    sched.add(x)
    _drive(sched, requests, 3)
    [entry] = sched.cache.prefix.all_entries()
    sched.add(long)
    _drive(sched, requests, 3)
    sched.add(b)
    plan = sched.schedule()
    assert ("b", 9, 1) in [(c.request_id, c.start_position, c.num_tokens) for c in plan.chunks]
    assert b.num_cached_tokens == 9 and not plan.state_copies and not plan.block_copies
    assert sched.cache.state_slot("b") == entry.slot and sched.cache.block_table("b")[:3] == entry.blocks
    assert not sched.cache.prefix.all_entries()


def test_waiting_fork_siblings_keep_their_slot():
    """n = 2 with max_num_seqs = 2: the source's prompt[:-1] is not kept in the slot its sibling forks into."""
    sched = Scheduler(SchedulerConfig(2, 64, 128), CacheManager(64, 4, 2, prefix_caching=True, prefix_cache_min_tokens=4))
    a, b = _request("a", range(1, 21)), _request("b", range(1, 21))
    sched.add_group([a, b])
    seen = _drive(sched, {"a": a, "b": b}, 3)
    assert ("b", 19, 1) in seen[1] and sched.num_forked == 1


def test_num_cached_tokens_is_fixed_at_the_first_admission():
    sched = _scheduler()
    a = _request("a", range(1, 11))
    a.max_tokens = 20
    sched.add(a)
    _drive(sched, {"a": a}, 8)
    assert a.num_cached_tokens == 0 and a.output_token_ids
    for _ in range(2):  # preempted twice, recomputing from the prefixes it kept itself
        sched.running.remove(a)
        sched._preempt(a, sched.schedule())
        _drive(sched, {"a": a}, 2)
    assert a.num_cached_tokens == 0


def test_no_cut_where_no_prefix_can_be_kept():
    """max_num_seqs = 1: no slot is ever free for an entry, so prompts are not cut one token short."""
    sched = Scheduler(SchedulerConfig(1, 64, 128), CacheManager(64, 4, 1, prefix_caching=True, prefix_cache_min_tokens=4))
    for k in range(3):
        r = _request(f"r{k}", range(1, 30))
        r.max_tokens = 1
        sched.add(r)
        assert len(_drive(sched, {r.request_id: r}, 4)) == 1
    assert not sched.cache.prefix.all_entries()


def test_warm_up_leaves_no_prefixes_and_runs_its_step_sizes(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), **ENGINE) as plain:
        plain.engine.warm_up(16)
        expected = [c[0] for c in plain.engine.step_token_counts]
    with LLM(str(qwen3_next_dir), **ENGINE, **CACHING) as cached:
        engine = cached.engine
        engine.step_token_counts.clear()
        steps = []
        original = engine._reset_statistics
        engine._reset_statistics = lambda: steps.extend(c[0] for c in engine.step_token_counts) or original()
        engine.warm_up(16)
        assert steps and not engine.cache.prefix.all_entries() and engine.cache.prefix is not None
        assert engine.num_prefix_cache_queries == engine.num_prefix_cache_hits == 0
    plain_steps = expected or steps
    assert steps == plain_steps

"""`n` / `best_of` children share the prompt's prefill (Scheduler.add_group, StepPlan copies).

The first child prefills `prompt[:-1]`; the others start from copies of its KV blocks and state
slot and every child runs the last prompt token itself. Outputs must equal the unshared path
(`LLMEngine.share_prompt_prefill = False`: every child prefills the whole prompt, the behaviour
before sharing) and, per child, a single request with the child's seed; float32 CPU.
"""

from __future__ import annotations

import pytest

from lamina import LLM, SamplingParams
from lamina.engine.cache_manager import CacheManager
from lamina.engine.request import Request, RequestStatus
from lamina.engine.scheduler import Scheduler, SchedulerConfig
from tests import tiny_checkpoints as tc

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, show_progress=False)
PROMPT = {"prompt_token_ids": [(7 * i + 3) % 990 for i in range(21)]}  # 21 tokens: several blocks of 4
OTHER = {"prompt_token_ids": [5, 6, 7, 8, 9]}
CASES = {
    "seeded_n3": SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True),
    "greedy_n2": SamplingParams(n=2, temperature=0.0, max_tokens=5, ignore_eos=True),
    "best_of3_n2": SamplingParams(n=2, best_of=3, temperature=0.9, top_k=50, seed=5, max_tokens=4,
                                  ignore_eos=True, logprobs=1),
    "prompt_logprobs_n2": SamplingParams(n=2, temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2),
}


@pytest.fixture(scope="module")
def qwen4_exp_dir(tmp_path_factory):
    return tc.make_qwen4_exp(tmp_path_factory.mktemp("q4_fork") / "ckpt")


def generate(llm, share: bool, prompts, params):
    """[(token ids per completion, cumulative logprobs)] per request, with sharing on or off."""
    llm.engine.share_prompt_prefill = share
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.cache_usage() == 0.0 and not llm.engine.has_unfinished_requests()
    return [([c.token_ids for c in o.outputs], [c.cumulative_logprob for c in o.outputs], o.prompt_logprobs)
            for o in outs]


def assert_same(shared, unshared):
    for (tokens, logprobs, prompt), (ref_tokens, ref_logprobs, ref_prompt) in zip(shared, unshared):
        assert tokens == ref_tokens
        for a, b in zip(logprobs, ref_logprobs):
            assert (a is None and b is None) or a == pytest.approx(b, abs=1e-4)
        assert (prompt is None) == (ref_prompt is None)
        for a, b in zip(prompt or [], ref_prompt or []):
            assert (a is None and b is None) or (a.keys() == b.keys() and
                                                 all(a[k] == pytest.approx(b[k], abs=1e-4) for k in a))


# ---- engine -------------------------------------------------------------------------------------
def test_prompt_is_computed_once(qwen3_next_dir):
    """n=4: the prompt's first P-1 tokens once, then one last-token chunk per child, then decodes."""
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=3, ignore_eos=True)
    with LLM(str(qwen3_next_dir), **ENGINE) as llm:
        engine = llm.engine
        counts = {}
        for share in (True, False):
            engine.step_token_counts.clear()
            generate(llm, share, [PROMPT], params)
            counts[share] = [c[0] for c in engine.step_token_counts]
        assert engine.scheduler.num_forked == 3
    p = len(PROMPT["prompt_token_ids"])
    assert counts[True] == [p - 1, 4, 4, 4]  # prefill once, 4 last-token chunks, 2 decode steps
    assert counts[False] == [4 * p, 4, 4]
    assert sum(counts[True]) == (p - 1) + 4 + 4 * 2


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe", "qwen4_exp"])
def test_outputs_equal_unshared_path(arch, request):
    """Seeded, greedy and best_of < n children: tokens (and logprobs) as when every child prefills
    the prompt itself; chunked prefill (budget 8) mixed with another request and its decodes."""
    path = request.getfixturevalue(f"{arch}_dir")
    with LLM(str(path), block_size=4, max_num_batched_tokens=8, **ENGINE) as llm:
        for name, params in CASES.items():
            prompts = [OTHER, PROMPT, PROMPT]
            plist = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), params,
                     SamplingParams(n=2, temperature=0.0, max_tokens=3, ignore_eos=True)]
            shared = generate(llm, True, prompts, plist)
            unshared = generate(llm, False, prompts, plist)
            assert_same(shared, unshared)
            tokens = shared[1][0]
            if params.temperature == 0.0:
                assert all(t == tokens[0] for t in tokens)
            elif name == "seeded_n3":  # child i is the request with seed + i, alone
                for i, t in enumerate(tokens):
                    single = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=5,
                                                                 ignore_eos=True), use_tqdm=False)
                    assert single[0].outputs[0].token_ids == t
        assert llm.engine.scheduler.num_forked > 0


PREEMPTION_CASES = {
    # forked children preempted (one in its own fork step), a child the cache cannot take at fork time
    "children": ([{"prompt_token_ids": PROMPT["prompt_token_ids"][:13]}, OTHER, {"prompt_token_ids": [40, 41, 42, 43, 44, 45]}],
                 [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                  SamplingParams(n=2, temperature=0.0, max_tokens=5, ignore_eos=True)], 8),
    # the first child preempted again and again while it prefills (a growing decode needs its blocks)
    "source": ([OTHER, {"prompt_token_ids": PROMPT["prompt_token_ids"] + [1, 2, 3, 4]}],
               [SamplingParams(temperature=0.0, max_tokens=26, ignore_eos=True),
                SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)], 4),
}


@pytest.mark.parametrize("case", list(PREEMPTION_CASES))
def test_preemption_with_a_tiny_cache(qwen3_next_dir, case):
    """A cache of 8 blocks of 4 tokens (32 tokens: about one sequence): sources and forked children
    are preempted and recomputed, children the cache cannot take prefill alone; same outputs as
    without sharing and as without preemption, and the cache is empty at the end."""
    prompts, params, budget = PREEMPTION_CASES[case]
    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=32, block_size=4,
             num_gpu_blocks_override=8, max_num_batched_tokens=budget, show_progress=False) as llm:
        preempted = []
        schedule = llm.engine.scheduler.schedule

        def watched(*args):
            plan = schedule(*args)
            preempted.extend(plan.preempted_request_ids)
            return plan

        llm.engine.scheduler.schedule = watched
        shared = generate(llm, True, prompts, params)
        if case == "source":
            assert "1#0" in preempted
        else:
            assert "0#1" in preempted and llm.engine.scheduler.num_forked > 0
        unshared = generate(llm, False, prompts, params)
    with LLM(str(qwen3_next_dir), **ENGINE) as roomy:  # no preemption at all
        reference = generate(roomy, False, prompts, params)
    assert_same(shared, unshared)
    assert_same(shared, reference)


def test_abort_before_and_after_fork(qwen3_next_dir):
    """Aborted while the first child prefills, after the fork, and by one child's id (`<id>#1`:
    the whole request ends; aborted alone, that child never finished and its parent stayed for
    ever, holding its id): every block and slot comes back, no parent is left, the id is free."""
    with LLM(str(qwen3_next_dir), max_num_batched_tokens=8, **ENGINE) as llm:
        engine = llm.engine
        for steps, suffix in ((1, ""), (4, ""), (4, "#1")):
            rid = engine.add_request(PROMPT, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=20),
                                     request_id="forked")
            for _ in range(steps):
                engine.step()
            engine.abort_request(rid + suffix)
            while engine.has_unfinished_requests():
                engine.step()
            assert engine.cache_usage() == 0.0
            assert engine.cache.slots.num_free == engine.cache.slots.num_slots
            assert not engine._parents and not engine._parent_of, (engine._parents, engine._parent_of)


@pytest.mark.parametrize("layout", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)], ids=["pp2", "tp2"])
def test_parallel_layout_gives_single_rank_tokens(qwen3_next_dir, layout):
    """Every rank (both stages; both TP shards) applies the plan's copies before its forward."""
    params = [SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=4, ignore_eos=True),
              SamplingParams(n=3, temperature=0.0, max_tokens=4, ignore_eos=True)]
    prompts = [PROMPT, OTHER]
    with LLM(str(qwen3_next_dir), block_size=4, max_num_batched_tokens=16, **ENGINE) as llm:
        expected = generate(llm, False, prompts, params)
    with LLM(str(qwen3_next_dir), block_size=4, max_num_batched_tokens=16, debug_layouts=True, **ENGINE, **layout) as llm:
        got = generate(llm, True, prompts, params)
        assert llm.engine.scheduler.num_forked == 4
    assert [t[0] for t in got] == [t[0] for t in expected]


# ---- scheduler (no model) ------------------------------------------------------------------------
def _requests(n: int, prompt_len: int = 10) -> list[Request]:
    return [Request(request_id=f"r#{i}", prompt_token_ids=list(range(1, prompt_len + 1)),
                    sampling_params=SamplingParams(max_tokens=3), arrival_index=i, max_tokens=3) for i in range(n)]


def _scheduler(num_blocks=16, max_num_seqs=4, budget=64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 64), CacheManager(num_blocks, 4, max_num_seqs))


def _advance(sched: Scheduler, plan) -> None:
    sched.on_step_done(plan)
    for chunk in plan.chunks:
        if chunk.sample:
            next(r for r in sched.running if r.request_id == chunk.request_id).append_output(5)


def test_fork_plan_copies_blocks_and_slots():
    sched = _scheduler()
    reqs = _requests(3)
    sched.add_group(reqs)
    assert sched.num_waiting == 3
    plan = sched.schedule()
    assert [(c.request_id, c.num_tokens, c.sample) for c in plan.chunks] == [("r#0", 9, False)]
    assert not plan.has_copies
    _advance(sched, plan)
    plan = sched.schedule()
    src_table, src_slot = sched.cache.block_table("r#0"), sched.cache.state_slot("r#0")
    assert [(c.request_id, c.start_position, c.num_tokens, c.sample) for c in plan.chunks] == [
        ("r#0", 9, 1, True), ("r#1", 9, 1, True), ("r#2", 9, 1, True)]
    expected_blocks, expected_slots = [], []
    for rid in ("r#1", "r#2"):
        table = sched.cache.block_table(rid)
        assert len(table) == 3 and not set(table) & set(src_table)
        expected_blocks += list(zip(src_table[:3], table[:3]))  # 9 shared tokens: 3 blocks of 4
        expected_slots.append((src_slot, sched.cache.state_slot(rid)))
    assert plan.block_copies == expected_blocks and plan.state_copies == expected_slots
    _advance(sched, plan)
    assert not sched.schedule().has_copies
    for r in list(sched.running):
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert sched.cache.usage() == 0.0 and not sched.has_unfinished()


def test_children_the_cache_cannot_take_prefill_themselves():
    sched = _scheduler(max_num_seqs=2)  # two slots: one child forks, the third waits and prefills
    sched.add_group(_requests(3))
    plan = sched.schedule()
    _advance(sched, plan)
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks] == ["r#0", "r#1"] and len(plan.state_copies) == 1
    assert [r.request_id for r in sched.waiting] == ["r#2"] and sched.waiting[0].num_computed_tokens == 0


def test_source_preempted_or_aborted_before_the_fork():
    sched = _scheduler(budget=4)
    reqs = _requests(3)
    sched.add_group(reqs)
    plan = sched.schedule()
    _advance(sched, plan)
    sched._preempt(sched.running.pop(), plan)  # as the scheduler does when blocks run out
    assert reqs[0].num_computed_tokens == 0 and sched.num_waiting == 3
    while reqs[0].num_computed_tokens < 9:
        plan = sched.schedule()
        assert [c.request_id for c in plan.chunks] == ["r#0"] and not plan.has_copies
        _advance(sched, plan)
    assert len(sched.schedule().state_copies) == 2
    # abort of the source while it prefills: its siblings queue up and prefill themselves
    sched = _scheduler(budget=4)
    reqs = _requests(3)
    sched.add_group(reqs)
    _advance(sched, sched.schedule())
    sched.finish(reqs[0], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.waiting] == ["r#1", "r#2"]
    plan = sched.schedule()
    assert [(c.request_id, c.start_position) for c in plan.chunks] == [("r#1", 0)] and not plan.has_copies


def test_with_mtp_speculative_decoding(qwen3_next_dir, tmp_path):
    """The MTP drafter's paged cache is copied too: forked children verify and draft as unshared ones."""
    import shutil

    path = tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "ckpt"))
    params = [SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=6, ignore_eos=True),
              SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)]
    with LLM(str(path), block_size=4, max_num_batched_tokens=8, **ENGINE,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        shared = generate(llm, True, [PROMPT, OTHER], params)
        assert llm.engine.scheduler.num_forked == 3
        unshared = generate(llm, False, [PROMPT, OTHER], params)
    assert_same(shared, unshared)

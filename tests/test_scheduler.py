"""Unit tests for the continuous-batching scheduler (lamina/engine/scheduler.py).

No model: `Sim` plays the engine loop of `LLMEngine.step()` (schedule -> execute -> on_step_done ->
append one sampled token per `sample` chunk -> finish on length) with a fake model whose "KV
cache" is the list of tokens it was fed per request, and whose next token is a hash of that list.
So a request whose cache was lost (preemption) and recomputed must produce exactly the tokens
it would have produced without interruption.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from lamina.engine.cache_manager import CacheManager
from lamina.engine.request import Request, RequestStatus
from lamina.engine.scheduler import Scheduler, SchedulerConfig
from lamina.step_plan import StepPlan
from lamina.sampling_params import SamplingParams


def fake_next_token(seq: list[int]) -> int:
    h = 7
    for t in seq:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return 1000 + h % 50_000


def reference_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(max_tokens):
        tok = fake_next_token(seq)
        out.append(tok)
        seq.append(tok)
    return out


def make_request(rid: str, prompt: list[int] | int, max_tokens: int = 4, arrival: int = 0) -> Request:
    if isinstance(prompt, int):
        prompt = [10 + i for i in range(prompt)]
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        arrival_index=arrival,
        max_tokens=max_tokens,
    )


class Sim:
    """The engine loop around a Scheduler, with invariants checked at every step."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int = 10_000,
        num_state_slots: int | None = None,
        token_history_len: int = 0,
    ):
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, token_history_len)
        self.cache = CacheManager(num_blocks, block_size, num_state_slots or max_num_seqs)
        self.sched = Scheduler(self.config, self.cache)
        self.requests: dict[str, Request] = {}
        self.arrivals = itertools.count()
        self.kv: dict[str, list[int]] = {}  # the fake model's cache per request
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}
        self.finished: list[str] = []
        self.reported_finished: list[str] = []
        self.plans: list[StepPlan] = []
        self.num_steps = 0

    # ---- requests ----
    def add(self, rid: str, prompt: list[int] | int, max_tokens: int = 4) -> Request:
        req = make_request(rid, prompt, max_tokens, next(self.arrivals))
        self.requests[rid] = req
        self.sched.add(req)
        return req

    def abort(self, rid: str) -> None:
        req = self.requests[rid]
        if not req.status.finished:
            self.sched.finish(req, RequestStatus.FINISHED_ABORTED)
            self.finished.append(rid)

    # ---- one engine step ----
    def step(self) -> StepPlan:
        running_before = list(self.sched.running)
        waiting_before = list(self.sched.waiting)
        plan = self.sched.schedule()
        self.num_steps += 1
        self.plans.append(plan)
        self.check_plan(plan, running_before, waiting_before)

        for rid in plan.finished_request_ids:
            self.kv.pop(rid, None)
        for rid in plan.preempted_request_ids:
            self.kv.pop(rid, None)
        self.reported_finished += plan.finished_request_ids
        if plan.is_empty:
            self.check_invariants()
            return plan

        # "execute": the fake model extends its cache and samples where asked
        sampled: dict[str, int] = {}
        for chunk in plan.chunks:
            kv = self.kv.setdefault(chunk.request_id, [])
            assert chunk.start_position == len(kv), "chunk does not continue the cached tokens"
            if chunk.start_position > 0:
                prev = self.tables[chunk.request_id]
                assert chunk.block_table[: len(prev)] == prev, "blocks of cached tokens moved"
                assert chunk.state_slot == self.slots[chunk.request_id], "state slot changed mid-request"
            self.tables[chunk.request_id] = list(chunk.block_table)
            self.slots[chunk.request_id] = chunk.state_slot
            kv.extend(chunk.token_ids)
            if chunk.sample:
                sampled[chunk.request_id] = fake_next_token(kv)

        self.sched.on_step_done(plan)
        for chunk in plan.chunks:
            req = self.requests[chunk.request_id]
            assert req.num_computed_tokens == chunk.end_position
        # mirror LLMEngine.step(): append, then stop checks (length only here)
        for chunk in plan.chunks:
            tok = sampled.get(chunk.request_id)
            if tok is None:
                continue
            req = self.requests[chunk.request_id]
            req.append_output(tok)
            if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
                self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
                self.finished.append(req.request_id)
        self.check_invariants()
        return plan

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_unfinished():
            assert self.num_steps < max_steps, "no progress (livelock?)"
            self.step()

    # ---- checks ----
    def check_plan(self, plan: StepPlan, running_before: list[Request], waiting_before: list[Request]) -> None:
        cfg, cache = self.config, self.cache
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        assert len(plan.chunks) <= cfg.max_num_seqs
        ids = [c.request_id for c in plan.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert all(c.num_tokens > 0 for c in plan.chunks), "empty chunk"
        running_ids = {r.request_id for r in self.sched.running}
        assert set(ids) <= running_ids
        before_ids = [r.request_id for r in running_before]
        if plan.preempted_request_ids:
            # no admissions in a step that preempted
            assert set(ids) <= set(before_ids)
            # victims are the most recently arrived running requests, latest first
            k = len(plan.preempted_request_ids)
            assert plan.preempted_request_ids == before_ids[::-1][:k]
            # ... and they now head the waiting queue in arrival order
            head = [r.request_id for r in list(self.sched.waiting)[:k]]
            assert head == plan.preempted_request_ids[::-1]
            for rid in plan.preempted_request_ids:
                req = self.requests[rid]
                assert req.status == RequestStatus.WAITING
                assert req.num_computed_tokens == 0
                assert not cache.has(rid)
                assert rid not in ids
        # admissions are FCFS: the newly admitted are a prefix of the waiting queue
        admitted = [rid for rid in ids if rid not in before_ids]
        assert admitted == [r.request_id for r in waiting_before[: len(admitted)]]
        # running requests are served in arrival order, before new admissions
        order = [self.requests[rid].arrival_index for rid in ids]
        assert order == sorted(order)
        for c in plan.chunks:
            req = self.requests[c.request_id]
            assert c.start_position + c.num_tokens <= req.num_tokens
            assert c.token_ids == req.all_token_ids[c.start_position : c.end_position]
            assert c.sample == (c.end_position == req.num_tokens)
            assert len(c.block_table) * cache.block_size >= c.end_position
            assert c.block_table == cache.block_table(c.request_id)
            assert c.state_slot == cache.state_slot(c.request_id)
            assert c.num_output_tokens == len(req.output_token_ids)
            assert c.sampling_params is req.sampling_params
            h = cfg.token_history_len
            assert c.history_token_ids == req.all_token_ids[max(0, c.start_position - h) : c.start_position]
        # a step never idles while there is work (admission from an empty batch always fits)
        if running_before or waiting_before:
            assert not plan.is_empty, "nothing scheduled while requests are pending"

    def check_invariants(self) -> None:
        cache, sched = self.cache, self.sched
        owner: dict[int, str] = {}
        for rid, table in cache._tables.items():
            for b in table:
                assert b not in owner, f"block {b} owned by {owner[b]} and {rid}"
                owner[b] = rid
        free = list(cache.blocks._free)
        assert len(free) == len(set(free))
        assert not set(free) & set(owner)
        assert len(free) + len(owner) == cache.num_blocks
        assert cache.usage() == pytest.approx(len(owner) / cache.num_blocks)
        slots = list(cache._slot_of.values())
        assert len(slots) == len(set(slots))
        assert len(slots) + cache.slots.num_free == cache.slots.num_slots
        running_ids = {r.request_id for r in sched.running}
        waiting_ids = [r.request_id for r in sched.waiting]
        assert not running_ids & set(waiting_ids)
        assert len(sched.running) <= self.config.max_num_seqs
        # only running requests hold cache, and they hold exactly one table + slot
        assert set(cache._tables) == running_ids
        assert set(cache._slot_of) == running_ids
        for req in sched.running:
            assert req.status == RequestStatus.RUNNING
            assert len(cache.block_table(req.request_id)) * cache.block_size >= req.num_computed_tokens
            assert req.num_computed_tokens <= req.num_tokens
        for req in sched.waiting:
            assert req.status == RequestStatus.WAITING
            assert req.num_computed_tokens == 0
        # running (oldest first) all arrived before the waiting queue (oldest first)
        arrivals = [r.arrival_index for r in sched.running] + [r.arrival_index for r in sched.waiting]
        assert arrivals == sorted(arrivals)
        for rid in self.finished:
            req = self.requests[rid]
            assert req.status.finished
            assert rid not in running_ids and rid not in waiting_ids
            assert not cache.has(rid)


def chunk_of(plan: StepPlan, rid: str):
    found = [c for c in plan.chunks if c.request_id == rid]
    assert len(found) <= 1
    return found[0] if found else None


# ---- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(max_num_seqs=0, max_num_batched_tokens=8, max_model_len=8), "max_num_seqs"),
        (dict(max_num_seqs=-1, max_num_batched_tokens=8, max_model_len=8), "max_num_seqs"),
        (dict(max_num_seqs=1, max_num_batched_tokens=0, max_model_len=8), "max_num_batched_tokens"),
        (dict(max_num_seqs=1, max_num_batched_tokens=-5, max_model_len=8), "max_num_batched_tokens"),
        (dict(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=0), "max_model_len"),
        (dict(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8, token_history_len=-1), "token_history_len"),
    ],
)
def test_config_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**kwargs)


def test_config_valid_and_frozen():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1, token_history_len=0)
    assert cfg.token_history_len == 0
    assert SchedulerConfig(4, 16, 32).token_history_len == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 2  # type: ignore[misc]


# ---- basics -----------------------------------------------------------------------------------------


def test_empty_scheduler_plans_nothing():
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    assert not sim.sched.has_unfinished()
    plan = sim.step()
    assert plan.is_empty and plan.finished_request_ids == [] and plan.preempted_request_ids == []
    assert sim.step().step_id == plan.step_id + 1


def test_single_request_prefill_then_decodes_and_finish():
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    req = sim.add("a", 5, max_tokens=6)
    assert sim.sched.num_waiting == 1 and sim.sched.has_unfinished()

    plan = sim.step()
    (c,) = plan.chunks
    assert c.request_id == "a" and c.start_position == 0 and c.token_ids == req.prompt_token_ids
    assert c.sample and c.num_output_tokens == 0 and len(c.block_table) == 2
    assert req.status == RequestStatus.RUNNING and sim.sched.num_running == 1 and sim.sched.num_waiting == 0
    assert req.num_computed_tokens == 5 and len(req.output_token_ids) == 1

    table_lens = []
    for i in range(1, 6):
        plan = sim.step()
        (c,) = plan.chunks
        assert c.start_position == 4 + i
        assert c.token_ids == [req.output_token_ids[i - 1]]
        assert c.sample and c.num_output_tokens == i
        table_lens.append(len(c.block_table))
    # positions 5..9 computed: the third block is taken when position 8 is computed
    assert table_lens == [2, 2, 2, 3, 3]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == reference_outputs(req.prompt_token_ids, 6)
    assert sim.cache.usage() == 0.0 and not sim.cache.has("a")
    assert not sim.sched.has_unfinished()

    plan = sim.step()
    assert plan.is_empty and plan.finished_request_ids == ["a"]
    assert sim.step().finished_request_ids == [], "a finished id is reported once"


def test_plan_block_table_is_a_snapshot():
    sim = Sim(num_blocks=8, block_size=2, max_num_seqs=1, max_num_batched_tokens=8)
    sim.add("a", 2, max_tokens=4)
    first = sim.step().chunks[0]
    snapshot = list(first.block_table)
    sim.step()
    sim.step()
    assert first.block_table == snapshot
    assert len(sim.cache.block_table("a")) > len(snapshot)


def test_fcfs_admission_order_and_max_num_seqs_cap():
    # more state slots than max_num_seqs, so the cap itself is what limits the batch
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=100, num_state_slots=8)
    a = sim.add("a", 3, max_tokens=2)
    b = sim.add("b", 3, max_tokens=5)
    c = sim.add("c", 3, max_tokens=3)
    d = sim.add("d", 3, max_tokens=1)

    plan = sim.step()
    assert [ch.request_id for ch in plan.chunks] == ["a", "b"]
    assert [r.request_id for r in sim.sched.waiting] == ["c", "d"]
    plan = sim.step()  # a finishes here (2 tokens)
    assert [ch.request_id for ch in plan.chunks] == ["a", "b"]
    assert a.status == RequestStatus.FINISHED_LENGTH
    plan = sim.step()
    assert plan.finished_request_ids == ["a"]
    assert [ch.request_id for ch in plan.chunks] == ["b", "c"], "c (earlier) is admitted before d"
    assert chunk_of(plan, "c").start_position == 0
    sim.run()
    for r in (a, b, c, d):
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.max_tokens)
    assert all(len(p.chunks) <= 2 for p in sim.plans)


def test_admission_stops_at_first_request_that_does_not_fit():
    # FCFS: a small request behind a big one that does not fit is not let past it
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=100)
    sim.add("a", 8, max_tokens=8)  # 2 blocks now
    sim.add("b", 12, max_tokens=2)  # 3 blocks: does not fit next to a
    sim.add("c", 1, max_tokens=2)  # would fit
    plan = sim.step()
    assert [ch.request_id for ch in plan.chunks] == ["a"]
    assert [r.request_id for r in sim.sched.waiting] == ["b", "c"]
    sim.run()
    assert set(sim.finished) == {"a", "b", "c"}


def test_state_slots_limit_admission_and_are_reused():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=100, num_state_slots=1)
    sim.add("a", 3, max_tokens=2)
    sim.add("b", 3, max_tokens=2)
    plan = sim.step()
    assert [ch.request_id for ch in plan.chunks] == ["a"]
    slot_a = plan.chunks[0].state_slot
    sim.step()  # a finishes
    plan = sim.step()
    assert [ch.request_id for ch in plan.chunks] == ["b"]
    assert plan.chunks[0].state_slot == slot_a
    sim.run()


# ---- token budget, chunked prefill ------------------------------------------------------------------


def test_chunked_prefill_splits_long_prompt():
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=4)
    req = sim.add("a", 10, max_tokens=3)
    spans = []
    for _ in range(3):
        (c,) = sim.step().chunks
        spans.append((c.start_position, c.token_ids, c.sample))
    p = req.prompt_token_ids
    assert spans == [(0, p[0:4], False), (4, p[4:8], False), (8, p[8:10], True)]
    assert len(req.output_token_ids) == 1
    (c,) = sim.step().chunks
    assert c.start_position == 10 and c.token_ids == [req.output_token_ids[0]] and c.sample
    sim.run()
    assert req.output_token_ids == reference_outputs(p, 3)


def test_decodes_mixed_with_new_prefill_chunk():
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=6)
    a = sim.add("a", 2, max_tokens=10)
    b = sim.add("b", 3, max_tokens=10)
    plan = sim.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 2), ("b", 3)]
    c_req = sim.add("c", 9, max_tokens=3)
    plan = sim.step()
    # two decodes first, then c's first chunk takes the rest of the budget
    assert [(c.request_id, c.num_tokens, c.sample) for c in plan.chunks] == [
        ("a", 1, True), ("b", 1, True), ("c", 4, False)
    ]
    assert plan.num_tokens == 6
    plan = sim.step()
    assert [(c.request_id, c.num_tokens, c.sample) for c in plan.chunks] == [
        ("a", 1, True), ("b", 1, True), ("c", 4, False)
    ]
    assert chunk_of(plan, "c").start_position == 4
    plan = sim.step()
    assert [(c.request_id, c.num_tokens, c.sample) for c in plan.chunks] == [
        ("a", 1, True), ("b", 1, True), ("c", 1, True)
    ]
    assert chunk_of(plan, "c").token_ids == c_req.prompt_token_ids[8:]
    sim.run()
    for r in (a, b, c_req):
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.max_tokens)


def test_budget_taken_by_running_requests_blocks_admission():
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=2)
    sim.add("a", 1, max_tokens=5)
    sim.add("b", 1, max_tokens=5)
    sim.add("c", 1, max_tokens=5)
    plan = sim.step()
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    for _ in range(3):
        plan = sim.step()
        assert [c.request_id for c in plan.chunks] == ["a", "b"]
        assert [r.request_id for r in sim.sched.waiting] == ["c"]
    sim.run()
    assert all(p.num_tokens <= 2 for p in sim.plans)


def test_unfinished_prefill_is_continued_before_new_admissions():
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=5)
    sim.add("a", 12, max_tokens=2)
    sim.add("b", 2, max_tokens=2)
    plan = sim.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 5)]
    plan = sim.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 5)]
    plan = sim.step()
    assert [(c.request_id, c.start_position, c.num_tokens) for c in plan.chunks] == [("a", 10, 2), ("b", 0, 2)]
    sim.run()


def test_budget_of_one_token():
    sim = Sim(num_blocks=32, block_size=2, max_num_seqs=3, max_num_batched_tokens=1)
    reqs = [sim.add(f"r{i}", 3, max_tokens=3) for i in range(3)]
    sim.run(max_steps=200)
    assert all(p.num_tokens == 1 for p in sim.plans if not p.is_empty)
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, 3)


# ---- token history -----------------------------------------------------------------------------------


def test_token_history_across_chunks_and_decodes():
    H = 3
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=3, token_history_len=H)
    req = sim.add("a", 7, max_tokens=4)
    p = req.prompt_token_ids
    hist = [sim.step().chunks[0].history_token_ids for _ in range(3)]
    assert hist == [[], p[0:3], p[3:6]]
    (c,) = sim.step().chunks  # first decode: history crosses prompt / output
    assert c.token_ids == [req.output_token_ids[0]]
    assert c.history_token_ids == p[4:7]
    (c,) = sim.step().chunks
    assert c.history_token_ids == p[5:7] + req.output_token_ids[:1]
    sim.run()


def test_token_history_shorter_at_start_and_zero_len():
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=2, token_history_len=5)
    req = sim.add("a", 4, max_tokens=2)
    c1 = sim.step().chunks[0]
    c2 = sim.step().chunks[0]
    assert c1.history_token_ids == [] and c2.history_token_ids == req.prompt_token_ids[:2]
    sim0 = Sim(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=2)
    sim0.add("a", 4, max_tokens=3)
    sim0.run()
    assert all(c.history_token_ids == [] for p in sim0.plans for c in p.chunks)


# ---- preemption -------------------------------------------------------------------------------------


def test_preemption_of_most_recent_request_and_recompute():
    # block_size 1 keeps the arithmetic obvious: blocks == tokens
    sim = Sim(num_blocks=6, block_size=1, max_num_seqs=2, max_num_batched_tokens=3, token_history_len=2)
    a = sim.add("a", 2, max_tokens=3)
    b = sim.add("b", 1, max_tokens=4)

    plan = sim.step()  # a: 2, b: 1 -> 3 blocks
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 2), ("b", 1)]
    plan = sim.step()  # decodes -> 5 blocks
    assert not plan.preempted_request_ids
    assert b.num_computed_tokens == 2 and len(b.output_token_ids) == 2
    b_tokens_before = list(b.all_token_ids)

    plan = sim.step()  # a takes the last block; b cannot grow -> b (most recent) is preempted
    assert plan.preempted_request_ids == ["b"]
    assert [c.request_id for c in plan.chunks] == ["a"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sim.sched.num_preemptions == 1
    assert sim.sched.num_preemption_recompute_tokens == 2, "b's 2 computed tokens are to be computed again"
    assert not sim.cache.has("b")
    assert list(sim.sched.waiting) == [b]
    assert b.all_token_ids == b_tokens_before, "preemption keeps the generated tokens"
    # the freed blocks and the budget would let b's first chunk in, but no admission in a preempting step
    assert sim.cache.blocks.num_free >= 2 and plan.num_tokens == 1
    assert a.status == RequestStatus.FINISHED_LENGTH

    plan = sim.step()  # a's blocks are back: b is recomputed over prompt + its 2 outputs
    assert plan.finished_request_ids == ["a"]
    assert plan.preempted_request_ids == []
    (c,) = plan.chunks
    assert c.request_id == "b" and c.start_position == 0
    assert c.token_ids == b_tokens_before == b.all_token_ids[:3]
    assert c.sample and c.num_output_tokens == 2 and c.history_token_ids == []
    assert len(b.output_token_ids) == 3
    plan = sim.step()
    (c,) = plan.chunks
    assert c.start_position == 3 and c.history_token_ids == b.all_token_ids[1:3]
    sim.run()
    assert a.output_token_ids == reference_outputs(a.prompt_token_ids, 3)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 4)
    assert sim.cache.usage() == 0.0


def test_preemption_pops_several_victims_latest_first():
    # a, b, c each hold 2 blocks of 2 tokens (4 tokens). a's growth needs 1 block: c is preempted.
    sim = Sim(num_blocks=6, block_size=2, max_num_seqs=3, max_num_batched_tokens=100, max_model_len=12)
    a = sim.add("a", 3, max_tokens=9)
    b = sim.add("b", 3, max_tokens=9)
    c = sim.add("c", 3, max_tokens=9)
    d = sim.add("d", 1, max_tokens=1)
    sim.step()  # all three prefilled: 2 blocks each, 4 tokens each
    assert sim.cache.blocks.num_free == 0
    plan = sim.step()  # each computes position 3 (still 2 blocks)
    assert not plan.preempted_request_ids
    plan = sim.step()  # a needs a third block -> c (most recent) preempted; its 2 blocks cover a's and b's growth
    assert plan.preempted_request_ids == ["c"]
    assert [ch.request_id for ch in plan.chunks] == ["a", "b"]
    assert [r.request_id for r in sim.sched.waiting] == ["c", "d"]
    plan = sim.step()  # a and b compute position 5: still 3 blocks each
    assert not plan.preempted_request_ids
    plan = sim.step()  # a needs a fourth block: now b is the most recent running request
    assert plan.preempted_request_ids == ["b"]
    assert [ch.request_id for ch in plan.chunks] == ["a"]
    assert [r.request_id for r in sim.sched.waiting] == ["b", "c", "d"], "preempted go back in arrival order"
    for r in (b, c):
        assert r.num_computed_tokens == 0 and not sim.cache.has(r.request_id)
    sim.run()
    for r in (a, b, c, d):
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.max_tokens)
    assert c.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0


def test_two_victims_in_one_step():
    # four 2-token prompts fill the 4 blocks; on the next step a and b each need a block:
    # a's need preempts d, b's need preempts c, in that order.
    sim = Sim(num_blocks=4, block_size=2, max_num_seqs=4, max_num_batched_tokens=100, max_model_len=8)
    reqs = [sim.add(rid, 2, max_tokens=5) for rid in "abcd"]
    plan = sim.step()
    assert [ch.request_id for ch in plan.chunks] == ["a", "b", "c", "d"]
    assert sim.cache.blocks.num_free == 0
    plan = sim.step()
    assert plan.preempted_request_ids == ["d", "c"]
    assert [ch.request_id for ch in plan.chunks] == ["a", "b"]
    assert [r.request_id for r in sim.sched.waiting] == ["c", "d"]
    assert sim.sched.num_preemptions == 2
    sim.run()
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, 5)
    assert reqs[0].num_preemptions == 0


def test_request_preempting_itself_when_alone_cannot_grow():
    # a lone request that outgrows the whole cache preempts itself (misconfiguration guard path)
    sim = Sim(num_blocks=2, block_size=2, max_num_seqs=2, max_num_batched_tokens=100)
    a = sim.add("a", 4, max_tokens=3)
    plan = sim.step()
    assert [c.request_id for c in plan.chunks] == ["a"]
    plan = sim.sched.schedule()
    assert plan.preempted_request_ids == ["a"] and plan.is_empty
    assert list(sim.sched.waiting) == [a] and a.num_computed_tokens == 0
    assert sim.cache.usage() == 0.0 and not sim.cache.has("a")


# ---- finish / abort ---------------------------------------------------------------------------------


def test_finish_running_frees_everything_and_reports_once():
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    a = sim.add("a", 6, max_tokens=10)
    b = sim.add("b", 2, max_tokens=10)
    sim.step()
    sim.step()
    used = sim.cache.blocks.num_free
    slot_a = sim.cache.state_slot("a")
    sim.abort("a")
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert not sim.cache.has("a") and sim.cache.blocks.num_free == used + 2
    assert sim.cache.slots.num_free == 1
    assert sim.sched.running == [b]
    plan = sim.step()
    assert plan.finished_request_ids == ["a"]
    assert [c.request_id for c in plan.chunks] == ["b"]
    c = sim.add("c", 3, max_tokens=1)
    plan = sim.step()
    assert plan.finished_request_ids == []
    assert chunk_of(plan, "c").state_slot == slot_a
    sim.run()
    assert c.status == RequestStatus.FINISHED_LENGTH


def test_finish_waiting_request():
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=1, max_num_batched_tokens=32)
    sim.add("a", 3, max_tokens=3)
    b = sim.add("b", 3, max_tokens=3)
    sim.step()
    sim.abort("b")
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert sim.sched.num_waiting == 0
    plan = sim.step()
    assert plan.finished_request_ids == ["b"]
    sim.run()
    assert b.output_token_ids == []


def test_finish_preempted_request_while_waiting():
    sim = Sim(num_blocks=6, block_size=1, max_num_seqs=2, max_num_batched_tokens=3)
    sim.add("a", 2, max_tokens=3)
    b = sim.add("b", 1, max_tokens=4)
    sim.step()
    sim.step()
    plan = sim.step()
    assert plan.preempted_request_ids == ["b"]
    sim.abort("b")
    assert sim.sched.num_waiting == 0 and not sim.cache.has("b")
    sim.run()
    sim.step()
    assert sorted(sim.reported_finished) == ["a", "b"] and len(b.output_token_ids) == 2


def test_finish_between_schedule_and_on_step_done():
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    a = sim.add("a", 3, max_tokens=3)
    plan = sim.sched.schedule()
    sim.sched.finish(a, RequestStatus.FINISHED_ERROR)
    sim.sched.on_step_done(plan)  # must ignore the finished request
    assert a.num_computed_tokens == 0
    assert not sim.sched.has_unfinished() and sim.cache.usage() == 0.0
    assert sim.sched.schedule().finished_request_ids == ["a"]


# ---- randomized simulation ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_random_simulation_invariants(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8, 16])
    max_model_len = rng.randint(8, 96)
    token_history_len = rng.choice([0, 0, 1, 3, 8])
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = blocks_per_seq + rng.randint(0, 3 * blocks_per_seq)  # the engine guarantees one full sequence fits
    max_num_seqs = rng.randint(1, 8)
    num_state_slots = rng.choice([rng.randint(1, max_num_seqs), max_num_seqs, max_num_seqs + rng.randint(1, 4)])
    budget = rng.choice([1, 2, 3, 5, 8, 16, 64, 256])
    sim = Sim(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=max_model_len, num_state_slots=num_state_slots, token_history_len=token_history_len,
    )
    num_requests = rng.randint(1, 25)
    pending = []
    for i in range(num_requests):
        plen = rng.randint(1, max_model_len - 1)
        max_tokens = rng.randint(1, max_model_len - plen)  # the engine's resolved max_tokens
        prompt = [rng.randrange(50_000) for _ in range(plen)]
        pending.append((rng.randint(0, 40), f"r{i}", prompt, max_tokens))
    pending.sort(key=lambda x: x[0])  # arrival step

    total_work = sum(len(p) + m for _, _, p, m in pending)
    step_bound = 50 + 40 * total_work
    step = 0
    while pending or sim.sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens = pending.pop(0)
            sim.add(rid, prompt, max_tokens)
        sim.step()
        step += 1
        assert step < step_bound, "livelock: requests do not finish"

    assert sorted(sim.finished) == sorted(sim.requests)
    for rid, req in sim.requests.items():
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert len(req.output_token_ids) == req.max_tokens
        assert req.output_token_ids == reference_outputs(req.prompt_token_ids, req.max_tokens), rid
    plan = sim.step()
    assert sorted(sim.reported_finished) == sorted(sim.requests)
    assert plan.is_empty and sim.cache.usage() == 0.0
    assert sim.cache.blocks.num_free == num_blocks and sim.cache.slots.num_free == num_state_slots


@pytest.mark.parametrize("seed", range(10))
def test_random_simulation_with_aborts_and_tight_cache(seed):
    rng = random.Random(1000 + seed)
    block_size = rng.choice([1, 2, 4])
    max_model_len = rng.randint(8, 40)
    num_blocks = -(-max_model_len // block_size)  # exactly one full sequence: maximal pressure
    sim = Sim(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=rng.randint(2, 6),
        max_num_batched_tokens=rng.choice([2, 4, 7, 32]), max_model_len=max_model_len,
        token_history_len=rng.choice([0, 2]),
    )
    for i in range(rng.randint(5, 15)):
        plen = rng.randint(1, max_model_len - 1)
        sim.add(f"r{i}", [rng.randrange(1000) for _ in range(plen)], rng.randint(1, max_model_len - plen))
    aborted = set()
    steps = 0
    while sim.sched.has_unfinished():
        if rng.random() < 0.05:
            live = [r for r in sim.requests.values() if not r.status.finished]
            victim = rng.choice(live)
            sim.abort(victim.request_id)
            aborted.add(victim.request_id)
        sim.step()
        steps += 1
        assert steps < 20_000
    sim.step()
    assert sorted(sim.reported_finished) == sorted(sim.requests)
    for rid, req in sim.requests.items():
        if rid in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            ref = reference_outputs(req.prompt_token_ids, req.max_tokens)
            assert req.output_token_ids == ref[: len(req.output_token_ids)]
        else:
            assert req.output_token_ids == reference_outputs(req.prompt_token_ids, req.max_tokens)
    assert sim.cache.usage() == 0.0

"""Randomized schedules of Scheduler + CacheManager with prefix caching against a shadow device
(tests/test_prefix_cache_stress.py).

The shadow device applies each plan's copies as the ranks do (one batched read-then-write) and runs
every chunk, recording which tokens each state slot and each KV row holds; a chunk must read exactly
its request's true tokens. After every plan: reference counts equal the holders (request tables and
entries), no block is both free and held, slots split exactly between requests, entries and the free
list, no duplicate copy destinations in a plan, no zero-length chunk, no chunk writing a block another
table or an entry holds; requests arrive, share prompts (n > 1), ask prompt logprobs or a salt, are
aborted and preempted, MTP drafts are accepted at random (synchronous) or steps overlap
(asynchronous), and the prefix cache is reset at random."""
from __future__ import annotations

import itertools
import random
import sys
from collections import Counter

from lamina.engine.cache_manager import CacheManager
from lamina.engine.request import Request, RequestStatus
from lamina.engine.scheduler import Scheduler, SchedulerConfig
from lamina.sampling_params import SamplingParams
from lamina.step_plan import PENDING_TOKEN_ID

GARBAGE = "G"


def g(seq) -> int:
    """The fake model's next token: a function of the last 3 tokens (repeats across requests)."""
    return 100 + hash(tuple(seq[-3:])) % 4


class Bug(AssertionError):
    """A broken invariant of the caches or the schedule (the message names it)."""


def check(cond, msg):
    if not cond:
        raise Bug(msg)


class Sim:
    def __init__(self, rng, *, num_blocks, bs, slots, budget, max_model_len, min_tokens, K, async_mode):
        self.rng = rng
        self.bs = bs
        self.K = K  # drafts per step (sync only)
        self.async_mode = async_mode
        self.cache = CacheManager(num_blocks, bs, slots, prefix_caching=True, prefix_cache_min_tokens=min_tokens)
        self.config = SchedulerConfig(slots, budget, max_model_len)
        self.sched = Scheduler(self.config, self.cache)
        self.ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self.truth: dict[str, list[int]] = {}  # the true sequence per request (prompt + g continuation)
        # shadow device
        self.dev_slots: dict[int, object] = {}  # slot -> tuple of tokens whose state it holds
        self.dev_blocks: dict[int, list] = {}  # block -> bs tokens written
        self.inflight = None
        self.history = []
        self.stall = 0
        self.done_tokens = 0

    # ---- requests -------------------------------------------------------------
    def true_seq(self, rid, n):
        seq = self.truth[rid]
        while len(seq) < n:
            seq.append(g(seq))
        return seq[:n]

    def new_prompt(self):
        r = self.rng.random()
        base = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
        if r < 0.5 and self.history:
            p = list(self.rng.choice(self.history))
            if self.rng.random() < 0.5 and self.truth:
                rid = self.rng.choice(list(self.truth)[-10:])
                p = list(self.truth[rid])
            return p + [self.rng.randrange(50) for _ in range(self.rng.randrange(0, 6))]
        if r < 0.6:
            return base[: self.rng.randrange(2, 20)] + [self.rng.randrange(50) for _ in range(self.rng.randrange(0, 8))]
        return [self.rng.randrange(50) for _ in range(self.rng.randrange(1, 24))]

    def make(self, prompt, params, max_tokens, salt):
        rid = f"r{next(self.ids)}"
        req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params, arrival_index=0,
                      max_tokens=max_tokens, cache_salt=salt)
        self.requests[rid] = req
        self.truth[rid] = list(prompt)
        return req

    def add_random(self):
        prompt = self.new_prompt()
        max_len = self.config.max_model_len
        if len(prompt) >= max_len - 1:
            prompt = prompt[: max_len - 2]
        max_tokens = self.rng.randrange(1, min(8, max_len - len(prompt)) + 1)
        kind = self.rng.random()
        if kind < 0.15:
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3)
        elif kind < 0.25:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=1)
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        salt = self.rng.choice([None, None, None, "s"])
        if self.rng.random() < 0.2 and len(prompt) >= 2:
            n = self.rng.randrange(2, 4)
            group = [self.make(prompt, params, max_tokens, salt) for _ in range(n)]
            self.sched.add_group(group)
        else:
            self.sched.add(self.make(prompt, params, max_tokens, salt))
        self.history.append(prompt)

    # ---- invariants -----------------------------------------------------------
    def check_cache(self):
        cache = self.cache
        holders = Counter()
        table_holders = Counter()
        for rid, table in cache._tables.items():
            for b in table:
                holders[b] += 1
                table_holders[b] += 1
        entries = cache.prefix.all_entries()
        for e in entries:
            for b in e.blocks:
                holders[b] += 1
        free = list(cache.blocks._free)
        check(len(free) == len(set(free)), f"duplicate free blocks {free}")
        for b in range(cache.num_blocks):
            check(cache.blocks.refs(b) == holders[b], f"block {b}: refs {cache.blocks.refs(b)} != holders {holders[b]}")
            check((b in free) == (holders[b] == 0), f"block {b}: free={b in free} holders={holders[b]}")
            check(cache._table_refs[b] == table_holders[b], f"block {b}: table_refs {cache._table_refs[b]} != {table_holders[b]}")
        check(cache._blocks_in_tables == sum(1 for b in table_holders if table_holders[b]), "blocks_in_tables")
        slots = list(cache.slots._free) + list(cache._slot_of.values()) + [e.slot for e in entries]
        check(sorted(slots) == list(range(cache.slots.num_slots)), f"slots not a partition: {sorted(slots)}")
        # each entry's own partial block is held by it alone
        for e in entries:
            full = e.num_tokens // self.bs
            check(len(e.blocks) == -(-e.num_tokens // self.bs), "entry block count")
            if len(e.blocks) > full:
                check(cache.blocks.refs(e.blocks[full]) == 1, f"entry partial block shared {e.blocks[full]}")
        # requests: status and tables
        for req in self.sched.running:
            check(cache.has(req.request_id), f"running {req.request_id} without cache")
        for req in self.sched.waiting:
            check(not cache.has(req.request_id), f"waiting {req.request_id} with cache")

    def check_plan(self, plan):
        for name in ("state_copies", "block_copies"):
            dsts = [d for _, d in getattr(plan, name)]
            check(len(dsts) == len(set(dsts)), f"plan {plan.step_id}: duplicate {name} destinations {getattr(plan, name)}")
        seen = set()
        for c in plan.chunks:
            check(c.request_id not in seen, "request twice in a plan")
            seen.add(c.request_id)
            check(c.num_tokens > 0, f"zero-length chunk {c}")
            req = self.requests[c.request_id]
            # only chunks that sample may contain pending tokens at their end
            pend = [i for i, t in enumerate(c.token_ids) if t == PENDING_TOKEN_ID]
            check(not pend or c.sample, f"non-sampling chunk with pending tokens {c}")
            check(len(c.block_table) * self.bs >= c.end_position, "table too short")
            # blocks the chunk writes (its own positions): none shared with another request's table
            first = c.start_position // self.bs
            last = (c.end_position - 1) // self.bs
            for i in range(first, last + 1):
                b = c.block_table[i]
                others = [r for r, t in self.cache._tables.items() if r != c.request_id and b in t]
                check(not others, f"plan {plan.step_id}: {c.request_id} writes block {b} (pos {i}) held by {others}")
                # an entry may share it only if the entry covers full blocks the chunk fills (keep in this plan)
                for e in self.cache.prefix.all_entries():
                    if b in e.blocks:
                        full = e.num_tokens // self.bs
                        idx = e.blocks.index(b)
                        check(idx < full and (idx + 1) * self.bs <= c.end_position and e.usable_from_step == plan.step_id + 2,
                              f"plan {plan.step_id}: {c.request_id} writes block {b} of entry {e.num_tokens} (usable {e.usable_from_step})")

    def check_entries_on_device(self, next_step):
        """Entries usable at `next_step` hold their tokens' KV and state on the device."""
        for e in self.cache.prefix.all_entries():
            if e.usable_from_step <= next_step:
                check(self.dev_slots.get(e.slot) == tuple(e.token_ids),
                      f"entry {e.num_tokens} (usable {e.usable_from_step}) slot {e.slot} holds {self.dev_slots.get(e.slot)} != {e.token_ids}")
                for p in range(e.num_tokens):
                    blk = self.dev_blocks.get(e.blocks[p // self.bs])
                    check(blk is not None and blk[p % self.bs] == e.token_ids[p], f"entry {e.num_tokens} block content at {p}")

    # ---- device ---------------------------------------------------------------
    def device(self, plan):
        """Run a plan on the shadow device; returns results {rid: (tokens, accepted, drafts)}."""
        for name, store in (("block_copies", self.dev_blocks), ("state_copies", self.dev_slots)):
            pairs = getattr(plan, name)
            vals = [store.get(s) for s, _ in pairs]
            for (_, d), v in zip(pairs, vals):
                store[d] = list(v) if isinstance(v, list) else v
        results = {}
        for c in plan.chunks:
            rid = c.request_id
            start, end = c.start_position, c.end_position
            n_real = c.num_tokens - c.num_draft_tokens
            true = self.true_seq(rid, start + n_real)
            if start > 0:
                check(self.dev_slots.get(c.state_slot) == tuple(true[:start]),
                      f"plan {plan.step_id}: {rid} slot {c.state_slot} at start {start} holds {self.dev_slots.get(c.state_slot)} != {tuple(true[:start])}")
                for p in range(start):
                    blk = self.dev_blocks.get(c.block_table[p // self.bs])
                    check(blk is not None and blk[p % self.bs] == true[p],
                          f"plan {plan.step_id}: {rid} KV at {p} (block {c.block_table[p // self.bs]}) = {None if blk is None else blk[p % self.bs]} != {true[p]}")
            toks = list(c.token_ids)
            for i in range(n_real):
                if toks[i] == PENDING_TOKEN_ID:
                    toks[i] = true[start + i]
                check(toks[i] == true[start + i], f"plan {plan.step_id}: {rid} token at {start + i} = {toks[i]} != {true[start + i]}")
            # drafts: accepted while equal to the truth
            accepted = 0
            if c.num_draft_tokens:
                full = self.true_seq(rid, start + n_real + c.num_draft_tokens)
                for j in range(c.num_draft_tokens):
                    if toks[n_real + j] == full[start + n_real + j]:
                        accepted += 1
                    else:
                        break
            for i, t in enumerate(toks):
                p = start + i
                blk = self.dev_blocks.setdefault(c.block_table[p // self.bs], [None] * self.bs)
                blk[p % self.bs] = t
            acc_end = start + n_real + accepted
            if c.sample:
                # the drafter's lookahead writes garbage past the accepted end within the table
                for p in range(acc_end, min(len(c.block_table) * self.bs, acc_end + max(0, self.K - 1))):
                    self.dev_blocks.setdefault(c.block_table[p // self.bs], [None] * self.bs)[p % self.bs] = GARBAGE
            self.dev_slots[c.state_slot] = tuple(self.true_seq(rid, acc_end))
            if c.sample:
                seq = self.true_seq(rid, acc_end + 1)
                out = seq[start + n_real: acc_end + 1]
                drafts = []
                if self.K:
                    cont = self.true_seq(rid, acc_end + 1 + self.K)[acc_end + 1:]
                    drafts = [t if self.rng.random() < 0.6 else 999 for t in cont]
                results[rid] = (out, accepted, drafts)
        return results

    # ---- engine loop ----------------------------------------------------------
    def process(self, plan, results, launched):
        for c in plan.chunks:
            if c.request_id not in results:
                continue
            req = self.requests[c.request_id]
            if launched is not None:
                if launched.get(c.request_id) is not req:
                    continue
                if req.status.finished:
                    continue
                req.num_pending_tokens -= 1 + c.num_draft_tokens
                if not req.num_pending_tokens:
                    req.num_pending_drafts = 0
                self.sched.on_verified(req, c.num_draft_tokens - results[c.request_id][1])
            if req.status.finished:
                continue
            out, accepted, drafts = results[c.request_id]
            for t in out:
                req.append_output(t)
                self.done_tokens += 1
                if len(req.output_token_ids) >= req.max_tokens:
                    self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
                    self.check_output(req)
                    break
            if not req.status.finished:
                req.spec_token_ids = drafts
                if self.rng.random() < 0.03:
                    self.sched.finish(req, RequestStatus.FINISHED_STOPPED)

    def check_output(self, req):
        check(req.all_token_ids == self.true_seq(req.request_id, req.num_tokens), f"{req.request_id} wrong tokens")
        if req.num_cached_tokens is not None and req.num_cached_tokens >= req.num_prompt_tokens:
            self.cached_over = getattr(self, "cached_over", 0) + 1
        if False:
            check(req.num_cached_tokens < req.num_prompt_tokens,
                  f"{req.request_id}: num_cached_tokens {req.num_cached_tokens} >= prompt {req.num_prompt_tokens} (preemptions {req.num_preemptions})")

    def step(self):
        plan = self.sched.schedule(self.K)
        self.check_cache()
        self.check_plan(plan)
        if self.async_mode:
            launched = None
            if plan.chunks or plan.has_copies or plan.finished_request_ids:
                results = self.device(plan)
                if plan.chunks:
                    self.sched.on_step_done(plan, assume_accepted=True)
                    reqs = {}
                    for c in plan.chunks:
                        r = reqs[c.request_id] = self.requests[c.request_id]
                        if c.sample:
                            r.num_pending_tokens += 1 + c.num_draft_tokens
                    launched = (plan, results, reqs)
            if self.inflight is not None:
                p, res, reqs = self.inflight
                self.process(p, res, reqs)
            self.inflight = launched
        else:
            results = self.device(plan)
            self.sched.on_step_done(plan, {rid: _Acc(a) for rid, (_, a, _) in results.items()})
            self.process(plan, results, None)
        self.check_entries_on_device(self.sched._step_id + 1)
        self.check_cache()
        return plan

    def random_events(self):
        r = self.rng.random()
        if r < 0.25:
            self.add_random()
        elif r < 0.28:
            pool = list(self.sched.running) + list(self.sched.waiting)
            if pool:
                self.sched.finish(self.rng.choice(pool), RequestStatus.FINISHED_ABORTED)
        elif r < 0.29:
            self.cache.reset_prefix_cache()


class _Acc:
    def __init__(self, n):
        self.accepted_token_ids = [0] * n


def run(seed, steps=400, **kw):
    rng = random.Random(seed)
    params = dict(num_blocks=rng.randrange(6, 20), bs=rng.choice([2, 4]), slots=rng.randrange(2, 5),
                  budget=rng.randrange(3, 14), max_model_len=rng.choice([16, 24, 32]), min_tokens=rng.choice([2, 4, 6]),
                  K=rng.choice([0, 0, 2, 3]), async_mode=rng.random() < 0.4)
    params.update(kw)
    if params["async_mode"]:
        params["K"] = 0
    params["budget"] = max(params["budget"], params["K"] + 1)
    # the cache must hold one max_model_len request
    params["num_blocks"] = max(params["num_blocks"], -(-params["max_model_len"] // params["bs"]) + params.pop("extra_blocks", 1))
    sim = Sim(rng, **params)
    for i in range(steps):
        sim.random_events()
        before = sim.done_tokens
        sim.step()
    # drain
    for i in range(2000):
        if not (sim.sched.has_unfinished() or sim.inflight):
            break
        sim.step()
    else:
        raise Bug(f"no progress: running {[(r.request_id, r.num_computed_tokens, r.num_tokens) for r in sim.sched.running]} "
                  f"waiting {[(r.request_id, r.num_computed_tokens, r.num_tokens, r.num_pending_tokens) for r in sim.sched.waiting]} params {params}")
    return sim, params


if __name__ == "__main__":  # python tests/prefix_cache_sim.py FIRST_SEED LAST_SEED
    for seed in range(int(sys.argv[1]), int(sys.argv[2])):
        try:
            run(seed)
        except Bug as e:
            print(seed, e)

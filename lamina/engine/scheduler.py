"""Continuous-batching scheduler: FCFS, chunked prefill mixed with decodes, preemption by recompute.

Pure CPU policy over `Request` objects and the `CacheManager`'s integers; it never touches tensors.
Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Running requests are served first, in arrival order: a decode takes one token, an unfinished
prefill takes what is left of the budget. When KV blocks run out, the most recently arrived
running request is preempted: its cache is freed and it goes back to the front of the queue,
to be recomputed from its prompt plus the tokens it already generated (so its output continues
exactly where it stopped). Waiting requests are admitted while budget, sequences and cache allow.

Speculative decoding: a decoding request's chunk also carries its draft tokens (as many as the
budget, max_model_len and max_tokens leave room for), and a chunk that samples reserves KV for
`num_draft_tokens - 1` more positions, where the MTP drafter writes while drafting. After the
step only the accepted tokens count as computed.

Prompt sharing (`n` / `best_of`, `add_group`): the group's first request (the source) prefills
all prompt tokens but the last; its siblings wait outside the queue. At the start of the next
plan the scheduler forks: each sibling gets its own state slot and KV blocks, and the plan tells
every rank to copy the source's slot and prompt blocks into them before the forward
(`StepPlan.state_copies`, `block_copies`). From then on the siblings are ordinary running requests
that have computed `prompt[:-1]`: each runs the last prompt token as its own chunk and samples its
first token independently. A sibling the cache cannot take at fork time (no slot or blocks, or
`max_num_seqs` reached) is released to the front of the queue and prefills the prompt itself;
so is every sibling when the source ends before the fork. A preempted source prefills again
(its siblings keep waiting); a preempted sibling recomputes by itself.

Asynchronous scheduling (the engine plans step N+1 while step N runs on the device): a request
whose step-N chunk samples carries that token as pending (`Request.num_pending_tokens`) until
the engine appends it. The next chunk then computes it as `PENDING_TOKEN_ID`, which the runner
replaces on the device with the id step N sampled; a request whose pending tokens reach its
`max_tokens` is not scheduled again, and a preempted one is not re-admitted before they arrive.

Prefix caching (`CacheManager(prefix_caching=True)`, lamina/engine/prefix_cache.py): a request
admitted without a cache starts at the longest kept prefix of its tokens (at most all but the last
one it computes; never a request that wants prompt logprobs, which need every prompt position
computed), sharing the prefix's full KV blocks and copying its partial last block and recurrent
state. Prompt chunks cut short by the budget end on a block boundary, and a chunk that would sample
a request's next token stops one token short unless that prefix is kept already (the last token
then samples in a one-token step); each chunk end that samples nothing (at least
`prefix_cache_min_tokens`) is kept for later prompts. A prompt whose start an earlier prompt had
too (its junction, `_find_junction`) ends a chunk there once, so that prompts sharing only a
system prompt share its entry (`prefix_cache_junctions`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lamina.engine.cache_manager import CacheManager
from lamina.engine.request import Request, RequestStatus
from lamina.step_plan import PENDING_TOKEN_ID, ScheduledChunk, StepPlan


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    token_history_len: int = 0  # how many earlier token ids each chunk carries (see ScheduledChunk)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.token_history_len < 0:
            raise ValueError(f"token_history_len must be >= 0, got {self.token_history_len}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager):
        self.config = config
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._step_id = 0
        self._finished_since_last_plan: list[str] = []
        self.num_preemptions = 0
        self.num_preemption_recompute_tokens = 0  # computed tokens whose cache preemption dropped
        # Prompt sharing: source request id -> (source, siblings waiting for its prompt state)
        self._forks: dict[str, tuple[Request, list[Request]]] = {}
        self.num_forked = 0  # siblings that started from a copied prompt state
        # Prefix caching: tokens looked up at admission and tokens found (vLLM's prefix_cache_queries / hits)
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # ---- queue ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_group(self, requests: list[Request]) -> None:
        """Requests with the same prompt (the children of one `n` / `best_of` request, in order):
        the first prefills `prompt[:-1]` once, the others start from a copy of its state."""
        source, siblings = requests[0], list(requests[1:])
        assert all(r.prompt_token_ids == source.prompt_token_ids for r in siblings)
        self.add(source)
        if not siblings or source.num_prompt_tokens < 2:
            for request in siblings:
                self.add(request)
            return
        for request in siblings:
            request.status = RequestStatus.WAITING
        self._forks[source.request_id] = (source, siblings)

    def _release(self, siblings: list[Request]) -> None:
        """Siblings that will not fork: to the front of the queue, in order, to prefill themselves."""
        for request in reversed(siblings):
            self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length, abort, error) and release its cache."""
        assert status.finished
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        group = self._forks.pop(request.request_id, None)
        if group is not None:  # the source ended before the fork
            self._release(group[1])
        for _, siblings in self._forks.values():  # a sibling that was still waiting for the fork
            if request in siblings:
                siblings.remove(request)
        self.cache.free(request.request_id)
        self._finished_since_last_plan.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._forks)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(siblings) for _, siblings in self._forks.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def all_running_pending(self) -> bool:
        """Every running request has tokens in flight and nothing waits (no prompt, no fork): the
        next step can be planned from the step in flight alone (speculative asynchronous scheduling)."""
        return not self.waiting and not self._forks and all(r.num_pending_tokens > 0 for r in self.running)

    # ---- planning ------------------------------------------------------------------------
    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.cache.free(request.request_id)
        self.num_preemption_recompute_tokens += request.num_computed_tokens
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        # Its drafts stay: recomputation verifies them as the next step would have, so a seeded
        # sampling request draws the same random numbers whether or not it was preempted
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted_request_ids.append(request.request_id)

    def _target(self, request: Request) -> int:
        """Tokens the request computes before it may go on: `prompt[:-1]` for a fork source."""
        if request.request_id in self._forks:
            return request.num_prompt_tokens - 1
        return request.num_tokens_with_pending

    def _fork_ready(self) -> list[tuple[Request, list[tuple[int, int]], tuple[int, int]]]:
        """Fork every group whose source has computed `prompt[:-1]`: (sibling, block copies,
        state copy) for each sibling now running."""
        forks = []
        for source_id, (source, siblings) in list(self._forks.items()):
            shared = source.num_prompt_tokens - 1
            if source.status != RequestStatus.RUNNING or source.num_computed_tokens < shared:
                continue
            del self._forks[source_id]
            released = []
            for request in siblings:
                copies = None
                if len(self.running) < self.config.max_num_seqs:
                    copies = self.cache.fork(source_id, request.request_id, shared, shared + 1)
                if copies is None:
                    released.append(request)
                    continue
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = shared
                self.running.append(request)
                self.num_forked += 1
                forks.append((request, *copies))
            self._release(released)
        return forks

    # ---- prefix caching ------------------------------------------------------------------
    def _hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Chained block hashes of the request's first `num_tokens` tokens (extended as it grows)."""
        known = request.prefix_hashes
        if len(known) < num_tokens // self.cache.block_size:
            request.prefix_hashes = known = self.cache.prefix_hashes(
                request.all_token_ids[:num_tokens], request.cache_salt, known)
        return known

    def _prefix_key(self, request: Request, num_tokens: int) -> int:
        return self.cache.prefix.key_of(self._hashes(request, num_tokens), num_tokens, self.cache.block_size,
                                        request.cache_salt)

    def _prefix_cut(self, request: Request, num_new: int) -> int:
        """The chunk's size under prefix caching: a chunk the budget cuts short ends on a block
        boundary; a chunk that would sample the request's next token stops one token short, unless
        that prefix is kept already (the last token samples in the next step, by itself)."""
        if self.cache.prefix is None:
            return num_new
        size = self.cache.block_size
        start = request.num_computed_tokens
        end = start + num_new
        junction = self._junction_in(request, start, end)
        if junction:
            return junction - start
        if end < self._target(request):
            aligned = end // size * size
            return aligned - start if aligned > start else num_new
        last = end - 1
        if (end != request.num_tokens_with_pending or last <= start or last < self.cache.prefix.min_tokens
                or last > request.num_tokens):
            return num_new
        if not self.cache.can_keep_prefix(last, *self._keep_reserves()):
            return num_new  # no entry could be made: no step to spend on it
        tokens = request.all_token_ids[:last]
        if self.cache.holds_prefix(self._prefix_key(request, last), tokens, request.cache_salt):
            return num_new
        return last - start

    def _find_junction(self, request: Request) -> int:
        """Where the prompt parts from an earlier prompt (a block boundary, in tokens; 0: nowhere),
        looked up once, at the first admission (the prompt's blocks are remembered then)."""
        if request.prefix_junction is None:
            request.prefix_junction = 0
            if self.cache.prefix is not None and request.sampling_params.prompt_logprobs is None:
                prompt = request.num_prompt_tokens
                blocks = self.cache.prefix.junction(self._hashes(request, prompt), (prompt - 2) // self.cache.block_size)
                request.prefix_junction = blocks * self.cache.block_size
        return request.prefix_junction

    def _junction_in(self, request: Request, start: int, end: int) -> int:
        """The request's junction when its chunk [start, end) should end there: at least
        `prefix_cache_min_tokens` past the start, inside the chunk, an entry that can be kept and
        is not held already (0: no cut)."""
        junction = request.prefix_junction or 0
        if not start + self.cache.prefix.min_tokens <= junction < end:
            return 0
        tokens = request.all_token_ids[:junction]
        if (not self.cache.can_keep_prefix(junction, *self._keep_reserves())
                or self.cache.holds_prefix(self._prefix_key(request, junction), tokens, request.cache_salt)):
            return 0
        return junction

    def _keep_reserves(self) -> tuple[int, int]:
        """(slots, blocks) new entries leave alone: the slots the waiting requests (fork siblings
        included) may take this step, and a block for each running request to grow into."""
        return min(self.num_waiting, self.config.max_num_seqs - len(self.running)), len(self.running)

    def _keep_prefix(self, request: Request, chunk: ScheduledChunk) -> None:
        """Keep the prefix a chunk that samples nothing ends (within the known tokens)."""
        if self.cache.prefix is None or chunk.sample:
            return
        end = chunk.end_position - chunk.num_draft_tokens
        if end > request.num_tokens or end < self.cache.prefix.min_tokens:
            return
        self.cache.keep_prefix(request.request_id, self._prefix_key(request, end), request.all_token_ids[:end],
                               request.cache_salt, *self._keep_reserves())

    def _start_from_prefix(self, request: Request, budget: int, plan: StepPlan) -> bool | None:
        """Admission of a request without a cache under prefix caching: start it at the longest kept
        prefix. True: admitted from one (its cache allocated, the state copy planned); False: no
        prefix to start from; None: one was found but blocks or slots are short."""
        if self.cache.prefix is None or request.num_computed_tokens or request.sampling_params.prompt_logprobs is not None:
            return False
        target = self._target(request)
        max_tokens = min(target - 1, request.num_tokens)
        entry = self.cache.find_prefix(self._hashes(request, max_tokens), request.all_token_ids, request.cache_salt,
                                       max_tokens)
        if entry is None:
            return False
        request.num_computed_tokens = entry.num_tokens
        num_new = self._prefix_cut(request, min(target - entry.num_tokens, budget))
        chunk = self._chunk_and_drafts(request, num_new, budget)
        copy = None
        if chunk is not None:
            num_new, drafts = chunk
            wanted = self._tokens_to_allocate(request, num_new + len(drafts), self._lookahead)
            copy = self.cache.allocate_from_prefix(request.request_id, entry, wanted)
        if copy is None:
            request.num_computed_tokens = 0
            return None
        state_copy, block_copies = copy
        if state_copy is not None:  # else the request took the entry over: its slot and blocks as they are
            plan.state_copies.append(state_copy)
        plan.block_copies += block_copies
        self._admit(request, plan, num_new, drafts)
        return True

    def _admit(self, request: Request, plan: StepPlan, num_new: int, drafts: list[int]) -> None:
        """A waiting request (at the queue's head) joins the running batch with its first chunk."""
        if self.cache.prefix is not None and request.sampling_params.prompt_logprobs is None:
            # vLLM's counters: tokens looked up, tokens found (request.num_computed_tokens: the prefix)
            self.num_prefix_queries += self._target(request)
            self.num_prefix_hits += request.num_computed_tokens
        if request.num_cached_tokens is None:  # vLLM's num_cached_tokens: fixed at the first admission
            request.num_cached_tokens = request.num_computed_tokens
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._append_chunk(request, plan, num_new, drafts)

    def _append_chunk(self, request: Request, plan: StepPlan, num_new: int, drafts: list[int]) -> None:
        chunk = self._chunk(request, num_new, drafts)
        plan.chunks.append(chunk)
        self._keep_prefix(request, chunk)

    def _chunk(self, request: Request, num_new: int, drafts: list[int] = ()) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        params = request.sampling_params
        sample = end == request.num_tokens_with_pending
        known = request.all_token_ids[start:end]
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=known + [PENDING_TOKEN_ID] * (num_new - len(known)) + list(drafts),
            start_position=start,
            block_table=list(self.cache.block_table(request.request_id)),
            state_slot=self.cache.state_slot(request.request_id),
            sample=sample,
            sampling_params=params,
            num_output_tokens=request.num_output_tokens_with_pending,
            history_token_ids=request.all_token_ids[max(0, start - self.config.token_history_len) : start],
            num_draft_tokens=len(drafts),
            next_token_id=request.all_token_ids[end] if end < request.num_tokens else None,
            output_token_ids=list(request.output_token_ids) if sample and params.needs_output_tokens else None,
            prompt_token_ids=request.prompt_token_ids if sample and params.repetition_penalty != 1.0 else None,
            num_prompt_tokens=request.num_prompt_tokens if params.prompt_logprobs is not None else 0,
        )

    @staticmethod
    def _draws_per_draft(request: Request) -> bool:
        params = request.sampling_params
        return params.seed is not None and not params.greedy

    def _drafts(self, request: Request, num_new: int, budget_left: int) -> list[int] | None:
        """The drafts a request's chunk verifies: none unless the chunk reaches its last token; at
        most what the budget, max_model_len and max_tokens leave room for. Drafts still being
        proposed by the step in flight (asynchronous scheduling) are verified all or not at all:
        None when there is no room for all of them (the request sits this step out)."""
        if request.num_pending_drafts:
            if request.num_computed_tokens + num_new != request.num_tokens_with_pending:
                return []
            room = min(
                budget_left,
                self.config.max_model_len - request.num_tokens_with_pending,
                request.max_tokens - request.num_output_tokens_with_pending - 1,
            )
            return [PENDING_TOKEN_ID] * request.num_pending_drafts if room >= request.num_pending_drafts else None
        if request.num_computed_tokens + num_new != request.num_tokens or not request.spec_token_ids:
            return []
        room = min(
            budget_left,
            self.config.max_model_len - request.num_tokens,
            request.max_tokens - len(request.output_token_ids) - 1,
        )
        return request.spec_token_ids[: max(0, room)]

    def _chunk_and_drafts(self, request: Request, num_new: int, budget_left: int) -> tuple[int, list[int]] | None:
        """The chunk of at most `num_new` tokens the request computes this step and the drafts it
        verifies, within `budget_left`; None when it sits this step out. A seeded sampling request
        draws random numbers for every draft it verifies, so its drafts are never cut to the
        budget (its text would depend on the batch): where the chunk to its end and all its drafts
        do not fit, the chunk stops one token short of the end (nothing sampled, nothing verified),
        and the last token goes with all the drafts in a later step (max_num_batched_tokens >= K + 1
        is checked at start-up). A request preempted with its drafts (they are kept) recomputes so."""
        drafts = self._drafts(request, num_new, budget_left - num_new)
        if drafts is None:
            return None
        if self._draws_per_draft(request) and len(drafts) < len(self._drafts(request, num_new, budget_left=1 << 30)):
            return (num_new - 1, []) if num_new > 1 else None
        return num_new, drafts

    def _pending_at_limit(self, request: Request) -> bool:
        """The request's pending tokens end it (max_tokens / max_model_len): it only waits for them."""
        return request.num_pending_tokens > 0 and (
            request.num_output_tokens_with_pending >= request.max_tokens
            or request.num_tokens_with_pending >= self.config.max_model_len
        )

    def _tokens_to_allocate(self, request: Request, num_new: int, lookahead: int) -> int:
        """KV positions the request needs: its chunk, plus the drafter's lookahead when it samples
        (never past max_model_len, except for what the chunk itself needs)."""
        end = request.num_computed_tokens + num_new
        if lookahead <= 0 or end < request.num_tokens_with_pending:
            return end
        return max(end, min(end + lookahead, self.config.max_model_len))

    def schedule(self, num_draft_tokens: int = 0) -> StepPlan:
        """Plan one step; `num_draft_tokens`: drafts the MTP drafter will propose in it."""
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, finished_request_ids=self._finished_since_last_plan)
        self._finished_since_last_plan = []
        state_copies, block_copies = self.cache.begin_step(self._step_id)  # into the prefixes the last plan kept
        plan.state_copies += state_copies
        plan.block_copies += block_copies
        budget = self.config.max_num_batched_tokens
        self._lookahead = lookahead = num_draft_tokens - 1
        forks = self._fork_ready()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(self._target(request) - request.num_computed_tokens, budget)
            if num_new <= 0 or self._pending_at_limit(request):
                index += 1
                continue
            chunk = self._chunk_and_drafts(request, self._prefix_cut(request, num_new), budget)
            if chunk is None:
                index += 1
                continue
            num_new, drafts = chunk
            scheduled = True
            wanted = self._tokens_to_allocate(request, num_new + len(drafts), lookahead)
            while not self.cache.allocate(request.request_id, wanted):
                victim = self.running.pop()
                self._preempt(victim, plan)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            self._append_chunk(request, plan, num_new, drafts)
            budget -= num_new + len(drafts)
            index += 1

        if not plan.preempted_request_ids:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                if request.num_pending_tokens:
                    break  # preempted while its token was in flight: recompute once that token is known
                self._find_junction(request)
                started = self._start_from_prefix(request, budget, plan)
                if started is None:
                    break
                if not started:
                    num_new = self._prefix_cut(request, min(self._target(request) - request.num_computed_tokens, budget))
                    chunk = self._chunk_and_drafts(request, num_new, budget)  # drafts: a preempted request's, kept
                    if chunk is None:
                        break
                    num_new, drafts = chunk
                    wanted = self._tokens_to_allocate(request, num_new + len(drafts), lookahead)
                    if not self.cache.allocate(request.request_id, wanted):
                        break
                    self._admit(request, plan, num_new, drafts)
                budget -= plan.chunks[-1].num_tokens
        # A sibling preempted in its own fork step starts over by itself: no copies for it.
        preempted = set(plan.preempted_request_ids)
        for request, block_copies, state_copy in forks:
            if request.request_id not in preempted:
                plan.block_copies += block_copies
                plan.state_copies.append(state_copy)
        return plan

    def on_step_done(self, plan: StepPlan, results: dict | None = None, *, assume_accepted: bool = False) -> None:
        """Advance each scheduled request by the tokens it computed (sampled tokens are appended by
        the engine). Of a chunk's drafts only the accepted ones (`results`) count as computed; with
        `assume_accepted` (a step just launched, results to come) all of them, until
        `on_verified` takes back the rejected ones."""
        by_id = {r.request_id: r for r in self.running}
        for chunk in plan.chunks:
            request = by_id.get(chunk.request_id)
            if request is not None:
                rejected = 0 if assume_accepted else chunk.num_draft_tokens
                if rejected and results is not None and chunk.request_id in results:
                    rejected -= len(results[chunk.request_id].accepted_token_ids)
                request.num_computed_tokens = chunk.end_position - rejected

    def on_verified(self, request: Request, num_rejected: int) -> None:
        """A step launched with `assume_accepted` reported: `num_rejected` of the request's drafts
        were not computed after all (nothing to do for a request no longer running)."""
        if num_rejected and request.status == RequestStatus.RUNNING:
            request.num_computed_tokens -= num_rejected

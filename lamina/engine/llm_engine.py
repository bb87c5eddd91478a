"""The engine loop: requests in, step plans to the executor, sampled tokens back, outputs out."""

from __future__ import annotations

import collections
import itertools
import logging
import time

import torch

from lamina.config import EngineArgs
from lamina.engine.async_scheduling import plan_may_overlap, resolve_async_scheduling
from lamina.engine.stats_log import TokenCountHistogram
from lamina.engine.cache_manager import CacheManager
from lamina.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from lamina.engine.executor import InProcessExecutor
from lamina.engine.kv_sizing import KVCacheSizing
from lamina.engine.parallel_sampling import ParentRequest, child_params, child_request_id
from lamina.engine.request_validation import RequestValidation
from lamina.structured_output import StructuredOutputManager
from lamina.engine.request import Request, RequestStatus
from lamina.engine.scheduler import Scheduler, SchedulerConfig
from lamina.engine.setup import resolve_setup
from lamina.engine.spec_policy import SpecDecodePolicy
from lamina.engine.warm_up import WarmUp
from lamina.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SpecDecodeMetrics
from lamina.parallel.context import ParallelContext
from lamina.sampling_params import RequestOutputKind, SamplingParams
from lamina.step_plan import PENDING_TOKEN_ID
from lamina.models.hybrid_config import num_mtp_layers
from lamina.worker.model_loader import build_model
from lamina.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_SEQS = {"cpu": 32, "cuda": 256}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
def _steady_decode(chunk, num_drafts: int) -> bool:
    """A chunk that verifies `num_drafts` drafts and proposes as many (no prompt tokens): the
    steps the auto policy times."""
    return chunk.sample and chunk.num_draft_tokens == num_drafts and chunk.num_tokens == num_drafts + 1


class _RequestState:
    """Engine-side output bookkeeping of one request (text, logprobs, timing)."""

    def __init__(self, request: Request, detokenizer: IncrementalDetokenizer | None):
        self.request = request
        self.detokenizer = detokenizer
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = [] if request.sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if self.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_logprob_ranks: list[int | None] | None = None
        if request.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(request.prompt_token_ids)
            self.prompt_logprob_ranks = [None] * len(request.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.spec = SpecDecodeMetrics()
        self.waiting_since: float | None = self.metrics.arrival_time  # None while in the running batch


class LLMEngine(KVCacheSizing, RequestValidation, WarmUp):
    def __init__(self, args: EngineArgs):
        setup = resolve_setup(args)  # every config error is raised here, before any weight is read
        self.setup = setup
        self.args, self.model_path, self.device, self.dtype = setup.args, setup.model_path, setup.device, setup.dtype
        # The caller's CUDA RNG state of this device, given back once the engine is up: capturing CUDA
        # graphs moves it (torch registers the default generator with each graph), and an engine in the
        # caller's process leaves the caller's randomness alone (lamina.worker.sampling_rng)
        callers_cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self.model_config, self.parallel_config, self.plan = setup.model_config, setup.parallel_config, setup.plan
        self.max_model_len, self.spec_config = setup.max_model_len, setup.spec_config
        self.ssm_state_dtype = setup.ssm_state_dtype  # the recurrent state pool's (mamba_ssm_cache_dtype)
        self.kv_cache_dtype = setup.kv_cache_dtype  # the paged KV cache's (kv_cache_dtype)
        # a GPU with FP8 (compute capability 8.9+): memory refusals may suggest kv_cache_dtype fp8
        self.fp8_kv_cache_possible = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) >= (8, 9)
        self.default_sampling = dict(setup.default_sampling)  # from the generation config (generation_defaults)
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (Logprob.decoded_token)
        self.tokenizer, self.eos_token_ids = setup.tokenizer, setup.eos_token_ids
        # the EOS a stop reports no stop_reason for; the others (e.g. a generation config's second EOS)
        # report their id, as vLLM moves them into stop_token_ids
        tokenizer_eos = getattr(setup.tokenizer, "eos_token_id", None)
        self.primary_eos_token_id = tokenizer_eos if tokenizer_eos is not None else next(iter(self.eos_token_ids), None)
        self.structured = StructuredOutputManager(self.tokenizer, setup.model_config.vocab_size, self.eos_token_ids)
        hf_config, model_cls, cfg = setup.hf_config, setup.model_cls, setup.model_config
        max_num_seqs = args.max_num_seqs or args.default_max_num_seqs or DEFAULT_MAX_NUM_SEQS[self.device.type]
        max_batched = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if self.spec_config is not None and max_batched < self.spec_config.num_speculative_tokens + 1:
            raise ValueError(
                f"max_num_batched_tokens = {max_batched} cannot hold one verification step of "
                f"num_speculative_tokens = {self.spec_config.num_speculative_tokens} (needs at least "
                f"{self.spec_config.num_speculative_tokens + 1})"
            )
        model_options = setup.model_options()
        self.async_scheduling = resolve_async_scheduling(
            args.async_scheduling, device_type=self.device.type, single_rank=self.parallel_config.is_single_rank,
            token_history_len=model_cls.token_history_len_for(cfg) if hasattr(model_cls, "token_history_len_for") else 0,
        )
        self._inflight = None  # asynchronous scheduling: (plans, launched step, start time) of the step in flight
        # asynchronous scheduling: (plan, its requests by id) of the last launched step not yet followed by another
        self._last_launched = None
        # steps launched while the one before them was still in flight (asynchronous scheduling's
        # overlap actually taken; a step that had to wait for its predecessor's report is not counted)
        self.num_overlapped_steps = 0
        self._last_report = 0.0  # when the last step's results were processed (perf_counter)

        self.load_report = None
        if self.parallel_config.is_single_rank:
            ctx = ParallelContext.single(self.device)
            ctx.debug_layouts = args.debug_layouts
            model, _, self.load_report = build_model(
                self.model_path, hf_config, ctx, dtype=self.dtype, device=self.device, progress=args.show_progress,
                model_options=model_options, load_format=args.load_format, seed=args.seed,
            )
            token_history_len = getattr(model, "token_history_len", 0)
            self.executor = InProcessExecutor(
                ModelRunner(model, device=self.device, eos_token_ids=self.eos_token_ids, vocab_size=cfg.vocab_size,
                            ssm_state_dtype=setup.ssm_state_dtype, kv_cache_dtype=setup.kv_cache_dtype,
                            logprobs_mode=args.logprobs_mode)
            )
        else:
            from lamina.engine.mp_executor import MultiprocExecutor, worker_spec

            pc = self.parallel_config
            if pc.node_rank != 0:
                raise ValueError(
                    f"node_rank = {pc.node_rank}: only node 0 runs the engine; start other nodes with "
                    "`lamina generate/serve ... --node-rank N` (headless) or lamina.engine.mp_executor.run_headless_node"
                )
            self.executor = MultiprocExecutor(worker_spec(setup), setup.node_ranks())
            token_history_len = model_cls.token_history_len_for(cfg) if hasattr(model_cls, "token_history_len_for") else 0
        self.memory_plan = None  # CUDA without a given KV size: lamina.engine.memory_plan's MemoryPlan
        try:
            num_blocks, max_num_seqs = self._num_kv_blocks(max_num_seqs, max_batched)
            with self._out_of_memory_explained("allocating the KV cache and the state slots"):
                self.executor.allocate(num_blocks, args.block_size, max_num_seqs)
        except BaseException:
            self.executor.shutdown()
            raise
        self.cuda_graphs = False
        self.no_graphs_reason: str | None = None  # several ranks: why they decode eagerly
        with self._out_of_memory_explained("capturing the decode graphs"):
            if self.parallel_config.is_single_rank and not args.enforce_eager:
                k = self.spec_config.num_speculative_tokens if self.spec_config is not None else 0
                from lamina.worker.mixed_graphs import mixed_graph_max_tokens

                self.cuda_graphs = self.executor.runner.capture_decode_graphs(
                    max_num_seqs, self.max_model_len, num_speculative_tokens=k,
                    mixed_max_tokens=mixed_graph_max_tokens() if args.prefill_graphs else 0,
                    capture_sizes=args.cudagraph_capture_sizes, max_capture_size=args.max_cudagraph_capture_size,
                )
            elif not args.enforce_eager and self.device.type == "cuda":
                self._capture_multirank_graphs(max_num_seqs)
        self.num_replicas = self.plan.dp
        self.prefix_caching = bool(args.enable_prefix_caching)
        self.caches = [CacheManager(num_blocks, args.block_size, max_num_seqs, prefix_caching=self.prefix_caching,
                                    prefix_cache_min_tokens=args.prefix_cache_min_tokens,
                                    prefix_cache_junctions=args.prefix_cache_junctions)
                       for _ in range(self.num_replicas)]
        self.schedulers = [
            Scheduler(SchedulerConfig(max_num_seqs, max_batched, self.max_model_len, token_history_len=token_history_len), cache)
            for cache in self.caches
        ]
        self.scheduler, self.cache = self.schedulers[0], self.caches[0]
        self.step_token_counts: collections.deque[tuple[int, ...]] = collections.deque(maxlen=4096)
        self._states: dict[str, _RequestState] = {}
        self._parents: dict[str, ParentRequest] = {}  # n / best_of > 1: parent id -> its children
        self._parent_of: dict[str, str] = {}  # child id -> parent id
        self._replica_of: dict[str, int] = {}
        # n / best_of: the children prefill the prompt once and fork (Scheduler.add_group); tests
        # turn it off to compare with every child prefilling the prompt itself.
        self.share_prompt_prefill = True
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        self.num_kv_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_batched
        # Speculative decoding: the K policy, engine-wide counters, each replica's commits for the
        # next plan, and (tests only) a hook that replaces the drafter's proposals.
        self._spec_layers = (cfg.num_hidden_layers, num_mtp_layers(hf_config))
        self.draft_override = None  # tests: callable(request, proposed drafts) -> drafts
        self._reset_statistics()
        # the noise of unseeded requests: the engine's own stream (the caller's global torch RNG is neither
        # read nor reseeded: lamina.worker.sampling_rng), started again after the warm-up's draws (on every
        # rank: their sampler warm-up at allocation draws too)
        self.executor.restart_unseeded_streams(args.seed)
        if self.device.type == "cuda":
            with self._out_of_memory_explained("warming up (a step of max_num_batched_tokens tokens)"):
                self.warm_up()
            self._capture_mixed_graphs_at_start()
            self.executor.restart_unseeded_streams(args.seed)
            torch.cuda.set_rng_state(callers_cuda_rng, self.device)

    def _capture_mixed_graphs_at_start(self) -> None:
        """Single-rank CUDA engines with prefill / mixed graphs: capture every shape a step can take
        that the warm-up did not, as vLLM captures its graphs at start-up, so none is captured
        mid-serving, stalling the running requests (`LAMINA_MIXED_GRAPHS_AT_START=0`: each shape
        when first met, as before)."""
        from lamina.worker.mixed_graphs import mixed_graphs_at_start

        graphs = getattr(getattr(self.executor, "runner", None), "mixed_graphs", None)
        if graphs is None or not mixed_graphs_at_start():
            return
        start, before = time.perf_counter(), graphs.captures
        with self._out_of_memory_explained("capturing the prefill / mixed step graphs"):
            added = graphs.capture_all(self.max_num_batched_tokens)
        logger.info("prefill / mixed step graphs: %d shapes captured at start-up in %.1f s (%d by the warm-up)",
                    added, time.perf_counter() - start, before)

    def _reset_statistics(self) -> None:
        """Speculative decoding's K policy and counters, and the token counters for metrics (as
        vLLM's: prompt tokens of requests that got their first token, every generated token)."""
        self.spec_policy = None
        self.spec_decode_metrics: SpecDecodeMetrics | None = None
        self.num_draft_tokens = 0  # drafts proposed in the last step
        if self.spec_config is not None:
            num_hidden_layers, num_mtp = self._spec_layers
            self.spec_policy = SpecDecodePolicy(
                self.spec_config, num_hidden_layers=num_hidden_layers, num_mtp_layers=num_mtp, device_type=self.device.type,
            )
            self.spec_decode_metrics = SpecDecodeMetrics()
        self._pending_commits: list[dict[str, int]] = [{} for _ in range(self.num_replicas)]
        self.num_prompt_tokens_processed = 0
        self.num_generation_tokens_processed = 0
        for scheduler in self.schedulers:
            scheduler.num_prefix_queries = scheduler.num_prefix_hits = 0
        self.step_token_counts.clear()
        self.iteration_tokens = TokenCountHistogram()  # tokens of each step (vLLM's vllm:iteration_tokens_total)

    def _capture_multirank_graphs(self, max_num_seqs: int) -> None:
        """Several ranks (TP / PP / DP / EP): every rank captures its decode graphs
        (lamina.worker.cuda_graphs.multirank_graphs_reason says which layouts, and why not)."""
        from lamina.worker.cuda_graphs import multirank_graphs_reason

        self.no_graphs_reason = multirank_graphs_reason(self.plan, speculative=self.spec_config is not None)
        if self.no_graphs_reason is not None:
            logger.info("decode steps run eagerly (no CUDA graphs): %s", self.no_graphs_reason)
            return
        k = self.spec_config.num_speculative_tokens if self.spec_config is not None else 0
        per_rank = self.executor.capture_decode_graphs(
            max_num_seqs, self.max_model_len, num_speculative_tokens=k,
            capture_sizes=self.args.cudagraph_capture_sizes, max_capture_size=self.args.max_cudagraph_capture_size)
        self.cuda_graphs = all(ok for ok, _ in per_rank)
        if not self.cuda_graphs:
            self.no_graphs_reason = "; ".join(f"rank {r}: {why}" for r, (ok, why) in enumerate(per_rank) if not ok)
            logger.info("decode steps run eagerly (no CUDA graphs): %s", self.no_graphs_reason)

    # ---- requests ------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the generation config's defaults (vLLM's get_default_sampling_params)."""
        return SamplingParams(**self.default_sampling)

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Also takes vLLM's order, `add_request(request_id, prompt,
        params)`: told apart by where the SamplingParams is (a prompt is never one)."""
        if not isinstance(params, SamplingParams) and isinstance(request_id, SamplingParams):
            prompt, params, request_id = params, request_id, prompt  # vLLM's (request_id, prompt, params)
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"add_request: params must be a SamplingParams, got {type(params).__name__} (the "
                            "arguments are (prompt, params, request_id), or vLLM's (request_id, prompt, params))")
        params = params or self.default_sampling_params()
        text, token_ids = self.prepare_request_prompt(prompt, params.truncate_prompt_tokens)
        max_tokens = self.validate_request(token_ids, params)
        cache_salt = self.prompt_cache_salt(prompt)
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if request_id in self._states or request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.best_of > 1:
            child_ids = [child_request_id(request_id, i) for i in range(params.best_of)]
            if any(c in self._states for c in child_ids):
                raise ValueError(f"request id {request_id!r} is already in use")
            self._parents[request_id] = ParentRequest(request_id, params, child_ids)
            replica = self._pick_replica()  # the children share the prompt's prefill: one replica
            children = []
            for i, child_id in enumerate(child_ids):
                self._parent_of[child_id] = request_id
                children.append(self._new_sequence(child_id, text, token_ids, child_params(params, i), max_tokens, replica,
                                                   cache_salt))
            if self.share_prompt_prefill:
                self.schedulers[replica].add_group(children)
            else:
                for child in children:
                    self.schedulers[replica].add(child)
            return request_id
        replica = self._pick_replica()
        self.schedulers[replica].add(self._new_sequence(request_id, text, token_ids, params, max_tokens, replica, cache_salt))
        return request_id

    def _pick_replica(self) -> int:
        """Data parallel: the replica with the fewest unfinished requests."""
        return min(range(self.num_replicas), key=lambda r: (self.schedulers[r].num_waiting + self.schedulers[r].num_running, r))

    def _new_sequence(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                      max_tokens: int, replica: int, cache_salt: str | None = None) -> Request:
        """The engine's bookkeeping of one sequence on `replica`; the caller hands it to the scheduler."""
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
            arrival_index=next(self._arrivals), max_tokens=max_tokens, prompt=text,
            eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
        )
        detok = (
            IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens, params.spaces_between_special_tokens)
            if self.tokenizer is not None and params.detokenize else None
        )
        self._states[request_id] = _RequestState(request, detok)
        if params.structured_outputs is not None:
            self.structured.add(request_id, params.structured_outputs)
        self._replica_of[request_id] = replica
        return request

    def abort_request(self, request_id: str) -> None:
        """Abort a request; one sequence of an n / best_of request (`<id>#<i>`) aborts the whole
        request (aborted alone, it never finished, and its parent waited for it for ever)."""
        request_id = self._parent_of.get(request_id, request_id)
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for child_id in parent.child_ids:
                self._parent_of.pop(child_id, None)
                self.abort_request(child_id)
            return
        state = self._states.pop(request_id, None)
        replica = self._replica_of.pop(request_id, 0)
        self.structured.remove(request_id)
        if state is not None and not state.request.status.finished:
            self.schedulers[replica].finish(state.request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self._inflight is not None or any(s.has_unfinished() for s in self.schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    def cache_usage(self) -> float:
        return sum(c.usage() for c in self.caches) / len(self.caches)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)

    @property
    def num_preemption_recompute_tokens(self) -> int:
        """Computed tokens whose cache preemptions dropped (to be computed again)."""
        return sum(s.num_preemption_recompute_tokens for s in self.schedulers)

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that got a new token. With asynchronous
        scheduling, launches the next step and returns the outputs of the one before it."""
        started = time.perf_counter()
        if self.async_scheduling:
            outputs = [] if self._may_plan_ahead() else self._finish_inflight()
            return outputs + self._step_overlapped(self._plan_step(), started)
        plans = self._plan_step()
        if plans is None:
            return []
        return self._finish_step(plans, self.executor.execute_replicas(plans), started)

    def _may_plan_ahead(self) -> bool:
        """Asynchronous scheduling: whether the next step may be planned while one is in flight.
        Plain decoding always may (its pending tokens are filled in on the device). Speculative
        decoding may when that step's pending tokens, drafts and positions can all be filled in by
        the verification graphs: every running request decodes in the step in flight, nothing
        waits, the batch fits the graphs, and no request needs its real token count on the host
        (min_tokens not yet reached) or its tokens (penalties, grammar); else the step in flight
        reports first."""
        if self._inflight is None or self.spec_config is None:
            return True
        if self.draft_override is not None or self.num_replicas != 1:
            return False
        scheduler = self.scheduler
        if not scheduler.all_running_pending():
            return False
        queries = 1 + max((r.num_pending_drafts for r in scheduler.running), default=0)
        if not self.executor.runner.fits_verify_graphs(queries, scheduler.num_running):
            return False
        for request in scheduler.running:
            params = request.sampling_params
            if (params.needs_output_tokens or self.structured.has(request.request_id)
                    or len(request.output_token_ids) < params.min_tokens):
                return False
        return True

    def _step_overlapped(self, plans, started: float) -> list[RequestOutput]:
        launched = None
        if plans is not None:
            handle = self.executor.launch(plans[0])
            self.num_overlapped_steps += self._inflight is not None
            # computed as planned, drafts as if all accepted (`_process` takes back the rejected ones);
            # sampled tokens pending
            self.scheduler.on_step_done(plans[0], assume_accepted=True)
            requests = {}  # the requests of this step (an id may be taken again once its request ends)
            for chunk in plans[0].chunks:
                request = requests[chunk.request_id] = self._states[chunk.request_id].request
                if chunk.sample:
                    request.num_pending_tokens += 1 + chunk.num_draft_tokens
                    request.num_pending_drafts = plans[0].num_draft_tokens
            self._last_launched = (plans[0], requests)
            launched = (plans, handle, started, requests)
        outputs = self._finish_inflight() if self._inflight is not None else []
        self._inflight = launched
        if launched is not None and not plan_may_overlap(plans, self.structured.has):
            outputs += self._finish_inflight()
        return outputs

    def _finish_inflight(self) -> list[RequestOutput]:
        plans, handle, started, requests = self._inflight
        self._inflight = None
        return self._finish_step(plans, [handle.result()], started, launched_requests=requests)

    def _plan_step(self):
        """This step's plans (one per replica), or None when there is nothing to run."""
        num_drafts = self._decide_num_draft_tokens()
        plans = [scheduler.schedule(num_drafts) for scheduler in self.schedulers]
        self._note_waits(plans, time.monotonic())
        if self.async_scheduling and self.spec_config is not None and self._last_launched is not None:
            # The runner commits the last launched step's verifications from its own accepted
            # counts on the device (this plan may be made before they reach the engine).
            running = {r.request_id: r for r in self.scheduler.running}
            last_plan, last_requests = self._last_launched
            plans[0].device_commits = [c.request_id for c in last_plan.chunks if c.num_draft_tokens
                                       and running.get(c.request_id) is last_requests[c.request_id]]
        if all(p.is_empty for p in plans):
            if any(p.finished_request_ids or p.has_copies for p in plans):
                self.executor.execute_replicas(plans)  # let workers drop per-request state, copy caches
                self._last_launched = None  # its verifications are committed now
            return None
        self._fill_token_bitmasks(plans)
        counts = tuple(p.num_tokens for p in plans)
        self.step_token_counts.append(counts)
        self.iteration_tokens.observe(sum(counts))
        for replica, p in enumerate(plans):
            p.num_draft_tokens = num_drafts
            running = {r.request_id for r in self.schedulers[replica].running}
            p.spec_commits = {rid: a for rid, a in self._pending_commits[replica].items() if rid in running}
            self._pending_commits[replica] = {}
        if self.num_replicas > 1:
            samples = tuple(sum(c.sample for c in p.chunks) for p in plans)
            for p in plans:
                p.dp_num_tokens = counts
                p.dp_num_samples = samples
        return plans

    def _finish_step(self, plans, sampled_by_replica, started: float, launched_requests: dict | None = None):
        """Advance the schedulers (done at launch for an overlapped step, whose `launched_requests`
        are the requests it sampled for) and turn the sampled tokens into outputs."""
        num_drafts = plans[0].num_draft_tokens
        outputs, verifications = [], []
        for replica, plan in enumerate(plans):
            if launched_requests is None:
                self.schedulers[replica].on_step_done(plan, sampled_by_replica[replica])
            outputs += self._process(plan, sampled_by_replica[replica], self.schedulers[replica], replica, verifications,
                                     launched_requests)
        now = time.perf_counter()
        if self.spec_policy is not None:
            self.spec_policy.observe(verifications)
            if all(_steady_decode(c, num_drafts) for p in plans for c in p.chunks):
                batch = max(len(p.chunks) for p in plans)  # the requests that decoded
                # an overlapped step reports one step period after the one before it (its own
                # start lies before that one's end): its time is the span between the two reports
                self.spec_policy.observe_step_time(batch, num_drafts, now - max(started, self._last_report))
        self._last_report = now
        return outputs

    def _note_waits(self, plans, now: float) -> None:
        """Request timing for metrics: a preempted request starts waiting again; a scheduled one stops
        waiting (its wait adds to its queue time), and the first time is its first scheduling."""
        for plan in plans:
            for request_id in plan.preempted_request_ids:
                state = self._states.get(request_id)
                if state is not None:
                    state.waiting_since = now
            for chunk in plan.chunks:
                state = self._states.get(chunk.request_id)
                if state is None or state.waiting_since is None:
                    continue
                state.metrics.queue_time += now - state.waiting_since
                state.waiting_since = None
                if state.metrics.first_scheduled_time is None:
                    state.metrics.first_scheduled_time = now

    def _fill_token_bitmasks(self, plans) -> None:
        """Structured output: the grammar's allowed next tokens for every sampling chunk that has one
        (with drafts to verify, at every verified position: the grammar advanced through the drafts
        before it; such steps are never planned ahead, so the drafts are known here)."""
        for plan in plans:
            for chunk in plan.chunks:
                if not (chunk.sample and self.structured.has(chunk.request_id)):
                    continue
                k = chunk.num_draft_tokens
                if not k:
                    chunk.token_bitmask = self.structured.bitmask(chunk.request_id)
                    continue
                drafts = chunk.token_ids[-k:]
                if PENDING_TOKEN_ID in drafts:
                    raise RuntimeError(f"request {chunk.request_id}: drafts still pending, its grammar cannot mask them")
                masks = self.structured.bitmasks_along(chunk.request_id, drafts)
                chunk.token_bitmask, chunk.draft_token_bitmasks = masks[0], masks[1:]

    def _decide_num_draft_tokens(self) -> int:
        """Drafts to propose this step (0 without speculative decoding)."""
        if self.spec_policy is None:
            return 0
        running = max(s.num_running for s in self.schedulers)  # the requests about to decode
        if running == 0 and not any(s.num_waiting for s in self.schedulers):
            self.num_draft_tokens = 0  # nothing to run: leave the policy's counters alone
            return 0
        batch = min(running or max(s.num_waiting for s in self.schedulers), self.max_num_seqs)
        self.num_draft_tokens = self.spec_policy.decide(batch)
        return self.num_draft_tokens

    def _process(self, plan, sampled, scheduler, replica: int = 0, verifications: list | None = None,
                 launched_requests: dict | None = None) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for chunk in plan.chunks:
            result = sampled.get(chunk.request_id)
            state = self._states.get(chunk.request_id)
            if result is None or state is None:
                continue
            if launched_requests is not None and launched_requests.get(chunk.request_id) is not state.request:
                continue  # the request ended while this step ran (and its id was taken again since)
            request = state.request
            if result.prompt_logprobs is not None and state.prompt_logprobs is not None:
                start = result.prompt_logprobs_start
                state.prompt_logprobs[start:start + len(result.prompt_logprobs)] = [
                    self._with_token_text(entry) for entry in result.prompt_logprobs]
                if result.prompt_logprob_ranks is not None:
                    state.prompt_logprob_ranks[start:start + len(result.prompt_logprob_ranks)] = result.prompt_logprob_ranks
            if result.token_id is None:
                continue  # a prompt chunk that only scored prompt logprobs
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                self.num_prompt_tokens_processed += request.num_prompt_tokens
            elif state.metrics.last_token_time is not None:
                state.metrics.inter_token_latencies.append(now - state.metrics.last_token_time)
            state.metrics.last_token_time = now
            if launched_requests is not None:  # this step's tokens, now known
                request.num_pending_tokens -= 1 + chunk.num_draft_tokens
                if not request.num_pending_tokens:
                    request.num_pending_drafts = 0
                scheduler.on_verified(request, chunk.num_draft_tokens - len(result.accepted_token_ids))
            # Speculative decoding emits the accepted drafts, then the target's own token.
            for token, logprobs in zip(result.token_ids, [*result.accepted_logprobs, result.logprobs]):
                request.append_output(token)
                self.num_generation_tokens_processed += 1
                if not self.structured.accept(request.request_id, token):
                    logger.warning("request %s: token %d is outside its grammar", request.request_id, token)
                if state.logprobs is not None and logprobs is not None:
                    state.logprobs.append(self._with_token_text(logprobs))
                    state.cumulative_logprob += logprobs.get(token, 0.0)
                new_text = ""
                if state.detokenizer is not None and (
                        not self._stops_on_token(request, token) or request.sampling_params.include_stop_str_in_output):
                    new_text = state.detokenizer.push([token])  # a stopping token's text only when asked (vLLM)
                state.text += new_text
                self._check_stop(state, len(new_text), scheduler)
                if request.status.finished:
                    break
            if self.spec_config is not None:
                self._after_verification(state, chunk, result, replica, verifications)
            if request.status.finished:
                state.metrics.finished_time = now
                state.metrics.num_preemptions = request.num_preemptions
                if state.detokenizer is not None and not isinstance(request.stop_reason, str):
                    state.text += state.detokenizer.flush()  # text held back for an unfinished character
            final_only = request.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
            if final_only and not request.status.finished:
                continue  # no output before the last one (LLM.generate reads only that)
            output = self._make_output(state)
            parent_id = self._parent_of.get(request.request_id)
            if parent_id is not None:
                output = self._parents[parent_id].update(output)
                if output is not None and output.finished:
                    self._forget_parent(parent_id)
                if final_only and output is not None and not output.finished:
                    output = None  # another child is still running
            if output is not None:
                outputs.append(output)
            if request.status.finished:
                del self._states[request.request_id]
                self._replica_of.pop(request.request_id, None)
                self.structured.remove(request.request_id)
        return outputs

    def _forget_parent(self, parent_id: str) -> None:
        parent = self._parents.pop(parent_id)
        for child_id in parent.child_ids:
            self._parent_of.pop(child_id, None)

    def _after_verification(self, state: _RequestState, chunk, result, replica: int, verifications) -> None:
        """Count the step's acceptance; keep the next drafts and the rollback for the next plan."""
        request = state.request
        accepted = len(result.accepted_token_ids)
        if chunk.num_draft_tokens:
            state.spec.record(chunk.num_draft_tokens, accepted)
            self.spec_decode_metrics.record(chunk.num_draft_tokens, accepted)
            if verifications is not None:
                verifications.append((chunk.num_draft_tokens, accepted))
        if request.status.finished:
            return
        drafts = list(result.draft_token_ids)
        if self.draft_override is not None:
            drafts = list(self.draft_override(request, drafts))
        request.spec_token_ids = drafts  # also when preempted while this step ran: its recomputation verifies them
        if request.status == RequestStatus.WAITING:
            return
        if chunk.num_draft_tokens and not self.async_scheduling:  # asynchronous: the runner commits (device_commits)
            self._pending_commits[replica][request.request_id] = accepted

    def _with_token_text(self, entry: dict | None) -> dict | None:
        """A logprobs entry whose `Logprob` values carry their token's text (vLLM's decoded_token)."""
        if entry is None or self.tokenizer is None:
            return entry
        texts = self._token_texts  # one decode per vocabulary id, ever: logprobs=20 at batch 64 is 1,344 a step
        for token_id, value in entry.items():
            if isinstance(value, Logprob) and value.decoded_token is None:
                text = texts.get(token_id)
                if text is None:
                    text = texts[token_id] = self.tokenizer.decode([token_id])
                value.decoded_token = text
        return entry

    @staticmethod
    def _stops_on_token(request, token: int) -> bool:
        """Whether `token`, just appended, ends the request as EOS or one of its stop_token_ids."""
        params = request.sampling_params
        if len(request.output_token_ids) < params.min_tokens:
            return False
        return (not params.ignore_eos and token in request.eos_token_ids) or token in params.stop_token_ids

    def _check_stop(self, state: _RequestState, new_text_len: int, scheduler: Scheduler) -> None:
        """EOS and stop_token_ids end a request from min_tokens on; stop strings are looked for only
        once more than min_tokens tokens are out, in the tail the last token completed (vLLM: a stop
        string wholly inside the first min_tokens tokens' text is never found; one that ends after
        them is)."""
        request = state.request
        params = request.sampling_params
        token = request.output_token_ids[-1]
        num_out = len(request.output_token_ids)
        status = None
        if self._stops_on_token(request, token):
            status = RequestStatus.FINISHED_STOPPED
            ends_as_eos = not params.ignore_eos and token in request.eos_token_ids
            if not ends_as_eos or token != self.primary_eos_token_id:  # a stop id, or a secondary EOS
                request.stop_reason = token
        elif params.stop and num_out > params.min_tokens:
            hit = find_stop_string(state.text, new_text_len, params.stop, params.include_stop_str_in_output)
            if hit is not None:
                stop, cut = hit
                state.text = state.text[:cut]
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if status is None and (num_out >= request.max_tokens or request.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            scheduler.finish(request, status)

    def _make_output(self, state: _RequestState) -> RequestOutput:
        request = state.request
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.status.finished,
            metrics=state.metrics,
            spec_decode=state.spec if self.spec_config is not None else None,
            prompt_logprobs=state.prompt_logprobs,  # complete before the first token is reported
            prompt_logprob_ranks=state.prompt_logprob_ranks,
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's: `method` (a ModelRunner method's name, or a callable given the runner; picklable
        where ranks are processes) on every rank, between steps; one result per rank, in rank order."""
        if self.has_unfinished_requests():
            raise RuntimeError("collective_rpc runs between generations: requests are still in flight")
        return self.executor.collective_rpc(method, args, kwargs)

    def reset_prefix_cache(self) -> bool:
        """Drop every kept prompt prefix (vLLM's; after a weight update); True."""
        return all([cache.reset_prefix_cache() for cache in self.caches])

    @property
    def num_prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)."""
        return sum(s.num_prefix_queries for s in self.schedulers)

    @property
    def num_prefix_cache_hits(self) -> int:
        """Prompt tokens served from kept prefixes (vLLM's prefix_cache_hits)."""
        return sum(s.num_prefix_hits for s in self.schedulers)

    def shutdown(self) -> None:
        self._inflight = None
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
        self._states.clear()
        self._parents.clear()
        self._parent_of.clear()

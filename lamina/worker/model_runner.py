"""A rank's model runner: owns its model stage, its KV / recurrent-state tensors and the sampler.

It receives a `StepPlan`, derives every input tensor from it (token ids, positions, query
boundaries, slot mappings, block tables, state slots, token history), runs its stage and, on the
last stage, samples the next token of each request whose chunk reached its end. The scheduler
never sees tensors; this is where plan integers become tensors. With speculative decoding (the
model has an MTP drafter) the last stage verifies drafts and proposes new ones instead
(lamina.worker.spec_step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from lamina.host_to_device import to_device
from lamina.kernels.request_groups import enabled as request_groups_enabled
from lamina.kernels.selection import kernel_set, sampler_kernels
from lamina.layers.metadata import ForwardMetadata
from lamina.sampling_params import SamplingParams
from lamina.step_plan import PENDING_TOKEN_ID, SampledToken, ScheduledChunk, StepPlan
from lamina.worker.cuda_graphs import can_replay
from lamina.worker.pending_step import PendingSamples, PreviousTokens, ReadyStep
from lamina.worker.prompt_logprobs import score_prompt_chunks
from lamina.worker.sampler import Sampler, SamplingBatch

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """A step's input tensors on this rank, derived from its plan (`ModelRunner.prepare`)."""

    token_ids: torch.Tensor  # [T] long
    meta: ForwardMetadata
    logits_rows: list[int]  # rows of the sampling chunks' last tokens


class ModelRunner:
    def __init__(self, model, *, device: torch.device, eos_token_ids: tuple[int, ...], vocab_size: int,
                 ssm_state_dtype: torch.dtype = torch.float32, kv_cache_dtype: torch.dtype | None = None,
                 logprobs_mode: str = "raw_logprobs"):
        self.model = model
        self.ssm_state_dtype = ssm_state_dtype  # the delta-net recurrent state pools' (mamba_ssm_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype or model.dtype  # the attention layers' paged caches' (kv_cache_dtype)
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.sampler = Sampler(logprobs_mode)  # logprobs_mode: what sampled tokens' logprobs report
        self.sampler_kernels = sampler_kernels(kernel_set(device))  # the sampler's own: seeded noise, the top-k window
        self.block_size = 0
        self.kv_cache_bytes = 0
        self.state_bytes = 0
        self.spare_state_bytes = 0
        self.spare_state_slot = 0  # a state slot no request owns: padding rows of captured graphs
        self.decode_graphs = None  # lamina.worker.cuda_graphs.DecodeGraphs, once captured
        self.mixed_graphs = None  # lamina.worker.mixed_graphs.MixedGraphs: short prefill / mixed steps
        self.no_mixed_graphs_reason: str | None = None  # why `capture_decode_graphs` made none (None: not asked, or made)
        self.mixed_replays = 0  # prefill / mixed steps run from their graphs (tests, benchmarks)
        self.verify_graphs = None  # lamina.worker.verify_graphs.VerifyGraphs (MTP), once captured
        self.no_graphs_reason: str | None = None  # why `capture_decode_graphs` captured nothing (None: not asked, or captured)
        self.request_groups = request_groups_enabled()
        self.previous = None  # PreviousTokens of the last launched step that sampled (pending tokens)
        self.graph_replays = 0  # decode steps run from the captured graphs (tests, benchmarks)
        self.spec = None
        if getattr(model, "speculative", False):  # every stage: recurrent states are rolled back
            from lamina.worker.spec_step import SpecDecodeStep

            self.spec = SpecDecodeStep(model, device, eos_token_ids, vocab_size, self.sampler_kernels, logprobs_mode)

    # ---- caches --------------------------------------------------------------------------
    def paged_cache_modules(self) -> list:
        """The target's paged-cache layers and the MTP drafter's (same block tables)."""
        mtp = getattr(self.model, "mtp", None)
        return self.model.paged_cache_modules() + (mtp.paged_cache_modules() if mtp is not None else [])

    def paged_cache_bytes_per_block(self, block_size: int) -> int:
        return sum(m.paged_cache_bytes_per_block(block_size, self.kv_cache_dtype) for m in self.paged_cache_modules())

    def state_bytes_per_slot(self) -> int:
        """Recurrent-state bytes of one request slot on this rank. Before `allocate_caches` it binds
        throwaway meta tensors that the allocation then replaces; after it, the pools stay and the
        bytes of the spare slot (one slot's) are returned."""
        if self.spare_state_bytes:  # allocated (e.g. asked through collective_rpc): keep the pools
            return self.spare_state_bytes
        return sum(m.bind_state(1, self.model.dtype, "meta", ssm_dtype=self.ssm_state_dtype)
                   for m in self.model.state_modules())

    def allocate_caches(self, num_kv_blocks: int, block_size: int, num_state_slots: int) -> None:
        self.block_size = block_size
        for module in self.paged_cache_modules():
            self.kv_cache_bytes += module.bind_paged_cache(num_kv_blocks, block_size, self.kv_cache_dtype, self.device)
        # One spare slot past the requests' (padding rows of captured decode graphs write there);
        # `state_bytes` counts the requests' slots, `spare_state_bytes` the spare.
        self.spare_state_slot = num_state_slots
        for module in self.model.state_modules():
            total = module.bind_state(num_state_slots + 1, self.model.dtype, self.device,
                                      ssm_dtype=self.ssm_state_dtype)
            per_slot = total // (num_state_slots + 1)
            self.state_bytes += per_slot * num_state_slots
            self.spare_state_bytes += per_slot
        if self.sampler_kernels == "triton" and self.device.type == "cuda":
            self.warm_sampler_kernels()

    @torch.inference_mode()
    def warm_sampler_kernels(self) -> None:
        """Compile the sampler's Triton kernels (seeded noise, the top-k window's cut, the search cut
        of rows with a wider top-k or top-p alone where `LAMINA_NUCLEUS_CUT=1`) now, at the vocabulary
        they will see, rather than under the first request that needs them."""
        params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=0),
                  SamplingParams(temperature=0.7, top_p=0.9)]  # the top-k window; top-p alone
        batch = SamplingBatch.build(params, [0, 0], list(self.eos_token_ids), self.device, self.vocab_size,
                                    sampler_kernels=self.sampler_kernels)
        self.sampler(torch.zeros(2, self.vocab_size, device=self.device), batch)

    @torch.inference_mode()
    def apply_cache_copies(self, plan: StepPlan) -> None:
        """Prompt sharing: copy the plan's KV blocks and state slots (source -> destination) in every
        cache tensor of this rank, one batched `index_copy_` per tensor, before the step's forward."""
        if not plan.has_copies:  # nearly every step: skip walking the layers for their tensors
            return
        for pairs, tensors in (
            (plan.block_copies, [t for m in self.paged_cache_modules() for t in m.paged_cache_tensors()]),
            (plan.state_copies, [t for m in self.model.state_modules() for t in m.state_tensors()]),
        ):
            if not pairs or not tensors:
                continue
            src = to_device([s for s, _ in pairs], self.device)  # [N]
            dst = to_device([d for _, d in pairs], self.device)  # [N]
            for cache in tensors:  # [num_blocks or num_slots, ...]
                if cache.dtype.itemsize == 1:  # an FP8 KV cache: no index_copy_ for it on the CPU; the bytes
                    cache = cache.view(torch.uint8)
                cache.index_copy_(0, dst, cache.index_select(0, src))

    def why_no_graphs(self, static_off_cuda: bool = False) -> str | None:
        """Why `capture_decode_graphs` would capture nothing on this rank (None: it captures). Asked
        of every rank before any captures (lamina.worker.worker): a rank that skipped the capture
        while its peers captured would leave their collectives waiting for it."""
        from lamina.worker import cuda_graphs

        if self.device.type != "cuda" and not static_off_cuda:
            return f"CUDA graphs need a CUDA device, not {self.device}"
        reason = cuda_graphs.why_not_capturable(self.model, verify=self.spec is not None)
        if reason is None and self.spec is not None and self.spec.mtp is None:
            reason = "speculative decoding with no MTP drafter on this rank: verification steps run eagerly"
        return reason

    def capture_decode_graphs(
        self, max_batch: int, max_model_len: int, *, num_speculative_tokens: int = 0, static_off_cuda: bool = False,
        mixed_max_tokens: int = 0, capture_sizes: tuple[int, ...] | None = None, max_capture_size: int | None = None,
    ) -> bool:
        """Capture CUDA graphs of decode steps for padded batch sizes up to `max_batch` (single-rank
        CUDA runs whose decode kernels are graph-safe): one-token steps without MTP; with MTP the
        target's step of Q = 1..K+1 tokens per request (lamina.worker.verify_graphs, K =
        `num_speculative_tokens`). Returns whether graphs were captured. `static_off_cuda`
        (tests): on the CPU, run decode steps through the graphs' static buffers and padding, eagerly.
        `mixed_max_tokens` > 0 (single rank): short prefill and mixed steps of up to that many
        tokens run from graphs too (under MTP those without drafts), each shape captured when first
        needed or by the engine's `capture_all` at start-up (lamina.worker.mixed_graphs). `capture_sizes` / `max_capture_size`: vLLM's
        cudagraph_capture_sizes / max_cudagraph_capture_size, in tokens (EngineArgs): which sizes
        (`cuda_graphs.graph_sizes`), and a cap on the mixed graphs' tokens."""
        from lamina.worker import cuda_graphs

        self.no_graphs_reason = self.no_mixed_graphs_reason = None
        self.decode_graphs = self.verify_graphs = self.mixed_graphs = None  # a capture replaces what was there
        reason = self.why_no_graphs(static_off_cuda)
        if reason is not None:
            logger.info("decode steps run eagerly (no CUDA graphs): %s", reason)
            self.no_graphs_reason = reason
            return False
        max_blocks = -(-max_model_len // self.block_size)
        if self.spec is not None:
            from lamina.worker.verify_graphs import VerifyGraphs

            graphs = VerifyGraphs(
                self.model, device=self.device, max_batch=max_batch, num_speculative_tokens=num_speculative_tokens,
                block_size=self.block_size, max_blocks_per_seq=max_blocks, spare_state_slot=self.spare_state_slot,
                capture_sizes=capture_sizes, max_capture_size=max_capture_size,
            )
            try:
                graphs.capture()
            except torch.OutOfMemoryError:  # the engine says which memory plan left too little room
                raise
            except (RuntimeError, MemoryError) as error:  # new on the GPU: say how to run without it
                raise RuntimeError(
                    f"capturing the MTP verification CUDA graphs failed ({type(error).__name__}: {error}); "
                    f"--enforce-eager (LLM(..., enforce_eager=True)) verifies drafts eagerly on the same kernels"
                ) from error
            self.verify_graphs = graphs
            self._make_mixed_graphs(max_batch, max_blocks, mixed_max_tokens, capture_sizes, max_capture_size, graphs)
            return True
        sizes = cuda_graphs.graph_sizes(max_batch, 1, capture_sizes, max_capture_size)  # never empty: Q = 1
        graphs = cuda_graphs.DecodeGraphs(
            self.model, device=self.device, max_batch=sizes[-1], block_size=self.block_size,
            max_blocks_per_seq=max_blocks, spare_state_slot=self.spare_state_slot,
        )
        graphs.capture(sizes)
        self.decode_graphs = graphs
        self._make_mixed_graphs(max_batch, max_blocks, mixed_max_tokens, capture_sizes, max_capture_size, graphs)
        return True

    def _make_mixed_graphs(self, max_batch: int, max_blocks: int, max_tokens: int, capture_sizes, max_capture_size,
                           decode_graphs) -> None:
        """Prefill / mixed step graphs of up to `max_tokens` tokens (0: none), within vLLM's cap on
        any graph's tokens, in the decode (or MTP verification) graphs' pool and stream. Under MTP
        they end at the hidden states, which the drafter and the verification read eagerly
        (`MixedGraphs.run_hidden`), and serve steps without drafts only (`fits_mixed_graphs`)."""
        from lamina.worker import mixed_graphs
        from lamina.worker.cuda_graphs import graph_token_limit

        if max_tokens <= 0:
            return
        limit = graph_token_limit(capture_sizes, max_capture_size)
        max_tokens = mixed_graphs.capped_tokens(max_tokens, limit)
        if not max_tokens:
            self.no_mixed_graphs_reason = f"the largest CUDA graph size, {limit} tokens, is below {mixed_graphs.MIN_TOKENS}"
            return
        reason = mixed_graphs.why_not_capturable(self.model, self.spec.mtp if self.spec is not None else None)
        if reason is not None:
            logger.info("prefill and mixed steps run eagerly (no CUDA graphs): %s", reason)
            self.no_mixed_graphs_reason = reason
            return
        self.mixed_graphs = mixed_graphs.MixedGraphs(
            self.model, device=self.device, max_tokens=max_tokens, max_reqs=max_batch, block_size=self.block_size,
            max_blocks_per_seq=max_blocks, spare_state_slot=self.spare_state_slot, vocab_size=self.vocab_size,
            pool=decode_graphs.pool, stream=decode_graphs.stream,  # one pool, captured on one stream
            keep_hidden=self.spec is not None,
        )

    # ---- inputs --------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> StepInputs:
        """Input tensors of this step, derived from the plan alone (identical on every rank)."""
        chunks = plan.chunks
        bs = self.block_size
        lens = np.array([c.num_tokens for c in chunks], dtype=np.int64)
        starts = np.array([c.start_position for c in chunks], dtype=np.int64)
        query_start_loc = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        request_index = np.repeat(np.arange(len(chunks)), lens)  # [T]
        positions = starts[request_index] + (np.arange(total) - query_start_loc[:-1][request_index])  # [T]
        max_blocks = max((len(c.block_table) for c in chunks), default=1)
        block_tables = np.zeros((len(chunks), max_blocks), dtype=np.int64)  # [B, max_blocks]
        for i, c in enumerate(chunks):
            block_tables[i, : len(c.block_table)] = c.block_table
        slot_mapping = block_tables[request_index, positions // bs] * bs + positions % bs if total else np.zeros(0, np.int64)
        seq_lens = starts + lens
        token_ids = [t for c in chunks for t in c.token_ids]
        pending_rows = None
        if PENDING_TOKEN_ID in token_ids:  # asynchronous scheduling: sampled by the last launched step
            pending_rows = self._previous_tokens().source_rows(chunks)
        logits_rows = [int(query_start_loc[i + 1]) - 1 for i, c in enumerate(chunks) if c.sample]

        history_len = getattr(self.model, "token_history_len", 0)
        history = None
        if history_len > 0:
            windows = [
                [-1] * (history_len - len(c.history_token_ids[-history_len:])) + c.history_token_ids[-history_len:]
                for c in chunks
            ]
            history = to_device(windows if chunks else np.zeros((0, history_len), np.int64), self.device)  # [B, H]
        meta = ForwardMetadata(
            num_tokens=total,
            num_reqs=len(chunks),
            max_query_len=int(lens.max()) if len(chunks) else 0,
            max_seq_len=int(seq_lens.max()) if len(chunks) else 0,
            positions=to_device(positions, self.device),
            query_start_loc=to_device(query_start_loc, self.device),
            seq_lens=to_device(seq_lens, self.device),
            slot_mapping=to_device(slot_mapping, self.device),
            block_tables=to_device(block_tables, self.device),
            state_slots=to_device([c.state_slot for c in chunks], self.device),
            has_initial_state=to_device([c.start_position > 0 for c in chunks], self.device, torch.bool),
            history_token_ids=history,
            token_request_index=to_device(request_index, self.device),
            dp_num_tokens=plan.dp_num_tokens,
            state_capture=self.spec.capture_for(plan) if self.spec is not None else None,
            query_lens_host=tuple(int(n) for n in lens),
            seq_lens_host=tuple(int(n) for n in seq_lens),
            allow_groups=self.request_groups,
        )
        token_ids = to_device(token_ids, self.device)  # [T]
        if pending_rows is not None:
            self._previous_tokens().fill(token_ids, to_device(pending_rows, self.device))
        return StepInputs(token_ids, meta, logits_rows)

    def _previous_tokens(self) -> PreviousTokens:
        if self.previous is None:
            raise RuntimeError("a pending token in the plan, but no step has sampled on this runner yet")
        return self.previous

    # ---- step ----------------------------------------------------------------------------
    def forget_finished(self, plan: StepPlan) -> None:
        if self.spec is not None:
            # a preempted request keeps its draft probabilities: its recomputation verifies those drafts
            self.spec.forget(plan.finished_request_ids)

    @torch.inference_mode()
    def commit_spec_states(self, plan: StepPlan) -> None:
        """Speculative decoding: roll recurrent states back to the last step's accepted tokens."""
        if self.spec is not None:
            self.spec.commit(plan)

    @torch.inference_mode()
    def forward_stage(self, plan: StepPlan, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, StepInputs]:
        """Run this rank's stage: returns (stream or final hidden, the step's inputs)."""
        inputs = self.prepare(plan)
        return self.model(inputs.token_ids, inputs.meta, hidden), inputs

    @torch.inference_mode()
    def verify_and_propose(self, plan: StepPlan, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, SampledToken]:
        """Last stage under speculative decoding (a TP collective: every TP rank calls it); chunks that
        asked for prompt logprobs score their prompt positions too."""
        scored = score_prompt_chunks(self.model, hidden, plan.chunks) if self._scores_prompts(plan) else {}
        results = self.spec.finish_step(plan, hidden, inputs.token_ids, inputs.meta, self.block_size).result()
        return self._with_prompt_logprobs(results, scored) if self.model.ctx.tp_rank == 0 else results

    @staticmethod
    def _scores_prompts(plan: StepPlan) -> bool:
        return any(c.num_prompt_tokens for c in plan.chunks)

    @staticmethod
    def _with_prompt_logprobs(results: dict[str, SampledToken], scored: dict) -> dict[str, SampledToken]:
        """`results` with each scored request's prompt logprobs (`score_prompt_chunks`) added."""
        for request_id, (start, entries, ranks) in scored.items():
            result = results.setdefault(request_id, SampledToken(None))
            result.prompt_logprobs, result.prompt_logprobs_start = entries, start
            result.prompt_logprob_ranks = ranks
        return results

    @torch.inference_mode()
    def logits_and_sample(self, plan: StepPlan, hidden: torch.Tensor, logits_rows: list[int], *, sample: bool = True):
        """Last stage: logits of the sampling rows (a TP collective: every TP rank calls it), then
        sample on the rank that reports results. Chunks of requests that asked for prompt logprobs
        also score their prompt positions (lamina.worker.prompt_logprobs)."""
        scored = score_prompt_chunks(self.model, hidden, plan.chunks) if self._scores_prompts(plan) else {}
        chunks = [c for c in plan.chunks if c.sample]
        results = {}
        if chunks:
            rows = to_device(logits_rows, self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [B_sample, vocab]
            results = self.sample(logits, chunks) if sample else {}
        return self._with_prompt_logprobs(results, scored) if sample else results

    @torch.inference_mode()
    def replay_decode(self, plan: StepPlan, stream_in: torch.Tensor | None = None, size: int | None = None) -> torch.Tensor:
        """Logits `[B, vocab]` of a plain decode step from the captured graphs (`can_replay`); a
        pipeline stage before the last returns its output stream `[B, W]`, one after the first
        reads the previous stage's `stream_in`. `size`: the graph to replay (`replay_size`)."""
        self.graph_replays += 1
        return self.decode_graphs.run(plan.chunks, self.previous, stream_in, size=size)

    @torch.inference_mode()
    def replay_verify(self, plan: StepPlan, queries: int) -> dict[str, SampledToken]:
        """MTP: the target's step of `queries` tokens per request replayed from its verification
        graph (`VerifyGraphs.queries_for`), then verification and drafting (spec_step.finish_step)."""
        return self._launch_verify(plan, queries).result()

    @torch.inference_mode()
    def _launch_verify(self, plan: StepPlan, queries: int):
        """`replay_verify`, queued: the results come from the handle's `result()`. Chunks whose
        tokens are pending (planned before the last step's results) are filled in on the device."""
        self.graph_replays += 1
        capture = self.spec.capture_for(plan, self.verify_graphs.buffers)
        hidden, logits, token_ids, meta, shift = self.verify_graphs.run(plan.chunks, queries, capture, self.spec.previous)
        return self.spec.finish_step(plan, hidden, token_ids, meta, self.block_size, logits=logits, position_shift=shift)

    def fits_verify_graphs(self, queries: int, num_reqs: int) -> bool:
        """Speculative decoding: whether a step of `num_reqs` requests of `queries` tokens each
        replays a verification graph (a step planned ahead of the last one's results must: the
        graphs fill in its pending tokens)."""
        graphs = self.verify_graphs
        if self.spec is None or self.spec.mtp is None or graphs is None:
            return False
        return 1 <= queries <= graphs.max_queries and graphs.size_for(queries, num_reqs) is not None

    def fits_mixed_graphs(self, plan: StepPlan) -> bool:
        """MTP: whether a step replays a prefill / mixed graph: a step of the graphs' shapes with
        no drafts to verify (their states would need capture rows) and no pending tokens."""
        return (self.mixed_graphs is not None and self.mixed_graphs.fits(plan.chunks)
                and not any(c.num_draft_tokens or PENDING_TOKEN_ID in c.token_ids for c in plan.chunks))

    def execute(self, plan: StepPlan) -> dict[str, SampledToken]:
        """Single-rank step: the whole model, then sampling."""
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> PendingSamples | ReadyStep:
        """Single-rank step, queued on the device: the sampled tokens are read by `result()`, so the
        host may plan the next step meanwhile (its pending tokens come from this step's ids)."""
        self.forget_finished(plan)
        self.commit_spec_states(plan)
        self.apply_cache_copies(plan)
        if plan.is_empty:
            return ReadyStep({})
        if self.spec is None and can_replay(self.decode_graphs, plan.chunks):
            with torch.inference_mode():
                return self._sample_launch(self.replay_decode(plan), plan.chunks)  # logits [B, vocab]
        if self.spec is None and self.mixed_graphs is not None and self.mixed_graphs.fits(plan.chunks):
            logits = self.mixed_graphs.run(plan.chunks, self.previous)  # [B_sample, vocab]; None: not captured
            if logits is not None:
                self.mixed_replays += 1
                sampled = [c for c in plan.chunks if c.sample]
                if not sampled:
                    return ReadyStep({})
                with torch.inference_mode():
                    return self._sample_launch(logits, sampled)
        if self.spec is not None and self.spec.mtp is not None:
            queries = self.verify_graphs.queries_for(plan.chunks) if self.verify_graphs is not None else None
            if queries is not None:
                return self._launch_verify(plan, queries)
            if self.fits_mixed_graphs(plan):
                prefilled = self.mixed_graphs.run_hidden(plan.chunks)  # None: the shape could not be captured
                if prefilled is not None:
                    self.mixed_replays += 1
                    hidden, token_ids, meta = prefilled  # the padded step's: [Tc, H], [Tc]
                    self.spec.capture_for(plan)  # no drafts: no state to keep
                    with torch.inference_mode():
                        return self.spec.finish_step(plan, hidden, token_ids, meta, self.block_size)
            if any(PENDING_TOKEN_ID in c.token_ids for c in plan.chunks):
                raise RuntimeError(
                    "a speculative step planned ahead of the last step's results does not fit the verification "
                    "graphs (the engine plans ahead only when it does)"
                )
        hidden, inputs = self.forward_stage(plan)
        if self.spec is not None and self.spec.mtp is not None:
            if self._scores_prompts(plan):  # prompt logprobs: read with the step's results
                return ReadyStep(self.verify_and_propose(plan, hidden, inputs))
            with torch.inference_mode():
                return self.spec.finish_step(plan, hidden, inputs.token_ids, inputs.meta, self.block_size)
        if self._scores_prompts(plan) or not any(c.sample for c in plan.chunks):
            return ReadyStep(self.logits_and_sample(plan, hidden, inputs.logits_rows))
        with torch.inference_mode():
            rows = to_device(inputs.logits_rows, self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [B_sample, vocab]
            return self._sample_launch(logits, [c for c in plan.chunks if c.sample])

    def compute_logits_for_plan(self, plan: StepPlan) -> torch.Tensor:
        """Every position's logits of a plan [T, vocab] (tests compare them with transformers)."""
        hidden, _ = self.forward_stage(plan)
        with torch.inference_mode():
            return self.model.compute_logits(hidden)

    def sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> dict[str, SampledToken]:
        return self._sample_launch(logits, chunks).result()

    def _sample_launch(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> PendingSamples:
        """Sample `chunks`' rows of `logits` on the device; the ids stay there for the next step's
        pending tokens, and travel to the host without waiting."""
        batch = SamplingBatch.build(
            [c.sampling_params for c in chunks],
            [c.num_output_tokens for c in chunks],
            list(self.eos_token_ids),
            self.device,
            self.vocab_size,
            output_token_ids=[c.output_token_ids for c in chunks],
            prompt_token_ids=[c.prompt_token_ids for c in chunks],
            token_bitmasks=[c.token_bitmask for c in chunks],
            sampler_kernels=self.sampler_kernels,
        )
        out = self.sampler(logits, batch)
        self.previous = PreviousTokens(out.token_ids, {c.request_id: row for row, c in enumerate(chunks)})
        return PendingSamples(chunks, out)

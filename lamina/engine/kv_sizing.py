"""How large the engine's caches are: the KV blocks and max_num_seqs from the memory plan (CUDA) or
the given budget, max_model_len "auto", speculative decoding's reserve, and out-of-memory errors at
start-up explained (`KVCacheSizing`, a part of LLMEngine)."""

from __future__ import annotations

import contextlib
import logging

import torch

from lamina.engine.memory_plan import (
    activation_headroom_bytes, plan_gpu_memory, speculation_bytes, state_dtype_hint, usable_gpu_bytes,
)
from lamina.engine.setup import max_model_len_is_auto

__all__ = ["KVCacheSizing", "CPU_KV_CACHE_BYTES"]

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 4 << 30


class KVCacheSizing:
    """LLMEngine's start-up sizing; reads the engine's args, device, executor, model and spec configs."""

    @contextlib.contextmanager
    def _out_of_memory_explained(self, what: str):
        """Start-up on CUDA: an out-of-memory error shuts the executor down and says which plan
        left too little room for the steps and what to change (the plan's headroom is an estimate).
        A rank process's error arrives as the executor's WorkerError, whose message names its type."""
        from lamina.engine.mp_executor import WorkerError

        try:
            yield
        except (torch.OutOfMemoryError, WorkerError) as e:
            if isinstance(e, WorkerError) and "OutOfMemoryError: " not in str(e):
                raise
            self.executor.shutdown()
            plan = self.memory_plan
            plan = "" if plan is None else f" (memory plan: {plan.describe(self.args.block_size, self.max_model_len)})"
            raise RuntimeError(
                f"out of GPU memory while {what}{plan}: lower max_num_seqs, max_num_batched_tokens or "
                f"gpu_memory_utilization (= {self.args.gpu_memory_utilization}), or set kv_cache_memory_bytes"
            ) from e

    def _num_kv_blocks(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
        """(KV blocks, max_num_seqs): on CUDA without a given KV size, lamina.engine.memory_plan's
        plan (which may lower a default max_num_seqs); else the given size, less speculation's reserve."""
        args = self.args
        auto_len = max_model_len_is_auto(args)  # "auto": the model's length, shortened to what the KV cache holds
        bytes_per_block = self.executor.bytes_per_block(args.block_size)
        if args.num_gpu_blocks_override is not None:
            num_blocks = args.num_gpu_blocks_override
            if auto_len:
                self._fit_max_model_len(num_blocks * args.block_size)
        elif args.kv_cache_memory_bytes is None and self.device.type == "cuda":
            free = self.executor.min_free_bytes()
            total = torch.cuda.get_device_properties(self.device).total_memory
            k = self.spec_config.num_speculative_tokens if self.spec_config is not None else 0
            per_slot = self.executor.state_bytes_per_slot()
            mixed = 0  # the prefill / mixed steps' graphs: single rank (lamina.worker.mixed_graphs)
            if not args.enforce_eager and args.prefill_graphs and self.parallel_config.is_single_rank:
                from lamina.worker import mixed_graphs

                runner = self.executor.runner
                drafter = runner.spec.mtp if runner.spec is not None else None
                if (k == 0 or drafter is not None) and mixed_graphs.why_not_capturable(runner.model, drafter) is None:
                    from lamina.worker.cuda_graphs import graph_token_limit

                    mixed = mixed_graphs.mixed_graph_max_tokens(
                        graph_token_limit(args.cudagraph_capture_sizes, args.max_cudagraph_capture_size))
            hint = state_dtype_hint(self.ssm_state_dtype, self.kv_cache_dtype if self.fp8_kv_cache_possible else None)
            plan = plan_gpu_memory(
                usable_bytes=usable_gpu_bytes(free, total, args.gpu_memory_utilization),
                bytes_per_block=bytes_per_block, block_size=args.block_size, max_model_len=self.max_model_len,
                max_num_seqs=max_num_seqs, max_num_seqs_is_default=args.max_num_seqs is None,
                state_bytes_per_slot=per_slot,
                speculation_bytes=lambda n: self._speculation_reserve(n, per_slot),
                activation_bytes=lambda n: activation_headroom_bytes(
                    self.model_config, self.dtype.itemsize, max_num_batched_tokens, n, k, mixed),
                state_hint=hint, fit_max_model_len=auto_len,
            )
            self.memory_plan = plan
            self._fit_max_model_len(plan.max_model_len)
            if plan.lowered_from is not None:
                logger.warning("max_num_seqs lowered from its default %d to %d: the recurrent states of %d requests, the "
                               "activation headroom and one max_model_len sequence of KV cache do not fit "
                               "(lamina.engine.memory_plan; %s); set max_num_seqs to choose%s",
                               plan.lowered_from, plan.max_num_seqs, plan.lowered_from,
                               plan.describe(args.block_size, self.max_model_len),
                               f", or {hint} to fit more" if hint else "")
            else:
                logger.info("GPU memory: %s", plan.describe(args.block_size, self.max_model_len))
            num_blocks, max_num_seqs = plan.num_kv_blocks, plan.max_num_seqs
        else:
            budget = args.kv_cache_memory_bytes if args.kv_cache_memory_bytes is not None else CPU_KV_CACHE_BYTES
            budget -= self._speculation_reserve(max_num_seqs)
            budget_blocks = max(0, budget) // max(1, bytes_per_block)
            if auto_len:
                if not budget_blocks:
                    raise ValueError(f"max_model_len auto: the KV budget ({max(0, budget)} bytes after speculation's "
                                     f"reserve) holds no block of {bytes_per_block} bytes; give the cache more memory "
                                     "(kv_cache_memory_bytes)")
                self._fit_max_model_len(budget_blocks * args.block_size)
            num_blocks = min(-(-self.max_model_len // args.block_size) * max_num_seqs, budget_blocks)
        blocks_per_seq = -(-self.max_model_len // args.block_size)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {args.block_size} tokens, fewer than one sequence of "
                f"max_model_len = {self.max_model_len} needs ({blocks_per_seq}); lower max_model_len or give the "
                f"cache more memory"
            )
        return num_blocks, max_num_seqs

    def _fit_max_model_len(self, kv_tokens: int) -> None:
        """max_model_len "auto": keep the model's length if the KV cache holds `kv_tokens` >= it, else
        shorten it to them (logged)."""
        if kv_tokens < self.max_model_len:
            logger.warning("max_model_len auto: %d tokens, what the KV cache holds (the model's own is %d)",
                           kv_tokens, self.max_model_len)
            self.max_model_len = kv_tokens

    def _speculation_reserve(self, max_num_seqs: int, state_bytes_per_slot: int | None = None) -> int:
        """Memory speculative decoding holds besides the caches: per request, the recurrent states
        after each of K draft positions (for rollback) and K float32 draft distributions.
        `state_bytes_per_slot`: the executor's figure, when the caller has it (one ask per rank)."""
        spec = getattr(self, "spec_config", None)
        if spec is None:
            return 0
        k = spec.num_speculative_tokens
        per_slot = self.executor.state_bytes_per_slot() if state_bytes_per_slot is None else state_bytes_per_slot
        graph_rows = 0
        if not self.args.enforce_eager and self.device.type == "cuda":
            from lamina.worker.cuda_graphs import model_is_capturable, multirank_graphs_reason
            from lamina.worker.verify_graphs import verify_state_rows

            if self.parallel_config.is_single_rank:
                graphs = model_is_capturable(self.executor.runner.model, verify=True)
            else:  # every rank of one stage captures when the layout allows it (a rank that cannot: none does)
                graphs = multirank_graphs_reason(self.plan, speculative=True) is None
            if graphs:
                graph_rows = verify_state_rows(max_num_seqs, k, self.args.cudagraph_capture_sizes,
                                               self.args.max_cudagraph_capture_size)
        return speculation_bytes(max_num_seqs, k, per_slot, self.model_config.vocab_size, graph_rows)

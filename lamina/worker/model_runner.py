"""A rank's model runner: owns the model, its KV / recurrent-state tensors and the sampler.

It receives a `StepPlan`, derives every input tensor from it (token ids, positions, query
boundaries, slot mappings, block tables, state slots), runs the model and, on the last stage,
samples the next token of each request whose chunk reached its end. The scheduler never sees
tensors; this is where plan integers become tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.engine.sampler import Sampler, SamplingBatch, create_generator
from lamina.engine.step_plan import StepPlan
from lamina.layers.metadata import ForwardMetadata


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None = None


class ModelRunner:
    def __init__(
        self,
        model,
        *,
        device: torch.device,
        num_kv_blocks: int,
        block_size: int,
        num_state_slots: int,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
    ):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self.kv_cache_bytes = 0
        self.state_bytes = 0
        for module in model.paged_cache_modules():
            self.kv_cache_bytes += module.bind_paged_cache(num_kv_blocks, block_size, model.dtype, device)
        for module in model.state_modules():
            self.state_bytes += module.bind_state(num_state_slots, model.dtype, device)

    # ---- inputs --------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, ForwardMetadata, list[int]]:
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        bs = self.block_size
        for chunk in plan.chunks:
            token_ids.extend(chunk.token_ids)
            span = range(chunk.start_position, chunk.end_position)
            positions.extend(span)
            table = chunk.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in span)
            query_start_loc.append(query_start_loc[-1] + chunk.num_tokens)
            seq_lens.append(chunk.end_position)
            if chunk.sample:
                logits_rows.append(query_start_loc[-1] - 1)
        max_blocks = max(len(c.block_table) for c in plan.chunks)
        block_tables = [c.block_table + [0] * (max_blocks - len(c.block_table)) for c in plan.chunks]

        def as_tensor(values, dtype=torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        history_len = getattr(self.model, "token_history_len", 0)
        history = None
        if history_len > 0:
            history = as_tensor(
                [[-1] * (history_len - len(c.history_token_ids)) + c.history_token_ids[-history_len:] for c in plan.chunks]
            )
        request_index = [i for i, c in enumerate(plan.chunks) for _ in range(c.num_tokens)]
        meta = ForwardMetadata(
            num_tokens=len(token_ids),
            num_reqs=len(plan.chunks),
            max_query_len=max(c.num_tokens for c in plan.chunks),
            max_seq_len=max(seq_lens),
            positions=as_tensor(positions),
            query_start_loc=as_tensor(query_start_loc),
            seq_lens=as_tensor(seq_lens),
            slot_mapping=as_tensor(slot_mapping),
            block_tables=as_tensor(block_tables),
            state_slots=as_tensor([c.state_slot for c in plan.chunks]),
            has_initial_state=as_tensor([c.start_position > 0 for c in plan.chunks], torch.bool),
            history_token_ids=history,
            token_request_index=as_tensor(request_index),
        )
        return as_tensor(token_ids), meta, logits_rows

    # ---- step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> dict[str, SampledToken]:
        for request_id in plan.finished_request_ids:
            self._generators.pop(request_id, None)
        if plan.is_empty:
            return {}
        token_ids, meta, logits_rows = self.prepare(plan)
        hidden = self.model(token_ids, meta)
        sampling_chunks = [c for c in plan.chunks if c.sample]
        if not sampling_chunks:
            return {}
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [B_sample, vocab]
        return self.sample(logits, sampling_chunks)

    def compute_logits_for_plan(self, plan: StepPlan) -> torch.Tensor:
        """Every position's logits of a plan [T, vocab] (tests compare them with transformers)."""
        token_ids, meta, _ = self.prepare(plan)
        with torch.inference_mode():
            return self.model.compute_logits(self.model(token_ids, meta))

    def _generator(self, chunk) -> torch.Generator | None:
        seed = chunk.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(chunk.request_id)
        if gen is None:
            gen = self._generators[chunk.request_id] = create_generator(seed, self.device)
        return gen

    def sample(self, logits: torch.Tensor, chunks) -> dict[str, SampledToken]:
        batch = SamplingBatch.build(
            [c.sampling_params for c in chunks],
            [c.num_output_tokens for c in chunks],
            list(self.eos_token_ids),
            [self._generator(c) for c in chunks],
            self.device,
            self.vocab_size,
        )
        out = self.sampler(logits, batch)
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs_lists()
        return {c.request_id: SampledToken(t, lp) for c, t, lp in zip(chunks, token_ids, logprobs)}

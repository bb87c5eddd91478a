"""Comparison helpers against transformers (the reference implementation)."""

from __future__ import annotations

import importlib
import inspect

import torch

from lamina.sampling_params import SamplingParams
from lamina.step_plan import ScheduledChunk, StepPlan


_MODELING_MODULES = (
    "qwen3_next.modeling_qwen3_next", "qwen3_5_moe.modeling_qwen3_5_moe", "qwen4_exp.modeling_qwen4_exp",
)
_KERNEL_FUNCS = (
    "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update",
)


def torch_only_transformers() -> None:
    """Point transformers' Qwen hybrid modeling back at its own torch delta rule and conv.

    transformers binds fla-core's (and causal-conv1d's) kernels in place of these functions whenever
    the package imports, whatever device the tensors are on: on a GPU machine with fla installed
    the CPU float32 reference would hand CPU tensors to GPU Triton kernels. The wrappers keep the
    torch function as `__wrapped__`. Idempotent."""
    for name in _MODELING_MODULES:
        try:
            module = importlib.import_module(f"transformers.models.{name}")
        except ImportError:
            continue
        for func in _KERNEL_FUNCS:
            if hasattr(module, func):
                setattr(module, func, inspect.unwrap(getattr(module, func)))


def load_reference(path):
    import transformers

    torch_only_transformers()
    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, config.architectures[0])
    model = cls.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 logits of a full forward, no cache."""
    out = model(input_ids=torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float()


def lamina_logits(llm, token_ids: list[int], chunk_sizes: list[int] | None = None) -> torch.Tensor:
    """Per-position logits from lamina's model, running the sequence in the given chunks
    (recurrent state and KV carried between them) through hand-made step plans."""
    engine = llm.engine
    runner = engine.executor.runner
    block_size = engine.cache.block_size
    blocks = list(range(-(-len(token_ids) // block_size)))
    chunk_sizes = chunk_sizes or [len(token_ids)]
    assert sum(chunk_sizes) == len(token_ids)
    history_len = getattr(runner.model, "token_history_len", 0)  # as the scheduler does
    outs, start = [], 0
    for size in chunk_sizes:
        chunk = ScheduledChunk(
            request_id="ref", token_ids=token_ids[start : start + size], start_position=start,
            block_table=blocks, state_slot=0, sample=False, sampling_params=SamplingParams(),
            num_output_tokens=0, history_token_ids=token_ids[max(0, start - history_len) : start],
        )
        outs.append(runner.compute_logits_for_plan(StepPlan(step_id=0, chunks=[chunk])))
        start += size
    return torch.cat(outs)


def assert_greedy_agrees(ref_model, prompt: list[int], output: list[int], margin: float = 1e-3) -> int:
    """Near-tie rule (DESIGN.md): each generated token's reference logit, teacher-forced on lamina's
    own sequence, is within `margin` of the reference maximum. Returns the number of exact argmax hits."""
    seq = prompt + output
    logits = reference_logits(ref_model, seq)
    exact = 0
    for j, token in enumerate(output):
        row = logits[len(prompt) + j - 1]
        best = row.max().item()
        assert row[token].item() >= best - margin, (
            f"token {j} ({token}) has reference logit {row[token].item():.6f}, max {best:.6f} at {row.argmax().item()}"
        )
        exact += int(row.argmax().item() == token)
    return exact

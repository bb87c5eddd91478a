"""The gated delta rule of prefill and mixed steps on fla-core's chunked kernel.

fla-core (`pip install fla-core`, import name `fla`) ships `chunk_gated_delta_rule`, a Triton
implementation of the chunked gated delta rule over a flat varlen batch (`cu_seqlens`). This module
wraps its public API for lamina's layout; nothing of fla is copied. Its contract, checked against
fla-core 0.6.0's source (`fla/ops/gated_delta_rule/chunk.py`):

- q, k `[1, T, Hk, Dk]`, v `[1, T, Hv, Dv]`, g (log decay) and beta `[1, T, Hv]`: varlen batches
  have batch size 1 and pass `cu_seqlens` `[N+1]` (long). Grouped value heads are native: value
  head h reads key head `h // (Hv // Hk)`, as lamina's reference (`repeat_interleave`) does.
- `use_qk_l2norm_in_kernel=True` is lamina's `use_qk_l2norm` (x * rsqrt(sum x^2 + 1e-6)); `scale`
  defaults to Dk**-0.5, lamina's scale.
- `initial_state` / final state `[N, Hv, Dk, Dv]` (the default `state_v_first=False`), the state S
  with o = S^T q: lamina's state pool `[num_slots, Hv, Dk, Dv]` in the same orientation, so no
  transpose. fla reads the initial state as float32 and returns the final state in float32; the
  pool may hold another dtype (`mamba_ssm_cache_dtype`), so states are cast on the way in and out.

fla cannot index lamina's state pool by slot, so the requests' states are gathered into one
`[B, Hv, Dk, Dv]` tensor (zeros where the request starts fresh) and the final states scattered
back: two copies of 2 MiB per request and layer at the Qwen3.5 width, small beside a prefill chunk.

fla is imported lazily and only on CUDA (it queries the GPU when imported). Its kernels are
autotuned on first use (about a minute over the 40 layers' shapes on an H200); lamina turns on
Triton's on-disk cache of autotuning results (`TRITON_CACHE_AUTOTUNING=1`, unless the user set
it) before the import, so only the first process on a machine pays for it.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["fla_import_error", "gated_delta_rule_prefill_fla", "FLA_CHUNK_SIZE"]

FLA_CHUNK_SIZE = 64  # chunk_gated_delta_rule's default chunk (its `chunk_size`), what `chunk_indices` count in


@functools.cache
def fla_import_error() -> str | None:
    """None when fla-core's chunked gated delta rule imports here, else why it does not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    # Read by triton.autotune when fla's decorators run, i.e. at the import below.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as error:  # an import that fails for any reason means "not available"
        return f"{type(error).__name__}: {error}"
    return None


def gated_delta_rule_prefill_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    query_start_loc: torch.Tensor,
    use_qk_l2norm: bool = True,
    chunk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over a flat varlen batch on fla-core, states in the pool.

    Args:
        q, k: `[T, Hk, Dk]`; v: `[T, Hv, Dv]`; g (log decay, <= 0), beta: `[T, Hv]`;
        state_pool: `[num_slots, Hv, Dk, Dv]` (float32, or `mamba_ssm_cache_dtype`'s dtype): request b
            starts from `state_pool[slots[b]]` (zeros where `keep[b]` is False) and its final state is
            written back there (rounded to the pool's dtype);
        slots: `[B]` long; keep: `[B]` bool; query_start_loc: `[B+1]` cumulative query lengths;
        chunk_indices: `[NT, 2]` long on the device, (request, chunk) of every FLA_CHUNK_SIZE chunk
            (`ForwardMetadata.chunk_indices`, built from the host lengths). Without it fla derives
            them from `query_start_loc` with `repeat_interleave`, which waits for the device to read
            their count (once per step: fla caches them by tensor identity across the layers).

    Returns:
        out `[T, Hv, Dv]` in v's dtype. Same results as `gated_delta_rule_varlen` (up to rounding).
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    num_tokens = q.shape[0]
    state_in = torch.where(keep[:, None, None, None], state_pool[slots].float(), 0.0)  # [B, Hv, Dk, Dv] float32
    if num_tokens == 0:  # nothing to run; requests without tokens keep (or zero) their state
        state_pool.index_copy_(0, slots, state_in.to(state_pool.dtype))
        return v.new_empty(v.shape)
    out, final_state = chunk_gated_delta_rule(
        q.unsqueeze(0),  # [1, T, Hk, Dk]
        k.unsqueeze(0),  # [1, T, Hk, Dk]
        v.unsqueeze(0),  # [1, T, Hv, Dv]
        g.float().unsqueeze(0),  # [1, T, Hv]
        beta.float().unsqueeze(0),  # [1, T, Hv]
        initial_state=state_in,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=query_start_loc.long(),
        chunk_indices=chunk_indices,
        chunk_size=FLA_CHUNK_SIZE,
    )  # out [1, T, Hv, Dv], final_state [B, Hv, Dk, Dv] float32
    state_pool.index_copy_(0, slots, final_state.to(state_pool.dtype))
    return out[0].to(v.dtype)  # [T, Hv, Dv]

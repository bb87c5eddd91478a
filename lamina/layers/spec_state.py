"""Per-position recurrent states for speculative decoding, and committing the accepted one.

A verification step runs a request's last token and its K draft tokens through the target in one
chunk. Recurrent layers (gated delta net conv and recurrent state, Qwen4-Exp's PLE short conv)
write the state after the chunk's last token into the request's slot, as usual, which is right
when every draft is accepted. They also keep the states after the chunk's first K tokens: the
step's `StateCapture` (lamina.layers.metadata; `ForwardMetadata.state_capture`, built and owned
by the runner's spec step) names those tokens, and each layer hands it what the kernels captured for each of its state
pools (`StateCapture.keep`). Once acceptance is known (the next plan), the runner commits the
state after the accepted position into the slot (`StateCapture.commit`). With a float32 pool the
result is exactly the state plain decoding would have reached: the states are computed from the same
tokens, only the chosen one is kept. With a 16-bit pool (`mamba_ssm_cache_dtype`) it is within that
pool's rounding of it: plain decoding rounds the state after every token, a verification step only
where it stores one (the captured and final states), as vLLM's kernels do.

Nothing here reads the host or depends on tensor values: the capture list is built from the plan,
`keep` only records tensors, and `commit` is one `index_copy_` per kept pool (on the Triton
kernel set one launch per group of like pools, lamina.kernels.triton_state_rows).
"""

from __future__ import annotations

import torch

from lamina.kernels.causal_conv1d import causal_conv1d_varlen
from lamina.layers.metadata import ForwardMetadata


def capture_tokens(meta: ForwardMetadata) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """The kernels' `capture` argument of this step (None: nothing to capture)."""
    return None if meta.state_capture is None else meta.state_capture.tokens


def conv_with_capture(
    pool: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    state_in: torch.Tensor,
    meta: ForwardMetadata,
    *,
    activation: str | None = "silu",
    dilation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_varlen` over the step's requests; under speculative verification keeps the
    states after the tokens `meta.state_capture` names for the conv state pool `pool`. Returns
    (out [T, C], state after each request's last token)."""
    capture = meta.state_capture
    result = causal_conv1d_varlen(
        x, weight, state_in, meta.query_start_loc, meta.max_query_len,
        activation=activation, dilation=dilation, capture=capture_tokens(meta), groups=meta.request_groups(),
    )
    if capture is not None:
        capture.keep(pool, result[2])
    return result[0], result[1]


class CaptureBuffers:
    """Persistent capture rows for every state pool of a model: where verification steps replayed
    as CUDA graphs keep their per-position states (a graph's outputs must live at fixed addresses).
    `rows` capture rows per pool, `[rows, ...]` in the pool's dtype; a step of B requests verifying
    K drafts each uses rows 0..B*K-1 (row b*K + i: the state after token i of request b)."""

    def __init__(self, pools: list[torch.Tensor], rows: int):
        self.pools = list(pools)
        self.capacity = rows
        self.buffers = [torch.empty((rows, *p.shape[1:]), dtype=p.dtype, device=p.device) for p in self.pools]

    @staticmethod
    def bytes_for(pools: list[torch.Tensor], rows: int) -> int:
        return sum(rows * (p.numel() // max(1, p.shape[0])) * p.element_size() for p in pools)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def rows(self, pool: torch.Tensor, count: int) -> torch.Tensor:
        """The first `count` rows for `pool` (one of the pools this was built for)."""
        if count > self.capacity:
            raise ValueError(f"{count} capture rows needed, {self.capacity} allocated")
        for p, buffer in zip(self.pools, self.buffers):
            if p is pool:
                return buffer[:count]
        raise KeyError("no capture buffer for this state pool")

    def kept(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`StateCapture.kept` of a step replayed from a graph: every pool with its rows."""
        return list(zip(self.pools, self.buffers))

"""Per-position recurrent states for speculative decoding, and committing the accepted one.

A verification step runs a request's last token and its K draft tokens through the target in one
chunk. Recurrent layers (gated delta net conv and recurrent state, Qwen4-Exp's PLE short conv)
write the state after the chunk's last token into the request's slot, as usual, which is right
when every draft is accepted. They also keep the states after the chunk's first K tokens: the
step's `StateCapture` (`ForwardMetadata.state_capture`, built and owned by the runner's spec step)
names those tokens, and each layer hands it what the kernels captured for each of its state
pools (`StateCapture.keep`). Once acceptance is known (the next plan), the runner commits the
state after the accepted position into the slot (`StateCapture.commit`). The result is exactly
the state plain decoding would have reached: the states are computed from the same tokens, only
the chosen one is kept.

Nothing here reads the host or depends on tensor values: the capture list is built from the plan,
`keep` only records tensors, and `commit` is one `index_copy_` per kept pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lamina.host_to_device import to_device
from lamina.kernels.causal_conv1d import causal_conv1d_varlen
from lamina.layers.metadata import ForwardMetadata


@dataclass
class StateCapture:
    """One verification step's captured tokens and the states the layers kept after them."""

    req: torch.Tensor  # [R] long: the request (row of the step's batch) of each captured token
    offset: torch.Tensor  # [R] long: the token's offset inside its request's chunk
    max_offset: int  # host bound on `offset`: keeps the kernels' buffers small
    # `req` and `offset` on the host: request groups split the capture list by group.
    req_host: tuple[int, ...]
    offset_host: tuple[int, ...]
    # (state pool [num_slots, ...], its states after the captured tokens [R, ...]) per layer state
    kept: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def from_host(cls, req: list[int], offset: list[int], device: torch.device) -> StateCapture:
        return cls(to_device(req, device), to_device(offset, device), max(offset), tuple(req), tuple(offset))

    @property
    def tokens(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The kernels' `capture` argument: (req [R], offset [R], max offset)."""
        return self.req, self.offset, self.max_offset

    @property
    def host(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.req_host, self.offset_host

    def keep(self, pool: torch.Tensor, captured: torch.Tensor) -> None:
        """Remember the states after the captured tokens `[R, ...]` for the state pool `pool`."""
        self.kept.append((pool, captured))

    def commit(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """`pool[slots[i]] = captured[rows[i]]` for every state kept in this step."""
        for pool, captured in self.kept:
            pool.index_copy_(0, slots, captured.index_select(0, rows).to(pool.dtype))


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

"""Per-position recurrent states for speculative decoding, and committing the accepted one.

A verification step runs a request's last token and its K draft tokens through the target in one
chunk. Recurrent layers (gated delta net conv and recurrent state, Qwen4-Exp's PLE short conv)
write the state after the chunk's last token into the request's slot, as usual, which is right
when every draft is accepted. They also keep the states after the chunk's first K tokens: the
step's `StateCapture` (lamina.layers.metadata; `ForwardMetadata.state_capture`, built and owned
by the runner's spec step) names those tokens, and each layer hands it what the kernels captured for each of its state
pools (`StateCapture.keep`). Once acceptance is known (the next plan), the runner commits the
state after the accepted position into the slot (`StateCapture.commit`). The result is exactly
the state plain decoding would have reached: the states are computed from the same tokens, only
the chosen one is kept.

Nothing here reads the host or depends on tensor values: the capture list is built from the plan,
`keep` only records tensors, and `commit` is one `index_copy_` per kept pool.
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

"""Per-position recurrent states for speculative decoding, and committing the accepted one.

A verification step runs a request's last token and its K draft tokens through the target in one
chunk. Recurrent layers (gated delta net conv and recurrent state, Qwen4-Exp's PLE short conv)
write the state after the chunk's last token into the request's slot, as usual, which is right
when every draft is accepted. They also keep the states after the chunk's first K tokens
(`ForwardMetadata.state_capture`), stashed on the module until the next step. Once acceptance is
known, the runner commits the state after the accepted position into the slot
(`commit_captured`). The result is exactly the state plain decoding would have reached: the
states are computed from the same tokens, only the chosen one is kept.

The stash maps a state tensor's attribute name (e.g. "ssm_state") to the captured rows
`[R, ...]`; it is replaced by every forward, so it always belongs to the module's last step.
"""

from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.causal_conv1d import causal_conv1d_varlen
from lamina.layers.metadata import ForwardMetadata

_STASH = "_spec_captured"


def stash_captured(module: nn.Module, state_name: str, captured: torch.Tensor | None) -> None:
    """Remember the states after the captured tokens for `module.<state_name>` (None: nothing)."""
    module.__dict__.setdefault(_STASH, {})[state_name] = captured


def commit_captured(module: nn.Module, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """`module.<state>[slots[i]] = captured[rows[i]]` for every stashed state of the module's last step."""
    for name, captured in module.__dict__.get(_STASH, {}).items():
        if captured is None:
            continue
        state = getattr(module, name)
        state.index_copy_(0, slots, captured.index_select(0, rows).to(state.dtype))


def has_captured_states(module: nn.Module) -> bool:
    return _STASH in module.__dict__


def conv_with_capture(
    module: nn.Module,
    state_name: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    state_in: torch.Tensor,
    meta: ForwardMetadata,
    *,
    activation: str | None = "silu",
    dilation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_varlen` over the step's requests; stashes the states after the tokens
    `meta.state_capture` names. Returns (out [T, C], state after each request's last token)."""
    capture = meta.state_capture
    result = causal_conv1d_varlen(
        x, weight, state_in, meta.query_start_loc, meta.max_query_len,
        activation=activation, dilation=dilation, capture=capture, groups=meta.request_groups(),
    )
    stash_captured(module, state_name, result[2] if capture is not None else None)
    return result[0], result[1]

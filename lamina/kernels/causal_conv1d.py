"""Depthwise causal 1-D convolution over a flat varlen batch, with a rolling input state.

Each request keeps the last K-1 inputs it has seen (`conv_state [B, C, K-1]`, oldest
first; zeros for a fresh request). For this step's tokens x_1..x_n of one request, the
convolution runs over the sequence [state, x_1..x_n]:

    y_t[c] = sum_{j=0}^{K-1} weight[c, j] * seq[c, t + j]       (seq is K-1+n long)

so y_t sees the K-1 inputs before x_t and x_t itself. The new state is the last K-1
entries of that sequence, which also works when n < K-1 (part of the old state survives).

With `dilation` d the taps are d apart (y_t reads seq[t + j*d]) and the state holds the
last (K-1)*d inputs.

Speculative decoding needs the state after a chosen token, not only after the last one:
`capture=(req [R], offset [R])` also returns the state after token `offset` of request `req`
(the last S entries of seq up to and including that token), for each of the R entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.request_groups import check_group_capture
from lamina.kernels.varlen import flat_positions, from_padded, padded_index, query_lens, to_padded

__all__ = ["causal_conv1d_varlen"]


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    activation: str | None = "silu",
    dilation: int = 1,
    capture: tuple[torch.Tensor, torch.Tensor] | None = None,
    groups: list | None = None,
):
    """Args:
        x: `[T, C]` flat inputs; weight: `[C, K]` (no bias);
        conv_state: `[B, C, (K-1)*dilation]` previous inputs per request (not modified);
        query_start_loc: `[B+1]`; max_query_len: host int;
        activation: "silu" or None; dilation: distance between taps;
        capture: optional (req `[R]`, offset `[R]`) long: tokens after which to report the state.
        groups: optional request groups (lamina.kernels.request_groups): one call per group, so
            short requests are not padded to a long one's length. Same results.

    Returns:
        out `[T, C]` in x's dtype, new_conv_state `[B, C, (K-1)*dilation]` in conv_state's dtype;
        with `capture`, also the captured states `[R, C, (K-1)*dilation]` in conv_state's dtype.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    total_tokens, channels = x.shape
    kernel = weight.shape[1]
    state_len = (kernel - 1) * dilation
    if conv_state.shape[-1] != state_len:
        raise ValueError(f"conv_state holds {conv_state.shape[-1]} inputs, expected (K-1)*dilation = {state_len}")
    if groups is not None:
        return _grouped(x, weight, conv_state, activation, dilation, capture, groups)
    bsz = query_start_loc.shape[0] - 1
    max_len = max(1, max_query_len)

    index, valid = padded_index(query_start_loc, max_len)  # [B, L]
    xp = to_padded(x.float(), index, valid)  # [B, L, C]
    # Request b's tokens sit at seq[:, :, S : S+len_b] (S = state_len); zeros follow (never read by valid outputs).
    seq = torch.cat([conv_state.float(), xp.transpose(1, 2)], dim=2)  # [B, C, S+L]
    y = F.conv1d(seq, weight.float().unsqueeze(1), groups=channels, dilation=dilation)  # [B, C, L]
    if activation is not None:
        y = F.silu(y)

    flat = flat_positions(query_start_loc, max_len, total_tokens)  # [T]
    out = from_padded(y.transpose(1, 2), valid, flat)  # [T, C]

    # Last S inputs of [old state, this request's tokens]: seq[:, :, len_b : len_b + S].
    lens = query_lens(query_start_loc)  # [B]
    take = lens[:, None] + torch.arange(state_len, device=seq.device)  # [B, S]
    take = take[:, None, :].expand(bsz, channels, state_len)  # [B, C, S]
    new_state = seq.gather(2, take)  # [B, C, S]
    if capture is None:
        return out.to(x.dtype), new_state.to(conv_state.dtype)
    req, offset = capture[0].long(), capture[1].long()
    # State after token i of request b: seq[b, :, i+1 : i+1+S], gathered without copying whole rows.
    take = offset[:, None] + 1 + torch.arange(state_len, device=seq.device)  # [R, S]
    chans = torch.arange(channels, device=seq.device)  # [C]
    captured = seq[req[:, None, None], chans[None, :, None], take[:, None, :]]  # [R, C, S]
    return out.to(x.dtype), new_state.to(conv_state.dtype), captured.to(conv_state.dtype)


def _grouped(x, weight, conv_state, activation, dilation, capture, groups):
    """`causal_conv1d_varlen` once per request group; outputs scattered back in batch order."""
    out = torch.empty_like(x)  # [T, C]
    new_state = torch.empty_like(conv_state)  # [B, C, S]
    captured = None
    if capture is not None:
        check_group_capture(capture, groups)
        captured = conv_state.new_empty((capture[0].shape[0], *conv_state.shape[1:]))  # [R, C, S]
    for group in groups:
        result = causal_conv1d_varlen(
            x.index_select(0, group.tokens), weight, conv_state.index_select(0, group.requests),
            group.query_start_loc, group.max_query_len, activation=activation, dilation=dilation,
            capture=group.capture if capture is not None else None,
        )
        out.index_copy_(0, group.tokens, result[0])
        new_state.index_copy_(0, group.requests, result[1])
        if captured is not None and group.capture is not None:
            captured.index_copy_(0, group.capture_rows, result[2])
    return (out, new_state) if capture is None else (out, new_state, captured)

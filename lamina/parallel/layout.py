"""Declared activation layouts over the TP group and the explicit transitions between them.

R (Replicate): every rank holds all T rows. S (Shard(0)): each rank holds a padded contiguous
slice of ceil(T/tp) rows (rank r: rows [r*S, (r+1)*S), zero rows past T). P (Partial): every rank
holds all rows, un-reduced. Transitions are named for their collective and take the true token
count T from step metadata, never from a tensor's shape.

In debug mode activations carry their layout as an attribute and `expect` raises when a module
receives the wrong one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.parallel.context import ParallelContext

R, S, P = "R", "S(0)", "P"
_ATTR = "_lamina_layout"


class LayoutError(RuntimeError):
    """A module received an activation in a layout other than the one it declares."""


def shard_rows(num_tokens: int, tp_size: int) -> int:
    """Rows per rank under S: ceil(T / tp)."""
    return -(-num_tokens // tp_size)


def tag(x: torch.Tensor, layout: str, ctx: ParallelContext) -> torch.Tensor:
    if ctx.debug_layouts:
        setattr(x, _ATTR, layout)
    return x


def expect(x: torch.Tensor, layout: str, ctx: ParallelContext, where: str) -> torch.Tensor:
    if ctx.debug_layouts:
        actual = getattr(x, _ATTR, None)
        if actual != layout:
            raise LayoutError(f"{where} expects layout {layout} but received {actual or 'an untagged tensor'}")
    return x


def replicate_to_shard(x: torch.Tensor, num_tokens: int, ctx: ParallelContext) -> torch.Tensor:
    """R [T, ...] -> S [ceil(T/tp), ...]: keep this rank's rows (no communication)."""
    expect(x, R, ctx, "replicate_to_shard")
    rows = shard_rows(num_tokens, ctx.tp_size)
    padded = F.pad(x, (0, 0, 0, rows * ctx.tp_size - num_tokens))  # [tp*S, H]
    return tag(padded[ctx.tp_rank * rows : (ctx.tp_rank + 1) * rows].contiguous(), S, ctx)


def all_gather_tokens(x: torch.Tensor, num_tokens: int, ctx: ParallelContext) -> torch.Tensor:
    """S [ceil(T/tp), ...] -> R [T, ...] (all-gather over TP, cut to T)."""
    expect(x, S, ctx, "all_gather_tokens")
    full = ctx.tp.all_gather(x, dim=0)  # [tp*S, H]
    return tag(full[:num_tokens], R, ctx)


def reduce_scatter_tokens(x: torch.Tensor, num_tokens: int, ctx: ParallelContext) -> torch.Tensor:
    """P [T, ...] -> S [ceil(T/tp), ...] (pad to a multiple of tp, reduce-scatter over TP)."""
    expect(x, P, ctx, "reduce_scatter_tokens")
    rows = shard_rows(num_tokens, ctx.tp_size)
    padded = F.pad(x, (0, 0, 0, rows * ctx.tp_size - num_tokens))  # [tp*S, H]
    return tag(ctx.tp.reduce_scatter(padded, dim=0), S, ctx)


def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """P -> R (all-reduce over TP)."""
    expect(x, P, ctx, "all_reduce")
    return tag(ctx.tp.all_reduce(x), R, ctx)

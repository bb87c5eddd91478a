"""The parallel context a layer receives: its rank's coordinates and the collectives of its groups.

Layers never read global rank state; they are handed a `ParallelContext` at construction and call
the collectives on it. Only `lamina.parallel` talks to `torch.distributed`. A single-rank context
(the default) makes every collective the identity, so the same layer code runs on one CPU or GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class GroupCollectives:
    """Collectives over one process group. The single-rank base class is the identity."""

    def __init__(self, size: int = 1, rank: int = 0):
        self.size = size
        self.rank = rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a partial tensor over the group (Partial -> Replicate)."""
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate each rank's equally-sized shard along `dim` (Shard(dim) -> Replicate)."""
        return x

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum partial tensors and keep this rank's equal slice along `dim` (Partial -> Shard(dim))."""
        return x


def divide_exact(total: int, parts: int, what: str) -> int:
    """`total / parts`, raising a clear error when it does not divide."""
    if total % parts != 0:
        raise ValueError(f"{what} = {total} is not divisible by {parts}")
    return total // parts


@dataclass
class ParallelContext:
    """What one rank needs to know to run its part of the model.

    tp: the tensor-parallel group (ranks of one replica and stage).
    dp: ranks with the same (stage, tp index) across data-parallel replicas.
    ep: the expert-parallel group of this stage (all DP x TP ranks) when EP is on.
    expert_range: [start, end) of the experts this rank holds; None means all.
    sp: sequence-parallel MoE contract on (activations between layers are token-sharded over TP).
    debug_layouts: activations carry their layout and modules check it (tests turn it on).
    """

    tp: GroupCollectives = field(default_factory=GroupCollectives)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dp: GroupCollectives = field(default_factory=GroupCollectives)
    ep: GroupCollectives = field(default_factory=GroupCollectives)
    ep_enabled: bool = False
    expert_range: tuple[int, int] | None = None
    sp: bool = False
    debug_layouts: bool = False

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @staticmethod
    def single(device: torch.device | str = "cpu") -> "ParallelContext":
        return ParallelContext(tp=GroupCollectives(), device=torch.device(device))

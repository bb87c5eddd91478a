"""Tensor-parallel linear layers and how checkpoint tensors are loaded into them.

A column-parallel layer splits its output features over the TP group; its output on each rank is
the local slice (layout Replicate over tokens, Shard(-1) over features). A row-parallel layer
splits its input features; each rank's output is a partial sum (layout Partial) that the caller
turns into the layout it needs with an explicit collective (`ctx.tp.all_reduce`, or a
reduce-scatter under sequence parallelism). Layers never reduce implicitly.

Several checkpoint tensors can feed one fused column-parallel weight (q/k/v, gate/up): each is a
"sub-output" of `total_output_sizes[i]` rows, sharded separately so that every rank holds its
slice of every sub-output, concatenated in order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lamina.parallel.context import ParallelContext, divide_exact


def decode_linear(device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`F.linear` without bias, or on the Triton kernel set (with its decode GEMV enabled) the
    variant that runs a few-row input as lamina's Triton GEMV (`lamina.kernels.triton_gemv`):
    chosen once when the layer is built."""
    from lamina.kernels.selection import decode_gemv_enabled, kernel_set

    if decode_gemv_enabled(kernel_set(device)):
        from lamina.kernels.triton_gemv import linear

        return linear
    return F.linear


def check_shape(name: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(expected)}"
        )


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over TP, per sub-output.

    `total_output_sizes` lists the global row count of each fused sub-output; `replicas` (same
    length, default 1) lets a sub-output be replicated instead of split when the TP size exceeds
    its head count (e.g. KV heads): then `tp_size // replicas[i]` ranks share one slice.
    """

    def __init__(
        self,
        input_size: int,
        total_output_sizes: list[int],
        ctx: ParallelContext,
        *,
        bias: bool = False,
        shard_units: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.input_size = input_size
        self.total_output_sizes = list(total_output_sizes)
        self.tp_size, self.tp_rank = ctx.tp_size, ctx.tp_rank
        # shard_units[i]: rows per indivisible unit (e.g. head_dim); a sub-output with fewer units
        # than tp ranks is replicated across groups of ranks.
        units = shard_units or [1] * len(total_output_sizes)
        self.output_sizes_per_rank: list[int] = []
        self.shard_starts: list[int] = []
        for total, unit in zip(total_output_sizes, units):
            total_units = divide_exact(total, unit, "output rows / shard unit")
            if total_units >= self.tp_size:
                units_per_rank = divide_exact(total_units, self.tp_size, f"units of a {total}-row output")
                shard_index = self.tp_rank
            else:
                ranks_per_unit = divide_exact(self.tp_size, total_units, "tensor_parallel_size / heads")
                units_per_rank = 1
                shard_index = self.tp_rank // ranks_per_unit
            self.output_sizes_per_rank.append(units_per_rank * unit)
            self.shard_starts.append(shard_index * units_per_rank * unit)
        self.output_size_per_rank = sum(self.output_sizes_per_rank)
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_rank, input_size, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(self.output_size_per_rank, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def load_shard(self, name: str, loaded: torch.Tensor, shard_id: int = 0, *, is_bias: bool = False) -> None:
        """Copy this rank's slice of checkpoint tensor `name` (sub-output `shard_id`)."""
        total = self.total_output_sizes[shard_id]
        expected = (total,) if is_bias else (total, self.input_size)
        check_shape(name, loaded, expected)
        offset = sum(self.output_sizes_per_rank[:shard_id])
        rows = self.output_sizes_per_rank[shard_id]
        local = loaded.narrow(0, self.shard_starts[shard_id], rows)
        target = self.bias if is_bias else self.weight
        target.data.narrow(0, offset, rows).copy_(local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over TP; the output is Partial (not reduced)."""

    def __init__(
        self,
        total_input_size: int,
        output_size: int,
        ctx: ParallelContext,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.total_input_size = total_input_size
        self.output_size = output_size
        self.tp_rank = ctx.tp_rank
        self.input_size_per_rank = divide_exact(total_input_size, ctx.tp_size, "row-parallel input features")
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_rank, dtype=dtype, device=device), requires_grad=False
        )
        self._linear = decode_linear(device if device is not None else ctx.device)

    def load_shard(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(name, loaded, (self.output_size, self.total_input_size))
        start = self.tp_rank * self.input_size_per_rank
        self.weight.data.copy_(loaded.narrow(1, start, self.input_size_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight)


class ReplicatedLinear(nn.Module):
    """A linear layer every rank holds whole (routers, small gates)."""

    def __init__(self, input_size: int, output_size: int, *, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype, device=device), requires_grad=False)

    def load_shard(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(name, loaded, tuple(self.weight.shape))
        self.weight.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def share_weight_storage(*linears: nn.Module, row_multiple: int = 1) -> torch.Tensor:
    """Put the weights of several linears over the same input (no biases) into one `[sum rows, in]`
    tensor, each `.weight` becoming a view of its rows, and return it: one GEMV then computes all
    of their outputs (the fast decode path), while loading and the reference path see the usual
    parameters. With `row_multiple` > 1 the tensor gets zero rows at the end up to a multiple of
    it, so the GEMM's output rows stay aligned (cuBLAS falls back to slow unaligned kernels for,
    e.g., a router's 256 + 1 rows); their outputs are zeros that nothing reads."""
    if any(getattr(m, "bias", None) is not None for m in linears):
        raise ValueError("share_weight_storage: linears with a bias cannot share one GEMV")
    if row_multiple < 1:
        raise ValueError(f"share_weight_storage: row_multiple = {row_multiple} must be >= 1")
    first = linears[0].weight
    rows = [m.weight.shape[0] for m in linears]
    total_rows = -(-sum(rows) // row_multiple) * row_multiple
    joint = torch.zeros(total_rows, first.shape[1], dtype=first.dtype, device=first.device)  # [rows padded, in]
    start = 0
    for m, n in zip(linears, rows):
        m.weight = nn.Parameter(joint[start : start + n], requires_grad=False)
        start += n
    return joint

"""Hyper-connections (Qwen4-Exp): the residual stream is `hc_count` parallel streams, `[T, hc*H]`.

Around every sub-block (attention or MLP) a gated residual
  1. normalises the streams (`hc_norm`: RMSNorm per stream of H features, zero-centred weight
     of hc*H),
  2. mixes them into the sub-block's input: a low-rank gate
     `w = sigmoid(up(silu(down(normed) / hc)))` (`[T, hc, H]`) weights the normed streams,
     averaged over the streams -> `[T, H]`,
  3. after the sub-block, injects its output `y [T, H]` into every stream with its own weight
     `inject = 2 * sigmoid(block_inject(normed) / hc)` (`[T, hc]`): `x + inject[:, :, None] * y`.
The final mixer is steps 1-2 only. All weights are small and replicated over TP; the sub-block
output is all-reduced by the caller before the injection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lamina.layers.linear import ReplicatedLinear, check_shape


class GroupedRMSNorm(nn.Module):
    """RMSNorm over consecutive groups of `group_size` features, computed in float32; weight of the
    whole width stored zero-centred (scale 1 + w)."""

    def __init__(self, dim: int, group_size: int, eps: float, *, dtype=torch.float32, device=None):
        super().__init__()
        if dim % group_size != 0:
            raise ValueError(f"grouped norm width {dim} is not a multiple of its group size {group_size}")
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def load_shard(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(name, loaded, tuple(self.weight.shape))
        self.weight.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., G*group] -> same shape, each group normalised on its own."""
        x32 = x.float().unflatten(-1, (-1, self.group_size))  # [..., G, group]
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = normed.flatten(-2)  # [..., G*group]
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class HyperConnection(nn.Module):
    """One gated residual (`inject=True`) or the final stream mixer (`inject=False`)."""

    def __init__(
        self, hidden_size: int, hc_count: int, lowrank: int, eps: float, *, inject: bool = True, dtype, device=None
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.hc_count = hc_count
        width = hc_count * hidden_size
        self.hc_norm = GroupedRMSNorm(width, hidden_size, eps, dtype=dtype, device=device)
        self.input_mix_weight_down = ReplicatedLinear(width, lowrank, dtype=dtype, device=device)
        self.input_mix_weight_up = ReplicatedLinear(lowrank, width, dtype=dtype, device=device)
        self.block_inject_weight = ReplicatedLinear(width, hc_count, dtype=dtype, device=device) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, hc*H] -> (sub-block input [T, H], injection weights [T, hc] or None)."""
        normed = self.hc_norm(streams)  # [T, hc*H]
        gate = F.silu(self.input_mix_weight_down(normed) / self.hc_count)  # [T, lowrank]
        gate = torch.sigmoid(self.input_mix_weight_up(gate))  # [T, hc*H]
        gate = gate.unflatten(-1, (self.hc_count, self.hidden_size))  # [T, hc, H]
        per_stream = normed.unflatten(-1, (self.hc_count, self.hidden_size))  # [T, hc, H]
        mixed = (gate * per_stream).mean(dim=-2)  # [T, H]
        if self.block_inject_weight is None:
            return mixed, None
        inject = 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc_count)  # [T, hc]
        return mixed, inject

    @staticmethod
    def combine(streams: torch.Tensor, block_out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """streams [T, hc*H] + block output [T, H] scaled per stream by inject [T, hc] -> [T, hc*H]."""
        added = block_out[:, None, :] * inject[:, :, None]  # [T, hc, H]
        return streams + added.flatten(-2)  # [T, hc*H]

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """Final mixer: streams [T, hc*H] -> [T, H]."""
        return self.mix(streams)[0]

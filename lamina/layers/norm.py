"""RMS norms of the Qwen hybrid family."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lamina.kernels.selection import kernel_set
from lamina.layers.linear import check_shape


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. `zero_centred`: the weight is stored as w - 1 (scale 1 + w)."""

    def __init__(self, dim: int, eps: float, *, zero_centred: bool = True, dtype=torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.kernels = kernel_set(device)

    def load_shard(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(name, loaded, tuple(self.weight.shape))
        self.weight.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "triton":
            from lamina.kernels.triton_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, self.zero_centred)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight.float()
        if self.zero_centred:
            scale = scale + 1.0
        return (normed * scale).to(x.dtype)


    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x)): one launch on the Triton kernel set."""
        if self.kernels == "triton" and residual.dim() == 2:
            from lamina.kernels.triton_norm import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps, self.zero_centred)
        total = residual + x
        return total, self(total)


class GatedRMSNorm(nn.Module):
    """norm(x) * weight * act(gate) over the last dim (the delta net's output norm, per head)."""

    def __init__(self, dim: int, eps: float, *, activation: str = "silu", dtype=torch.float32, device=None):
        super().__init__()
        self.eps = eps
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"gated norm activation {activation!r} is not one of 'silu', 'sigmoid'")
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.kernels = kernel_set(device)

    def load_shard(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(name, loaded, tuple(self.weight.shape))
        self.weight.data.copy_(loaded)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.kernels == "triton":
            from lamina.kernels.triton_norm import gated_rms_norm

            return gated_rms_norm(x, gate, self.weight, self.eps, self.activation)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * normed.to(x.dtype)
        gate32 = gate.float()
        act = F.silu(gate32) if self.activation == "silu" else torch.sigmoid(gate32)
        return (normed * act).to(x.dtype)

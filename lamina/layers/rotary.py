"""Rotary position embedding (rotate-half form, optionally on a leading fraction of the head dim)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first `rotary_dim` features of each head, by token position."""

    def __init__(self, head_dim: int, rotary_dim: int, base: float, max_position: int, device=None,
                 inv_freq: tuple[float, ...] | None = None, attention_factor: float = 1.0):
        """`inv_freq` / `attention_factor`: a scaled RoPE's frequencies and the factor cos and sin are
        multiplied by (YaRN's; lamina.models.hybrid_config.scaled_rope); default plain RoPE of `base`."""
        super().__init__()
        if rotary_dim % 2 != 0 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim = {rotary_dim} must be even and <= head_dim = {head_dim}")
        self.rotary_dim = rotary_dim
        if inv_freq is None:
            freqs = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        else:
            if len(inv_freq) != rotary_dim // 2:
                raise ValueError(f"{len(inv_freq)} rotary frequencies for rotary_dim = {rotary_dim} (expected "
                                 f"{rotary_dim // 2})")
            freqs = torch.tensor(inv_freq, dtype=torch.float32)
        self.attention_factor = float(attention_factor)
        self.register_buffer("inv_freq", freqs.to(device) if device is not None else freqs, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotary_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        if self.attention_factor != 1.0:  # scaled RoPE (YaRN): transformers scales cos and sin alike
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; cos/sin: [T, rotary_dim] (float32). Returns x with its rotary part rotated."""
        dtype = x.dtype
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        cos, sin = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]  # [T, 1, rotary_dim]
        out = rot * cos + rotated_half * sin
        return torch.cat((out, passthrough), dim=-1)

"""RMS norms in one Triton launch each (the torch references in `lamina.layers.norm` take ~9).

Both compute in float32 and round where the references round, so they agree with them to float32
reduction order: `rms_norm` = x * rsqrt(mean(x^2) + eps) * (w (+1 when zero-centred)), rounded
once; `gated_rms_norm` = round(w * round(normed)) * act(gate), rounded, with act silu or sigmoid;
`add_rms_norm` = the residual add (rounded, as torch's add) and the RMSNorm of its result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.pdl import pdl_kwargs, wait_for_producer

__all__ = ["rms_norm", "add_rms_norm", "gated_rms_norm"]


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, dim, eps, stride_x, stride_o,
                     ZERO_CENTRED: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x) / dim + eps)
    scale = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        scale = scale + 1.0
    tl.store(out_ptr + row * stride_o + offs, (normed * scale).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """RMSNorm over the last dim of x `[..., D]`; returns x's shape and dtype."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, dim, eps, rows.stride(0), out.stride(0),
            ZERO_CENTRED=zero_centred, BLOCK_D=triton.next_power_of_2(dim), **pdl_kwargs(x.device),
        )
    return out.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, w_ptr, sum_ptr, out_ptr, dim, eps, stride_x, stride_r, stride_s,
                         stride_o, ZERO_CENTRED: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
    total = (residual + x).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_s + offs, total, mask=ok)
    h = total.to(tl.float32)
    normed = h * tl.rsqrt(tl.sum(h * h) / dim + eps)
    scale = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        scale = scale + 1.0
    tl.store(out_ptr + row * stride_o + offs, (normed * scale).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, RMSNorm(residual + x)) for `[T, D]` rows, in one launch."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    total = torch.empty_like(residual)
    out = torch.empty_like(residual)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, total, out, x.shape[-1], eps, x.stride(0), residual.stride(0), total.stride(0),
            out.stride(0), ZERO_CENTRED=zero_centred, BLOCK_D=triton.next_power_of_2(x.shape[-1]),
            **pdl_kwargs(x.device),
        )
    return total, out


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, dim, eps, stride_x, stride_g, stride_o,
                           SILU: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < dim
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x) / dim + eps)).to(dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    normed = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    act = 1.0 / (1.0 + tl.exp(-gate))
    if SILU:
        act = gate * act
    tl.store(out_ptr + row * stride_o + offs, (normed * act).to(dtype), mask=ok)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str) -> torch.Tensor:
    """norm(x) * weight * act(gate) over the last dim; x and gate `[..., D]`."""
    dim = x.shape[-1]
    rows, gates = x.reshape(-1, dim), gate.reshape(-1, dim)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    gates = gates if gates.stride(-1) == 1 else gates.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _gated_rms_norm_kernel[(rows.shape[0],)](
            rows, gates, weight, out, dim, eps, rows.stride(0), gates.stride(0), out.stride(0),
            SILU=activation == "silu", BLOCK_D=triton.next_power_of_2(dim), **pdl_kwargs(x.device),
        )
    return out.view(x.shape)

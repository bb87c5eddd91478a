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

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.pdl import pdl_kwargs, wait_for_producer

__all__ = ["rms_norm", "add_rms_norm", "gated_rms_norm"]

# Warps per program (constants, never chosen by the row count: batch invariance);
# benchmarks/tune_decode_warps.py timed them at batch 1 on an H200 (tune_decode_warps_h200.json, us
# per call for 1 / 2 / 4 / 8 warps): add + RMSNorm of 2048 features 2.02 / 1.58 / 1.27 / 1.34, the
# gated norm of 32 heads x 128 7.59 / 2.69 / 1.60 / 1.34.
NORM_WARPS = 4
GATED_NORM_WARPS = 8


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
            num_warps=NORM_WARPS, **FP_FUSION,
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
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, RMSNorm(residual + x)) for `[T, D]` rows, in one launch; `num_warps`
    overrides NORM_WARPS (benchmarks)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    total = torch.empty_like(residual)
    out = torch.empty_like(residual)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, total, out, x.shape[-1], eps, x.stride(0), residual.stride(0), total.stride(0),
            out.stride(0), ZERO_CENTRED=zero_centred, BLOCK_D=triton.next_power_of_2(x.shape[-1]),
            **pdl_kwargs(x.device), num_warps=num_warps or NORM_WARPS, **FP_FUSION,
        )
    return total, out


# Rows of the gated norm per program: fixed (not chosen by the row count), so that a row's result does
# not depend on how many rows the step has (batch invariance); 16 x 128-wide delta-net heads keep a
# program busy at prefill sizes (one row per program ran at ~1/6 of the bandwidth on 8k tokens).
GATED_NORM_ROWS = 16


@triton.jit(do_not_specialize=["num_rows"])  # one compile for every step size (triton_moe.COUNT_ARGS says why)
def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, num_rows, heads, dim, eps,
                           stride_xt, stride_xh, stride_gt, stride_gh, stride_o,
                           SILU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] flat (token, head) rows
    token = rows // heads
    head = rows % heads
    offs = tl.arange(0, BLOCK_D)
    ok = (rows < num_rows)[:, None] & (offs < dim)[None, :]  # [BR, BD]
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + (token * stride_xt + head * stride_xh)[:, None] + offs[None, :], mask=ok,
                other=0.0).to(tl.float32)  # [BR, BD]
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)[:, None]).to(dtype)
    w = tl.load(w_ptr + offs, mask=offs < dim, other=0.0)  # [BD]
    normed = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dtype).to(tl.float32)
    gate = tl.load(gate_ptr + (token * stride_gt + head * stride_gh)[:, None] + offs[None, :], mask=ok,
                   other=0.0).to(tl.float32)  # [BR, BD]
    act = 1.0 / (1.0 + tl.exp(-gate))
    if SILU:
        act = gate * act
    tl.store(out_ptr + rows[:, None] * stride_o + offs[None, :], (normed * act).to(dtype), mask=ok)


def _token_head_strides(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, int, int, int]:
    """`t` `[..., D]` as (tensor, heads, token stride, head stride) of a `[tokens, heads, D]` view, without a
    copy when its strides allow (a strided split of a projection, as the delta net's z rows are)."""
    if t.dim() == 3 and t.stride(-1) == 1:
        return t, t.shape[1], t.stride(0), t.stride(1)
    rows = t.reshape(-1, dim)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    return rows, 1, rows.stride(0), 0


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str,
                   num_warps: int | None = None) -> torch.Tensor:
    """norm(x) * weight * act(gate) over the last dim; x and gate `[..., D]` of one shape. `[T, H, D]`
    inputs are read through their strides (no copy of a strided split). `num_warps` overrides
    GATED_NORM_WARPS (benchmarks)."""
    if x.shape != gate.shape:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)} and gate {tuple(gate.shape)} differ in shape")
    dim = x.shape[-1]
    num_rows = x.numel() // dim if dim else 0
    xs, heads, stride_xt, stride_xh = _token_head_strides(x, dim)
    gs, gate_heads, stride_gt, stride_gh = _token_head_strides(gate, dim)
    if heads != gate_heads:  # one of them was flattened: flatten both
        xs, heads, stride_xt, stride_xh = _token_head_strides(x.reshape(-1, dim), dim)
        gs, _, stride_gt, stride_gh = _token_head_strides(gate.reshape(-1, dim), dim)
    out = torch.empty((num_rows, dim), dtype=x.dtype, device=x.device)  # [rows, D]
    if num_rows:
        _gated_rms_norm_kernel[(triton.cdiv(num_rows, GATED_NORM_ROWS),)](
            xs, gs, weight, out, num_rows, heads, dim, eps, stride_xt, stride_xh, stride_gt, stride_gh, out.stride(0),
            SILU=activation == "silu", BLOCK_R=GATED_NORM_ROWS, BLOCK_D=triton.next_power_of_2(dim),
            **pdl_kwargs(x.device), num_warps=num_warps or GATED_NORM_WARPS, **FP_FUSION,
        )
    return out.view(x.shape)

"""`y = x @ W^T` for a few rows of x (decode): one program per tile of output features, the whole
reduction in one program (no split-K, so no second reduction launch), float32 accumulation.

cuBLAS runs a batch-1 GEMV of a 2048 x 4096 bf16 weight (the delta net's out_proj, the attention
o_proj) as a split-K GEMM plus a reduction kernel at about half the copy bandwidth
(FIELD_NOTES.md); small GEMVs (the router) at a few percent. Used by the linear layers on the
Triton kernel set for up to `GEMV_MAX_ROWS` rows (lamina.layers.linear).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["GEMV_MAX_ROWS", "gemv"]

GEMV_MAX_ROWS = 4


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, rows, out_features, in_features, stride_xm, stride_wn, stride_ym,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < out_features
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, ROWS)
    m_ok = offs_m < rows
    # Elementwise products accumulate in [ROWS, N, K] registers; one reduction at the end.
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < in_features
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    y = tl.sum(acc, axis=2)  # [ROWS, N]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


GEMV_CONFIG = dict(block_n=16, block_k=256, warps=4, stages=3)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x `[M, K]` (M <= GEMV_MAX_ROWS), weight `[N, K]` -> `[M, N]` in x's dtype."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows, got {rows}")
    if weight.shape[1] != in_features:
        raise ValueError(f"gemv: x has {in_features} features, weight {tuple(weight.shape)}")
    cfg = dict(GEMV_CONFIG)
    cfg.update(config or {})
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)  # [M, N]
    if rows:
        _gemv_kernel[(triton.cdiv(out_features, cfg["block_n"]),)](
            x, weight, y, rows, out_features, in_features, x.stride(0), weight.stride(0), y.stride(0),
            ROWS=triton.next_power_of_2(max(rows, 1)), BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            num_warps=cfg["warps"], num_stages=cfg["stages"],
        )
    return y


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) with the Triton GEMV for 2-D inputs of up to
    `GEMV_MAX_ROWS` rows (a host int fixed per captured batch size), cuBLAS beyond."""
    if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
        return gemv(x, weight)
    return torch.nn.functional.linear(x, weight)

"""Which kernel set a layer uses, chosen once when the model is built, never per tensor value.

- `reference`: the plain torch kernels of this package (CPU, CI, the oracle).
- `triton`: lamina's Triton kernels (`triton_decode`, `triton_moe`) for the one-token decode step
  and the routed experts; everything else stays on the reference kernels.

`LAMINA_KERNELS=auto|reference|triton` (read at model build time): `auto` (the default) takes
`triton` on CUDA when Triton imports, `reference` elsewhere. `triton` on the CPU runs the kernels
under Triton's interpreter (`TRITON_INTERPRET=1` must be set before Triton is imported): slow, but
it lets CI run the engine end to end on the fast kernels at tiny shapes.
"""

from __future__ import annotations

import importlib.util
import os

import torch

KERNEL_SETS = ("auto", "reference", "triton")


def kernel_set(device: torch.device | str | None) -> str:
    """'triton' or 'reference' for layers built on `device`."""
    wanted = os.environ.get("LAMINA_KERNELS", "auto")
    if wanted not in KERNEL_SETS:
        raise ValueError(f"LAMINA_KERNELS = {wanted!r} is not one of {', '.join(KERNEL_SETS)}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    has_triton = importlib.util.find_spec("triton") is not None
    if wanted == "reference":
        return "reference"
    if wanted == "triton":
        if not has_triton:
            raise ValueError("LAMINA_KERNELS = 'triton' but Triton is not installed (pip install triton)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"LAMINA_KERNELS = 'triton' on device {device.type!r} needs TRITON_INTERPRET=1 (Triton's CPU interpreter)"
            )
        return "triton"
    return "triton" if device.type == "cuda" and has_triton else "reference"


def decode_gemv_enabled(kernels: str) -> bool:
    """Whether the Triton kernel set's small-batch linears (out_proj, o_proj, the router) run
    lamina's GEMV (`lamina.kernels.triton_gemv`) for decode-sized inputs instead of cuBLAS.
    Off unless `LAMINA_TRITON_GEMV=1` (A/B measurements: cuBLAS was as fast or faster at
    the Qwen3.5-35B-A3B shapes, benchmarks/tune_gemv.py); read at model build time."""
    wanted = os.environ.get("LAMINA_TRITON_GEMV", "0")
    if wanted not in ("0", "1"):
        raise ValueError(f"LAMINA_TRITON_GEMV = {wanted!r} must be 0 or 1")
    return kernels == "triton" and wanted == "1"


def moe_gemv_max_tokens() -> int:
    """Up to how many tokens the Triton fused MoE runs its decode GEMV kernels
    (`lamina.kernels.triton_moe_gemv`) rather than the grouped GEMM: `LAMINA_MOE_GEMV=1` (the
    default) allows the GEMV path, `0` keeps every step on the grouped GEMM (for A/B runs); read
    at model build time."""
    from lamina.kernels.triton_moe_gemv import GEMV_MAX_TOKENS

    wanted = os.environ.get("LAMINA_MOE_GEMV", "1")
    if wanted not in ("0", "1"):
        raise ValueError(f"LAMINA_MOE_GEMV = {wanted!r} must be 0 or 1")
    return GEMV_MAX_TOKENS if wanted == "1" else 0


def is_one_token_decode(meta) -> bool:
    """A step whose every request has exactly one new token and keeps no per-position states
    (host ints of the plan only): what the Triton decode kernels handle."""
    return meta.max_query_len == 1 and meta.num_tokens == meta.num_reqs and meta.state_capture is None

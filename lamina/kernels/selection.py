"""Which kernel set a layer uses, chosen once when the model is built, never per tensor value.

- `reference`: the plain torch kernels of this package (CPU, CI, the oracle).
- `triton`: lamina's Triton kernels (`triton_decode`, `triton_verify`, `triton_moe`) for decode
  steps of a uniform Q tokens per request (`decode_query_len`: plain decode, MTP verification)
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


MAX_DECODE_QUERY_LEN = 8  # verification of up to 7 drafts (lamina.kernels.triton_verify.MAX_QUERIES)


def decode_query_len(meta) -> int | None:
    """Q when every request of the step has the same number Q <= 8 of new tokens and none is a
    prefill chunk: Q = 1 (plain decode, no per-position states kept) or Q = K + 1 (speculative
    verification: each request's last token and K drafts, keeping the states after tokens
    0..K-1 in the request-major layout of `StateCapture.per_request`). None otherwise. What the
    Triton decode kernels (`triton_decode`, `triton_verify`) handle; decided from host ints of
    the plan only, never from tensor values."""
    num_reqs, q = meta.num_reqs, meta.max_query_len
    if num_reqs <= 0 or not 1 <= q <= MAX_DECODE_QUERY_LEN or meta.num_tokens != num_reqs * q:
        return None
    capture = meta.state_capture
    if q == 1:
        return 1 if capture is None else None
    # Q > 1 tokens per request are decode tokens only when each request verifies Q - 1 drafts.
    return q if capture is not None and capture.per_request(num_reqs) == q - 1 else None


def is_one_token_decode(meta) -> bool:
    """A step whose every request has exactly one new token and keeps no per-position states
    (host ints of the plan only): what the one-token Triton decode kernels handle."""
    return decode_query_len(meta) == 1

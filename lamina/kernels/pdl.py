"""Programmatic dependent launch (PDL, Hopper and later) for lamina's decode kernels.

A decode step is a chain of ~450 short kernels; between two of them the GPU drains the first
(its last blocks, the memory flush) before it even launches the second. With PDL a kernel is
launched while its predecessor still runs: its blocks start, read what does not depend on the
predecessor (weights, the recurrent state of earlier steps), then wait (`griddepcontrol.wait`:
the predecessor has completed and its writes are visible) before they read its output or write
anything. Right after that wait each kernel lets its own successor launch, so at most one kernel
runs ahead of the one it depends on.

The contract of a kernel that takes `PDL`:
- it calls `wait_for_producer(PDL)` before its first read of anything an earlier kernel of the
  step may write (activations, routed ids, tickets, caches) and before its first write;
- before that call it reads only weights, or state last written two or more kernels earlier (a
  layer's delta-net state, written by that layer's previous step);
- it is launched with `**pdl_kwargs(device)`: `PDL=` and `launch_pdl=` the same flag.
Since every such kernel waits for its predecessor before it completes, completion is ordered
along the chain, and a kernel launched without the attribute (torch, cuBLAS) starts after its
predecessor as before. Off: `LAMINA_PDL=0` (read once per process), on the CPU (Triton's
interpreter has no grid dependency control), below compute capability 9.0, or with a Triton that
lacks `gdc_wait`. Arithmetic is the same either way: only when kernels start changes.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from lamina.kernels.selection import triton_interpreted

__all__ = ["pdl_kwargs", "pdl_launch", "wait_for_producer"]


@functools.cache
def _switch() -> bool:
    wanted = os.environ.get("LAMINA_PDL", "1")
    if wanted not in ("0", "1"):
        raise ValueError(f"LAMINA_PDL = {wanted!r} must be 0 or 1")
    # Triton's interpreter (set before Triton is imported, so fixed per process) has no grid dependency control.
    return wanted == "1" and not triton_interpreted()


@functools.cache
def _device_supports(index: int) -> bool:
    try:
        from triton.language.extra import cuda as cuda_extra
    except ImportError:
        return False
    if not hasattr(cuda_extra, "gdc_wait") or not hasattr(cuda_extra, "gdc_launch_dependents"):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with programmatic dependent launch (host-side,
    cached: the same answer for every call of a process on that device)."""
    if device.type != "cuda" or not _switch():
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def pdl_kwargs(device: torch.device) -> dict:
    """The launch keywords of a kernel that takes `PDL`: the constexpr and the launch attribute,
    always the same flag."""
    on = pdl_launch(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """Wait until the preceding kernel has completed (its writes visible), then let the next
    kernel launch. A no-op when PDL is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

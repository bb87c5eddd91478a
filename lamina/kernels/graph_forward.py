"""Whether the forward running now is one a CUDA graph holds: its warm-up before capture, the
capture itself, or its static-buffer stand-in (the graphs' padded forward run eagerly: on the
CPU, in tests, or for a shape whose graph was dropped).

A kernel that would take another path while a stream is capturing (the fused MoE keeps
`torch._grouped_mm` out of graphs, `lamina.kernels.triton_moe`) asks `in_graph_forward()`, so that
the warm-up compiles and runs what the capture records, and the graph and its eager stand-in
compute the same thing. The graph classes (`lamina.worker.cuda_graphs`, `verify_graphs`,
`mixed_graphs`) run their `_forward` under `graph_forward()`.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_GRAPH_FORWARD = contextvars.ContextVar("lamina_graph_forward", default=False)


@contextlib.contextmanager
def graph_forward():
    """Mark the forward inside as a graph's (usable as a decorator too)."""
    token = _GRAPH_FORWARD.set(True)
    try:
        yield
    finally:
        _GRAPH_FORWARD.reset(token)


def in_graph_forward() -> bool:
    """A graph's forward runs (`graph_forward`), or the current CUDA stream is capturing."""
    return _GRAPH_FORWARD.get() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

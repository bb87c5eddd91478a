"""Timing of GPU microbenchmarks as CUDA-graph replays (what a decode step replays), shared by the
benchmark scripts of this folder (they run as `python benchmarks/<script>.py`, so this folder is
on their import path)."""

from __future__ import annotations

import torch


def time_graph(fn, layers: int, replays: int = 20) -> float:
    """Median microseconds per call of `fn(layer)` over a CUDA graph of `layers` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (compiles, makes any tickets)
        for layer in range(layers):
            fn(layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    return sorted(times)[len(times) // 2]

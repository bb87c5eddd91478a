"""Timing of GPU microbenchmarks as CUDA-graph replays (what a decode step replays), shared by the
benchmark scripts of this folder (they run as `python benchmarks/<script>.py`, so this folder is
on their import path)."""

from __future__ import annotations

import torch


def capture_graph(body) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `body()`, run once on a side stream first (compiles, makes any tickets)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        body()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def time_graph(fn, layers: int, replays: int = 20) -> float:
    """Median microseconds per call of `fn(layer)` over a CUDA graph of `layers` calls."""

    def body():
        for layer in range(layers):
            fn(layer)

    graph = capture_graph(body)
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

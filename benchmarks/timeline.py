"""Where a profiled step's wall time goes on the device's timeline (benchmark helper, no engine code).

`annotate(targets)` wraps methods of live objects with `torch.profiler.record_function` labels for
the duration of a profile (the engine itself carries no annotations); `summarise(trace)` reads
the Chrome trace that `prof.export_chrome_trace` wrote and reports, for every labelled step, its
wall time, the device's busy time (the union of kernel, copy and memset intervals), the idle
time, and the largest idle gaps together with the labels that enclosed the host's launch of the
work that ended each gap: what the device was waiting for.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import torch

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@contextlib.contextmanager
def annotate(targets: list[tuple[object, str, str]]):
    """Wrap `getattr(obj, name)` in a `record_function(label)` for the block: (obj, name, label)."""
    saved = []
    try:
        for obj, name, label in targets:
            if obj is None or not hasattr(obj, name):
                continue
            original = getattr(obj, name)

            def wrapped(*args, _original=original, _label=label, **kwargs):
                with torch.profiler.record_function(_label):
                    return _original(*args, **kwargs)

            functools.update_wrapper(wrapped, original)
            had_own = name in getattr(obj, "__dict__", {})
            setattr(obj, name, wrapped)
            saved.append((obj, name, original, had_own))
        yield
    finally:
        for obj, name, original, had_own in reversed(saved):
            if had_own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def summarise(trace_path: str | Path, step_label: str = "step", min_gap_us: float = 15.0, top: int = 12) -> dict:
    """Per labelled step: wall, device busy and idle (us), and its largest device idle gaps."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = sorted((e for e in spans if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    labels = [e for e in spans if e.get("cat") == "user_annotation"]
    # the host call that queued each device event: runtime calls (cudaLaunchKernel, cudaGraphLaunch,
    # copies) and driver calls (cuLaunchKernelEx: Triton's launches), matched by correlation id
    launches = {e["args"]["correlation"]: e for e in spans
                if e.get("cat", "").startswith("cuda") and "correlation" in e.get("args", {})}
    steps = sorted((e for e in labels if e["name"] == step_label), key=lambda e: e["ts"])

    def enclosing(ts: float) -> list[str]:
        inside = [e for e in labels if e["ts"] <= ts <= e["ts"] + e["dur"]]
        return [e["name"] for e in sorted(inside, key=lambda e: -e["dur"])]

    rows = []
    for i, step in enumerate(steps):
        start = step["ts"]
        # the step's device work: launched while the step ran (it may finish after the host returns);
        # a device event without a matched launch is counted apart, never placed by its own start
        mine = [e for e in device if e.get("args", {}).get("correlation") in launches
                and start <= launches[e["args"]["correlation"]]["ts"] <= start + step["dur"]]
        if not mine:
            rows.append({"step": i, "wall_us": step["dur"], "device_events": 0})
            continue
        busy = _merge([(e["ts"], e["ts"] + e["dur"]) for e in mine])
        first, last = busy[0][0], busy[-1][1]
        gaps = []
        for (a0, a1), (b0, _) in zip(busy, busy[1:]):
            if b0 - a1 >= min_gap_us:
                nxt = next(e for e in mine if e["ts"] >= b0)
                launch = launches.get(nxt.get("args", {}).get("correlation"))
                gaps.append({"gap_us": round(b0 - a1, 1), "at_us": round(a1 - start, 1), "next": nxt["name"][:80],
                             "launched_in": enclosing(launch["ts"]) if launch else [],
                             "launch": launch["name"] if launch else None})
        busy_us = sum(b - a for a, b in busy)
        rows.append({"step": i, "wall_us": round(step["dur"], 1), "device_busy_us": round(busy_us, 1),
                     "device_span_us": round(last - first, 1), "idle_in_span_us": round(last - first - busy_us, 1),
                     "host_lead_us": round(first - start, 1), "device_tail_us": round(last - (start + step["dur"]), 1),
                     "device_events": len(mine), "gaps_total_us": round(sum(g["gap_us"] for g in gaps), 1),
                     "largest_gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:top]})
    unmatched = sum(1 for e in device if e.get("args", {}).get("correlation") not in launches)
    label_totals: dict[str, list[float]] = {}
    for e in labels:
        label_totals.setdefault(e["name"], []).append(e["dur"])
    return {"steps": rows, "device_events_without_launch": unmatched,
            "host_labels_us": {k: {"calls": len(v), "mean_us": round(sum(v) / len(v), 1)} for k, v in sorted(label_totals.items())}}

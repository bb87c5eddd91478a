"""benchmarks/timeline.py (the MTP profiles' step timeline in docs/PERFORMANCE.md) on a made-up
Chrome trace: device work is given to the step whose host span launched it, through runtime and
driver launches alike; idle gaps name the labels around the launch that ended them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

_SPEC = importlib.util.spec_from_file_location("timeline", Path(__file__).resolve().parents[1] / "benchmarks" / "timeline.py")
timeline = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(timeline)


def _x(cat, name, ts, dur, correlation=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def test_summarise_attributes_device_work_to_the_launching_step(tmp_path):
    events = [
        _x("user_annotation", "step", 0, 100), _x("user_annotation", "commit", 10, 20),
        _x("user_annotation", "step", 200, 100),
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=1),
        _x("cuda_driver", "cuLaunchKernelEx", 15, 2, correlation=2),  # a Triton launch inside "commit"
        _x("cuda_runtime", "cudaGraphLaunch", 90, 2, correlation=3),
        _x("kernel", "a", 10, 10, correlation=1),
        _x("kernel", "copy_rows", 50, 10, correlation=2),  # 30 us idle before it
        _x("kernel", "graph_node", 120, 100, correlation=3),  # launched in step 0, runs past its host span
        _x("kernel", "orphan", 230, 5, correlation=99),  # no launch: counted apart, in no step
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    summary = timeline.summarise(trace, min_gap_us=15.0)
    first, second = summary["steps"]
    assert first["device_events"] == 3 and second["device_events"] == 0
    assert first["device_busy_us"] == 120 and first["device_span_us"] == 210
    assert first["device_tail_us"] == 120  # the graph ends 120 us after the step's host span
    gaps = {g["next"]: g for g in first["largest_gaps"]}
    assert gaps["copy_rows"]["gap_us"] == 30 and gaps["copy_rows"]["launched_in"] == ["step", "commit"]
    assert gaps["copy_rows"]["launch"] == "cuLaunchKernelEx"
    assert gaps["graph_node"]["gap_us"] == 60 and gaps["graph_node"]["launch"] == "cudaGraphLaunch"
    assert summary["device_events_without_launch"] == 1
    assert summary["host_labels_us"]["step"] == {"calls": 2, "mean_us": 100.0}


def test_annotate_restores_what_it_wrapped():
    class Engine:
        def step(self):
            return "class"

    engine = Engine()
    engine.own = lambda: "own"
    with timeline.annotate([(engine, "step", "step"), (engine, "own", "own"), (None, "x", "x"), (engine, "missing", "m")]):
        assert engine.step() == "class" and engine.own() == "own"
        assert "step" in engine.__dict__
        with torch.profiler.profile() as prof:
            engine.step()
    assert "step" not in engine.__dict__ and engine.own() == "own" and engine.step() == "class"
    assert any(e.name == "step" for e in prof.events())

"""Host cost of replaying a CUDA graph (`CUDAGraph.replay()`, i.e. cudaGraphLaunch) by what the
graph holds, and of the engine's own decode and MTP verification graphs.

    python benchmarks/bench_graph_launch.py --out graph_launch.json                 # synthetic graphs only
    python benchmarks/bench_graph_launch.py --engine-layers 40 --out graph_launch.json  # + the engine's graphs

Synthetic graphs: N launches of a one-program Triton kernel (with and without programmatic
dependent launch), N torch `add_`, and N Triton launches with one memset or one copy node in the
middle. Per graph: the host time of `replay()` with the device idle (synchronised first) and with
the device busy (a long `torch.cuda._sleep` queued first, so the launch cannot wait on the GPU),
and the time from the call to the device's end (idle case). With `--engine-layers L`, a dummy
Qwen3.5-35B-A3B-shape engine with MTP K = 1 (L layers) is built and its batch-1 decode graph and
its 2-token verification graph are timed the same way.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_timing import capture_graph  # noqa: E402 (this folder, on the path as the script's own)


@triton.jit
def _tick_kernel(x_ptr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    v = tl.load(x_ptr)
    tl.store(x_ptr, v + 1.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def time_replay(graph: torch.cuda.CUDAGraph, repeats: int = 30) -> dict:
    idle_host, idle_total, busy_host = [], [], []
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        idle_host.append((t1 - t0) * 1e6)
        idle_total.append((t2 - t0) * 1e6)
        torch.cuda._sleep(20_000_000)  # ~10 ms of device time queued before the launch
        t0 = time.perf_counter()
        graph.replay()
        busy_host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    med = statistics.median
    return {"host_us_device_idle": round(med(idle_host), 1), "host_us_device_busy": round(med(busy_host), 1),
            "call_to_device_end_us": round(med(idle_total), 1)}


def synthetic(nodes: list[int]) -> list[dict]:
    x = torch.zeros(16, device="cuda")
    scratch = torch.zeros(1 << 16, device="cuda")
    rows = []
    for n in nodes:
        def triton_chain(pdl: bool, extra: str | None = None, n=n):
            def fn():
                for i in range(n):
                    if extra == "memset" and i == n // 2:
                        scratch.zero_()
                    if extra == "copy" and i == n // 2:
                        scratch[: 1 << 15].copy_(scratch[1 << 15:])
                    _tick_kernel[(1,)](x, USE_PDL=pdl, launch_pdl=pdl)
            return fn

        def torch_chain(n=n):
            for _ in range(n):
                x.add_(1.0)

        for name, fn in (("triton", triton_chain(False)), ("triton_pdl", triton_chain(True)),
                         ("torch_add", torch_chain), ("triton_with_memset", triton_chain(False, "memset")),
                         ("triton_with_copy", triton_chain(False, "copy"))):
            graph = capture_graph(fn)
            row = {"graph": name, "nodes": n, **time_replay(graph)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del graph
    return rows


def engine_graphs(layers: int) -> list[dict]:
    from bench_mtp import REAL, write_config

    from lamina import LLM, SamplingParams

    path = write_config(Path(tempfile.mkdtemp()) / "cfg", REAL, layers)
    llm = LLM(str(path), dtype="bfloat16", load_format="dummy", max_model_len=1024, max_num_seqs=1,
              show_progress=False, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    llm.generate([{"prompt_token_ids": list(range(1, 65))}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    runner = llm.engine.executor.runner
    rows = []
    verify = runner.verify_graphs
    graphs = getattr(verify, "graphs", {}) if verify is not None else {}
    graph = None
    for key, graph in sorted(graphs.items(), key=lambda kv: str(kv[0])):
        if graph is None:
            continue
        row = {"graph": f"engine_verify_q{key[0]}_b{key[1]}", **time_replay(graph)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    llm.shutdown()
    del llm, runner, verify, graphs, graph  # the two 40-layer engines never fit together
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(path), dtype="bfloat16", load_format="dummy", max_model_len=1024, max_num_seqs=1, show_progress=False)
    llm.generate([{"prompt_token_ids": list(range(1, 65))}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    decode = llm.engine.executor.runner.decode_graphs
    for size, entry in sorted(decode.graphs.items()):
        graph = entry[0] if isinstance(entry, tuple) else entry
        row = {"graph": f"engine_decode_{size}", **time_replay(graph)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    llm.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", default="1,100,500,1000")
    parser.add_argument("--engine-layers", type=int, default=0, help="also the engine's graphs (0: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = synthetic([int(n) for n in args.nodes.split(",")])
    if args.engine_layers:
        rows += engine_graphs(args.engine_layers)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "command": " ".join(sys.argv), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

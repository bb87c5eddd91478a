"""The server's own host cost per streamed token, without a GPU: a real `lamina serve` app (uvicorn
on a thread of this process, the demo model's tokenizer) whose executor answers every plan after
`--step-ms` of sleep (an emulated device step that releases the GIL, like a CUDA wait) with fixed
tokens (`bench_engine_host.InstantExecutor`); `lamina bench serve` drives it from a second process.
Reports this process's CPU time per streamed token (engine thread + event loop + HTTP) and the
served TPOT against the emulated step.

    python benchmarks/serve_host_probe.py --concurrency 32 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from bench_engine_host import InstantExecutor  # noqa: E402

from lamina.config import EngineArgs  # noqa: E402
from lamina.engine.llm_engine import LLMEngine  # noqa: E402
from tests.server_harness import RunningServer  # noqa: E402


class SleepingExecutor:
    """`InstantExecutor` after `step_s` of sleep a step."""

    def __init__(self, inner: InstantExecutor, step_s: float):
        self.inner = inner
        self.step_s = step_s

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute_replicas(self, plans):
        time.sleep(self.step_s)
        return self.inner.execute_replicas(plans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    engine = LLMEngine(EngineArgs(model=None, device="cpu", dtype="float32", show_progress=False,
                                  max_num_seqs=args.concurrency, max_model_len=args.output_len + 64))
    inner = InstantExecutor(engine.executor, 0, 0)
    engine.executor = SleepingExecutor(inner, args.step_ms / 1e3)
    bench_json = Path(args.out or "/tmp/serve_host_probe_bench.json").with_suffix(".bench.json")
    with RunningServer(engine, served_model_names=["demo"]) as server:
        cpu, wall, steps = time.process_time(), time.perf_counter(), inner.num_steps
        subprocess.run(
            [sys.executable, "-m", "lamina.entrypoints.cli", "bench", "serve", "--base-url", server.url,
             "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--input-len", "16",
             "--output-len", str(args.output_len), "--tokenizer", str(ROOT / "lamina" / "demo_model"),
             "--output-json", str(bench_json)],
            check=True, env=os.environ | {"PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
        )
        cpu, wall, steps = time.process_time() - cpu, time.perf_counter() - wall, inner.num_steps - steps
    served = json.loads(bench_json.read_text())[0]
    tokens = args.num_prompts * args.output_len
    record = {
        "kind": "serve_host_probe", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "concurrency": args.concurrency, "num_prompts": args.num_prompts, "output_len": args.output_len,
        "step_ms": args.step_ms, "engine_steps": steps, "server_cpu_s": cpu, "wall_s": wall,
        "server_cpu_us_per_token": cpu / tokens * 1e6, "served_tpot_ms": served["tpot_ms"], "served_itl_ms": served["itl_ms"],
        "served_output_tok_per_s": served["output_tok_per_s"],
    }
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

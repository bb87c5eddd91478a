"""What capturing every prefill / mixed step graph at start-up costs and saves: the engine's start-up
time, the shapes captured at start and during a serving-like run, and the slowest steps of that run
(a shape first met mid-serving stalls every running request while it is captured).

    LAMINA_MIXED_GRAPHS_AT_START=1 python benchmarks/bench_mixed_capture.py --out at_start.json
    LAMINA_MIXED_GRAPHS_AT_START=0 python benchmarks/bench_mixed_capture.py --out lazy.json

One process per setting (the variable is read when the engine starts). The run: `--requests`
requests with prompts of 1..`--max-prompt` tokens (seeded), `--arrivals` new ones joining every
step while any remain, each generating `--output-len` tokens, stepped until done; every step's
wall time is kept (CUDA synchronised), and each step that captured a shape is named.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=48)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--arrivals", type=int, default=2, help="new requests a step while any remain")
    ap.add_argument("--max-prompt", type=int, default=600)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import os

    import torch

    from lamina import LLM, SamplingParams
    from lamina.entrypoints.presets import preset_dir, preset_label

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    rng = random.Random(args.seed)
    start = time.perf_counter()
    llm = LLM(str(preset_dir(args.preset, args.num_layers)), dtype=args.dtype, load_format="dummy",
              max_num_seqs=args.max_num_seqs, show_progress=False)
    start_s = time.perf_counter() - start
    with llm:
        engine = llm.engine
        graphs = engine.executor.runner.mixed_graphs
        at_start = dict(graphs.capture_ms) if graphs is not None else {}
        vocab = min(engine.model_config.vocab_size, 200_000)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, args.max_prompt))] for _ in range(args.requests)]
        steps_ms: list[float] = []
        capture_steps: list[dict] = []
        run_start = time.perf_counter()
        while prompts or engine.has_unfinished_requests():
            for _ in range(min(args.arrivals, len(prompts))):
                engine.add_request({"prompt_token_ids": prompts.pop()}, params)
            known = set(graphs.capture_ms) if graphs is not None else set()
            sync()
            t0 = time.perf_counter()
            engine.step()
            sync()
            steps_ms.append((time.perf_counter() - t0) * 1e3)
            new = [s for s in (graphs.capture_ms if graphs is not None else {}) if s not in known]
            if new:
                capture_steps.append({"step": len(steps_ms) - 1, "ms": round(steps_ms[-1], 1),
                                      "shapes": [f"{t}x{r}" for t, r in new]})
        run_s = time.perf_counter() - run_start
    ordered = sorted(steps_ms)
    record = {
        "command": "python benchmarks/bench_mixed_capture.py " + " ".join(sys.argv[1:]),
        "env": {"LAMINA_MIXED_GRAPHS_AT_START": os.environ.get("LAMINA_MIXED_GRAPHS_AT_START", "(unset: 1)")},
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": preset_label(args.preset, args.num_layers), "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
        "start_up_s": round(start_s, 2), "shapes_at_start": len(at_start),
        "capture_ms_at_start_total": round(sum(at_start.values()), 1),
        "steps": len(steps_ms), "run_s": round(run_s, 3),
        "shapes_captured_mid_run": sum(len(c["shapes"]) for c in capture_steps), "capture_steps": capture_steps,
        "step_ms_p50": round(ordered[len(ordered) // 2], 2), "step_ms_p99": round(ordered[int(len(ordered) * 0.99)], 2),
        "step_ms_max": round(ordered[-1], 2), "slowest_steps_ms": [round(x, 1) for x in ordered[-5:]],
    }
    print(json.dumps({k: v for k, v in record.items() if k != "capture_steps"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

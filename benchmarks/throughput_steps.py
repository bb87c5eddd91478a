"""Where an offline `bench throughput` run's time goes, step by step: the engine's steps timed on the
host (wall time of each `LLMEngine.step()`), split into steps that carry prompt tokens and pure decode
steps, with the slowest ones listed. Same engine settings and prompts as `lamina bench throughput`.

    python benchmarks/throughput_steps.py --num-prompts 64 --input-len 1024 --output-len 256 \
        --max-num-seqs 64 --max-model-len 2048 --out throughput_steps.json
    python benchmarks/throughput_steps.py --trace-compiles --no-first-request --num-prompts 1 --input-len 16384 \
        --output-len 2 --max-num-seqs 1 --max-model-len 16400 --max-num-batched-tokens 2048   # what a first long prompt compiles
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

if "--trace-compiles" in sys.argv:  # a fresh Triton cache, read before triton is imported: every compile lands there
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")

import torch

from lamina import LLM, SamplingParams
from lamina.entrypoints.presets import DEFAULT_PRESET, preset_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--no-first-request", action="store_true",
                    help="time the workload as the engine's first requests after its warm-up (no 2-token request before)")
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--trace-compiles", action="store_true",
                    help="start from an empty Triton cache and list the kernels each step compiles")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="run the first N steps under cProfile and print where their host time went")
    ap.add_argument("--preset", default=DEFAULT_PRESET)
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    llm = LLM(str(preset_dir(args.preset, args.num_layers)), load_format="dummy", dtype="bfloat16" if cuda else "float32",
              skip_tokenizer_init=True,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, show_progress=False,
              max_num_batched_tokens=args.max_num_batched_tokens,
              async_scheduling=False if args.no_async_scheduling else None)
    engine = llm.engine
    seen: set[str] = set()

    def new_compiles() -> list[str]:
        """Kernels compiled since the last call (their metadata files in the fresh Triton cache)."""
        if not args.trace_compiles:
            return []
        names = []
        for path in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.json"):
            if path.name.startswith("__grp__") or str(path) in seen:
                continue
            seen.add(str(path))
            names.append(path.stem)
        return sorted(names)

    warm_up_compiles = new_compiles()
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(0, min(vocab, 200_000)) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if not args.no_first_request:
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
    sync()
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, params)
    steps = []
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        before = engine.step_token_counts[-1] if engine.step_token_counts else None
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0
        last = engine.step_token_counts[-1] if engine.step_token_counts else None
        tokens = last[0] if last is not None and last is not before else 0  # a capped deque: by identity
        if profiler is not None and len(steps) + 1 == args.cprofile:
            profiler.disable()
            import pstats

            pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            profiler = None
        steps.append({"ms": 1e3 * dt, "tokens": tokens, "outputs": len(outputs), "running": engine.num_running,
                      "preemptions": engine.num_preemptions, "compiled": new_compiles()})
    sync()
    total = time.perf_counter() - start
    out_tokens = args.num_prompts * args.output_len
    prefill = [s for s in steps if s["tokens"] > args.max_num_seqs]
    decode = [s for s in steps if 0 < s["tokens"] <= args.max_num_seqs]
    summary = {
        "command": "python benchmarks/throughput_steps.py " + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
            if k != "out" and v not in (None, False, 0)),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu", "total_s": total, "output_tok_per_s": out_tokens / total,
        "total_tok_per_s": (out_tokens + args.num_prompts * args.input_len) / total, "steps": len(steps),
        "prompt_steps": len(prefill), "prompt_steps_ms": sum(s["ms"] for s in prefill),
        "decode_steps": len(decode), "decode_steps_ms": sum(s["ms"] for s in decode),
        "mean_decode_step_ms": sum(s["ms"] for s in decode) / max(len(decode), 1),
        "preemptions": engine.num_preemptions, "num_kv_blocks": engine.num_kv_blocks,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "warm_up_compiles": len(warm_up_compiles),
        "slowest": sorted(steps, key=lambda s: -s["ms"])[:12],
        "first_steps": steps[:24],
    }
    print(json.dumps({k: v for k, v in summary.items() if k not in ("slowest", "first_steps")}, indent=1))
    print("slowest:", [(round(s["ms"], 1), s["tokens"]) for s in summary["slowest"]])
    print("first:", [(round(s["ms"], 1), s["tokens"], s["running"]) for s in summary["first_steps"]])
    for i, s in enumerate(steps):
        if s["compiled"]:
            print(f"step {i} ({s['tokens']} tokens, {s['running']} running, {s['ms']:.0f} ms) compiled: {s['compiled']}")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    llm.shutdown()


if __name__ == "__main__":
    main()

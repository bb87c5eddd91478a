"""Profile decode steps of the 40-layer Qwen3.5-35B-A3B shape (dummy weights): wall time per step,
GPU kernel time per step, kernel launches per step, and the top kernels.

    python benchmarks/profile_decode.py --batch 1 [--enforce-eager] [--out profile.json]
    python benchmarks/profile_decode.py --context 16384 --speculative-tokens 2  # MTP K = 2 steps at 16k context
    python benchmarks/profile_decode.py --prefill-len 8192 [--out profile.json]   # one prefill step instead
    python benchmarks/profile_decode.py --prefill-len 16384 --chunk 2048 --steps 1  # a prompt in 2k chunks
    python benchmarks/profile_decode.py --prefill-len 1024 --prompts 8  # eight 1k prompts in one step (offline throughput's)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina import LLM, SamplingParams  # noqa: E402
from lamina.entrypoints.presets import preset_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--prefill-len", type=int, default=0,
                    help="profile the prefill of prompts of this many tokens instead of decode (one chunk, or see --chunk)")
    ap.add_argument("--chunk", type=int, default=0,
                    help="with --prefill-len: the token budget per step (default: the whole prompt in one chunk)")
    ap.add_argument("--prompts", type=int, default=1,
                    help="with --prefill-len: this many prompts prefilled together (one step of --prefill-len x --prompts tokens)")
    ap.add_argument("--quantization", default=None, help="fp8: the dummy weights in block FP8 (experts stay FP8)")
    ap.add_argument("--context", type=int, default=128, help="decode: prompt tokens of each request")
    ap.add_argument("--speculative-tokens", type=int, default=0,
                    help="decode: MTP with this many drafts a step (one MTP layer; dummy weights reject every draft)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.prefill_len:
        profile_prefill(args)
        return
    path = preset_dir("qwen3.5-35b-a3b", args.layers)
    extra = {} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization}
    if args.speculative_tokens:
        extra.update(hf_overrides={"mtp_num_hidden_layers": 1},
                   speculative_config={"method": "mtp", "num_speculative_tokens": args.speculative_tokens})
    llm = LLM(str(path), device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=args.context + 384,
              max_num_seqs=max(args.batch, 1), show_progress=False, enforce_eager=args.enforce_eager,
              quantization=args.quantization, **extra)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request({"prompt_token_ids": [(i * 7919 + j) % 200000 for j in range(args.context)]}, params)
    for _ in range(3 + -(-args.context * args.batch // 2048)):  # the prefill (in chunks of at least 2048) + warm decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels) / args.steps
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    top = sorted(((sum(v) / args.steps, len(v) / args.steps, k) for k, v in by_name.items()), reverse=True)[:60]
    result = {
        "command": " ".join(sys.argv), "batch": args.batch, "context": args.context,
        "speculative_tokens": args.speculative_tokens, "layers": args.layers, "cuda_graphs": engine.cuda_graphs,
        "wall_ms_per_step": wall * 1e3, "gpu_kernel_ms_per_step": gpu_us / 1e3,
        "kernels_per_step": len(kernels) / args.steps,
        "top_kernels": [{"us_per_step": t, "calls_per_step": n, "name": k[:120]} for t, n, k in top],
    }
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()
    host.enable()
    for _ in range(20):
        engine.step()
    host.disable()
    stream = io.StringIO()
    pstats.Stats(host, stream=stream).sort_stats("tottime").print_stats(18)
    result["host_profile_20_steps"] = stream.getvalue().splitlines()[:45]
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    llm.shutdown()


def kernel_table(prof, steps: int) -> dict:
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    top = sorted(((sum(v) / steps, len(v) / steps, k) for k, v in by_name.items()), reverse=True)[:60]
    return {"gpu_kernel_ms_per_step": sum(e.device_time for e in kernels) / steps / 1e3,
            "kernels_per_step": len(kernels) / steps,
            "top_kernels": [{"us_per_step": t, "calls_per_step": n, "name": k[:120]} for t, n, k in top]}


def runtime_calls(prof, steps: int) -> dict:
    """CUDA runtime / driver calls on the host a step: launches, copies and synchronisations (a sync
    makes the host wait for the GPU, so the host's and the GPU's times add instead of overlapping)."""
    counts: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("cuda", "cu")) and "Launch" in e.name \
                or e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
                              "aten::item", "aten::_local_scalar_dense", "aten::nonzero"):
            counts[e.name] = counts.get(e.name, 0) + 1 / steps
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def host_profile(fn) -> list[str]:
    """cProfile of fn: the top functions by own time, then by cumulative time."""
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()
    host.enable()
    fn()
    host.disable()
    lines = []
    for key in ("tottime", "cumtime"):
        stream = io.StringIO()
        pstats.Stats(host, stream=stream).sort_stats(key).print_stats(30)
        lines += stream.getvalue().splitlines()[:45]
    return lines


def profile_prefill(args) -> None:
    """--prompts prompts of --prefill-len tokens prefilled together in one step (or in --chunk-token
    steps); the first prefill compiles and is not profiled, the next --steps are (fresh requests each
    time, so every step is the full prefill; the 1-token decode after it is excluded by max_tokens=1)."""
    n, prompts = args.prefill_len, args.prompts
    path = preset_dir("qwen3.5-35b-a3b", args.layers)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=n + 16,
              max_num_seqs=prompts, max_num_batched_tokens=args.chunk or n * prompts, show_progress=False,
              enforce_eager=args.enforce_eager)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def one_prefill(i: int) -> None:
        for p in range(prompts):
            engine.add_request({"prompt_token_ids": [(i * 7919 + p * 104729 + j * 31) % 200000 for j in range(n)]}, params)
        while engine.has_unfinished_requests():
            engine.step()

    one_prefill(0)
    one_prefill(1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(args.steps):
            one_prefill(2 + i)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
    result = {"command": " ".join(sys.argv), "prefill_len": n, "prompts": prompts, "chunk": args.chunk or n * prompts,
              "per_step_means": "per prefill of the prompts (all its chunks)", "layers": args.layers,
              "wall_ms_per_prefill_profiled": wall * 1e3, **kernel_table(prof, args.steps),
              "runtime_calls_per_prefill": runtime_calls(prof, args.steps)}
    walls = []
    for i in range(5):  # unprofiled
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        one_prefill(100 + i)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    result["wall_ms_per_prefill"] = sorted(walls)[2]
    result["host_profile_3_prefills"] = host_profile(lambda: [one_prefill(200 + i) for i in range(3)])
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    llm.shutdown()


if __name__ == "__main__":
    main()

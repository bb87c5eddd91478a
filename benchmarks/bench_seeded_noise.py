"""Cost of seeded sampling noise on a GPU: the torch reference (lamina.kernels.seeded_noise) and the
one-launch Triton kernel (lamina.kernels.triton_seeded_noise, session 26) against the global-RNG
draw and against the per-row torch.Generator loop the hash replaced (session 25): time and peak
memory per call at vocabulary 152k / 248k and S seeded rows, the sampler at batch 1 / 64 / 256
seeded (either noise) or not, the sampler at batch 1-256 with greedy, plain temperature and the Qwen3.5
generation config's top-k / top-p defaults (the full-vocabulary sort), and a check that the seeded
path does not sync the host. Writes a JSON record with --out.

    python benchmarks/bench_seeded_noise.py --out $OUT/seeded_noise.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from lamina.sampling_params import SamplingParams
from lamina.worker.sampler import Sampler, SamplingBatch
from lamina.kernels.seeded_noise import seed_key, seeded_exponential
from lamina.kernels.triton_seeded_noise import fill_seeded_exponential_triton


def timed_ms(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--top-k-only", action="store_true", help="only the top-k / top-p cut's A/B (a short device call)")
    args = parser.parse_args()
    device = "cuda"
    rows = []
    for vocab in () if args.top_k_only else (151936, 248320):
        for num in (1, 16, 64, 256, 1024):
            keys = torch.tensor([seed_key(s) for s in range(num)], device=device)
            positions = torch.arange(num, device=device)
            noise = torch.empty(num, vocab, device=device)
            generators = [torch.Generator(device=device) for _ in range(num)]

            def generator_loop():
                for i, gen in enumerate(generators):
                    row = torch.empty(vocab, device=device)
                    row.exponential_(generator=gen)
                    noise[i].copy_(row, non_blocking=True)

            row_ids = torch.arange(num, device=device)
            rows.append({
                "vocab": vocab, "rows": num,
                "seeded_ms": timed_ms(lambda: seeded_exponential(keys, positions, vocab)),
                "seeded_peak_gib": peak_gib(lambda: seeded_exponential(keys, positions, vocab)),
                "seeded_triton_ms": timed_ms(lambda: fill_seeded_exponential_triton(noise, row_ids, keys, positions)),
                "global_rng_ms": timed_ms(lambda: noise.exponential_()),
                "generator_loop_ms": timed_ms(generator_loop, repeats=3),
            })
            print(rows[-1], flush=True)
    vocab = 151936
    for batch in () if args.top_k_only else (1, 64, 256):
        logits = torch.randn(batch, vocab, device=device)
        for seeded, kernels in ((False, "torch"), (True, "torch"), (True, "triton")):
            params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i if seeded else None) for i in range(batch)]
            sampling = SamplingBatch.build(params, [3] * batch, [0], device, vocab, sampler_kernels=kernels)
            sampler = Sampler()
            rows.append({"sampler_batch": batch, "seeded": seeded, "sampler_kernels": kernels,
                         "ms": timed_ms(lambda: sampler(logits, sampling)),
                         "peak_gib": peak_gib(lambda: sampler(logits, sampling))})
            print(rows[-1], flush=True)
    # what a served request costs the sampler with the Qwen3.5 generation_config's defaults (top-k 20,
    # top-p 0.95, temperature 0.6: the full-vocabulary sort of apply_top_k_top_p) against greedy and
    # plain temperature, at the 248k vocabulary: is the sort worth a top-k-bounded path?
    vocab = 248320
    shapes = {"greedy": dict(temperature=0.0), "temperature": dict(temperature=1.0),
              "qwen_defaults": dict(temperature=0.6, top_p=0.95, top_k=20),
              "top_p_only": dict(temperature=0.6, top_p=0.95)}
    for batch in () if args.top_k_only else (1, 16, 64, 256):
        logits = torch.randn(batch, vocab, device=device)
        for name, options in shapes.items():
            sampling = SamplingBatch.build([SamplingParams(**options)] * batch, [3] * batch, [0], device, vocab)
            sampler = Sampler()
            rows.append({"sampler_batch": batch, "vocab": vocab, "params": name,
                         "ms": timed_ms(lambda: sampler(logits, sampling))})
            print(rows[-1], flush=True)
    # the top-k / top-p cut itself, the same run: the whole vocabulary sorted (apply_top_k_top_p,
    # the reference) against the sampler's path (filter_top_k_top_p: a top-k of TOP_K_WINDOW for rows
    # with top_k <= it), Qwen3.5's defaults
    from lamina.worker.top_k_top_p import apply_top_k_top_p, filter_top_k_top_p

    for batch in (1, 16, 64, 256):
        logits = torch.randn(batch, vocab, device=device)
        sampling = SamplingBatch.build([SamplingParams(**shapes["qwen_defaults"])] * batch, [3] * batch, [0], device, vocab)
        fused = replace(sampling, sampler_kernels="triton")
        rows.append({"top_k_top_p_batch": batch, "vocab": vocab,
                     "sorted_ms": timed_ms(lambda: apply_top_k_top_p(logits, sampling.top_k, sampling.top_p)),
                     "window_ms": timed_ms(lambda: filter_top_k_top_p(logits, sampling)),
                     "window_triton_ms": timed_ms(lambda: filter_top_k_top_p(logits, fused)),
                     "sampler_qwen_defaults_triton_ms": timed_ms(lambda: Sampler()(logits, fused))})
        print(rows[-1], flush=True)
    vocab = 151936
    logits = torch.randn(8, vocab, device=device)
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(8)]
    batches = [SamplingBatch.build(params, [3] * 8, [0], device, vocab, sampler_kernels=k) for k in ("torch", "triton")]
    for sampling in batches:  # compiled before the check
        Sampler()(logits, sampling)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for sampling in batches:
            Sampler()(logits, sampling)
            Sampler()(logits, sampling.with_noise_positions(torch.arange(8, device=device)))
        syncs = "none"
    except RuntimeError as e:
        syncs = str(e)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print("host syncs in the seeded path:", syncs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/bench_seeded_noise.py", "gpu": torch.cuda.get_device_name(),
                       "rows": rows, "host_syncs": syncs}, f, indent=1)


if __name__ == "__main__":
    main()

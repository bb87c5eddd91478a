"""Tile sizes of the fused MoE kernels at the Qwen3.5-35B-A3B shape (256 experts of 512 x 2048,
top-8, the shared expert fused), per batch size, timed as CUDA-graph replays on one GPU.

    python benchmarks/tune_moe.py [--batches 16,32,64] --out tune_moe.json
    python benchmarks/tune_moe.py --prefill [--batches 1024,8192] --out tune_moe_prefill.json   # prefill chunks

`--prefill` sweeps larger row blocks (the compute-bound regime of long prompt chunks) and reports
TFLOP/s as well as bytes.

Every tile config is timed with the kernels' defaults first, in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.triton_moe import default_config, fused_moe  # noqa: E402


def decode_configs() -> list[dict]:
    configs = []
    for block_m, n, k, warps, stages in itertools.product((16, 32), (32, 64, 128), (64, 128, 256), (4, 8), (3, 4)):
        if block_m == 32 and warps == 4 and n == 128:
            continue
        configs.append(dict(block_m=block_m, up_n=n, up_k=k, down_n=n, down_k=min(k, 128) if n == 128 else k,
                            warps=warps, stages=stages))
    return configs


def prefill_configs() -> list[dict]:
    configs = []
    for block_m, n, k, warps, stages in itertools.product((32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4)):
        if block_m * n >= 128 * 128 and warps == 4:  # two [M, N] float32 accumulators in 128 threads spill
            continue
        if block_m == 128 and n == 128 and k == 128:  # shared memory
            continue
        configs.append(dict(block_m=block_m, up_n=n, up_k=k, down_n=n, down_k=k, warps=warps, stages=stages))
    return configs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (tokens)")
    ap.add_argument("--prefill", action="store_true", help="the prefill-chunk tiles (default batches 1024,8192)")
    args = ap.parse_args()
    args.batches = args.batches or ("1024,8192" if args.prefill else "16,32,64")
    hidden, inter, experts, top_k = 2048, 512, 256, 8
    dev = "cuda"
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02
    sw13 = torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    sw2 = torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02
    ap_batches = [int(b) for b in args.batches.split(",")]
    results = []
    configs = prefill_configs() if args.prefill else decode_configs()
    for batch in ap_batches:
        x = torch.randn(batch, hidden, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(batch, experts + 1, device=dev)
        weights, ids = torch.softmax(logits[:, :experts], -1).topk(top_k, dim=-1)
        weights = weights.to(torch.bfloat16)
        shared = (sw13, sw2, logits[:, experts])
        distinct = int(torch.unique(ids).numel())
        nbytes = (distinct + 1) * 3 * inter * hidden * 2
        flops = (batch * top_k + batch) * 6 * hidden * inter  # routed pairs + the shared expert's rows
        default = dict(default_config(batch * top_k, torch.bfloat16))
        rows = []
        for cfg in [default, *configs]:
            try:
                call = lambda: fused_moe(x, w13, w2, weights, ids, shared=shared, config=cfg)  # noqa: E731
                # prefill chunks take milliseconds: plain timing (launch gaps do not matter there)
                ms = triton.testing.do_bench(call) if args.prefill else triton.testing.do_bench_cudagraph(call)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is skipped
                print("skip", cfg, type(e).__name__)
                continue
            rows.append((ms, cfg))
        default_ms = rows[0][0] if rows and rows[0][1] is default else None
        rows.sort(key=lambda r: r[0])
        best_ms, best = rows[0]
        rec = {"batch": batch, "distinct_experts": distinct, "bytes": nbytes, "best_us": best_ms * 1e3, "best": best,
               "best_gb_s": nbytes / best_ms / 1e6, "best_tflop_s": flops / best_ms / 1e9, "default": default,
               "default_tflop_s": flops / default_ms / 1e9 if default_ms else None,
               "default_us": default_ms * 1e3 if default_ms else None,
               "default_gb_s": nbytes / default_ms / 1e6 if default_ms else None,
               "top5": [(ms * 1e3, c) for ms, c in rows[:5]]}
        print(json.dumps(rec))
        results.append(rec)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

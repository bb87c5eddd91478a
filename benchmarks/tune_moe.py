"""Tile sizes of the fused MoE kernels at the Qwen3.5-35B-A3B shape (256 experts of 512 x 2048,
top-8, the shared expert fused), per batch size, timed as CUDA-graph replays on one GPU.

    python benchmarks/tune_moe.py [--batches 16,32,64] --out tune_moe.json

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

from lamina.kernels.triton_moe import DEFAULT_CONFIG_LARGE, DEFAULT_CONFIG_SMALL, fused_moe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="16,32,64", help="comma-separated batch sizes")
    args = ap.parse_args()
    hidden, inter, experts, top_k = 2048, 512, 256, 8
    dev = "cuda"
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02
    sw13 = torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    sw2 = torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02
    ap_batches = [int(b) for b in args.batches.split(",")]
    results = []
    configs = []
    for block_m, n, k, warps, stages in itertools.product((16, 32), (32, 64, 128), (64, 128, 256), (4, 8), (3, 4)):
        if block_m == 32 and warps == 4 and n == 128:
            continue
        configs.append(dict(block_m=block_m, up_n=n, up_k=k, down_n=n, down_k=min(k, 128) if n == 128 else k,
                            warps=warps, stages=stages))
    for batch in ap_batches:
        x = torch.randn(batch, hidden, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(batch, experts + 1, device=dev)
        weights, ids = torch.softmax(logits[:, :experts], -1).topk(top_k, dim=-1)
        weights = weights.to(torch.bfloat16)
        shared = (sw13, sw2, logits[:, experts])
        distinct = int(torch.unique(ids).numel())
        nbytes = (distinct + 1) * 3 * inter * hidden * 2
        default = {**(DEFAULT_CONFIG_SMALL if batch * top_k <= 64 else DEFAULT_CONFIG_LARGE)}
        rows = []
        for cfg in [default, *configs]:
            try:
                ms = triton.testing.do_bench_cudagraph(lambda: fused_moe(x, w13, w2, weights, ids, shared=shared, config=cfg))
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is skipped
                print("skip", cfg, type(e).__name__)
                continue
            rows.append((ms, cfg))
        default_ms = rows[0][0] if rows and rows[0][1] is default else None
        rows.sort(key=lambda r: r[0])
        best_ms, best = rows[0]
        rec = {"batch": batch, "distinct_experts": distinct, "bytes": nbytes, "best_us": best_ms * 1e3, "best": best,
               "best_gb_s": nbytes / best_ms / 1e6, "default": default,
               "default_us": default_ms * 1e3 if default_ms else None,
               "default_gb_s": nbytes / default_ms / 1e6 if default_ms else None,
               "top5": [(ms * 1e3, c) for ms, c in rows[:5]]}
        print(json.dumps(rec))
        results.append(rec)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

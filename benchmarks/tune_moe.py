"""Tile sizes of the fused MoE kernels at the Qwen3.5-35B-A3B shape (256 experts of 512 x 2048,
top-8, the shared expert fused), per batch size, timed as CUDA-graph replays on one GPU.

    python benchmarks/tune_moe.py --out tune_moe.json
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

from lamina.kernels.triton_moe import fused_moe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hidden, inter, experts, top_k = 2048, 512, 256, 8
    dev = "cuda"
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02
    sw13 = torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    sw2 = torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02
    results = []
    for batch in (1, 16, 64):
        x = torch.randn(batch, hidden, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(batch, experts + 1, device=dev)
        weights, ids = torch.softmax(logits[:, :experts], -1).topk(top_k, dim=-1)
        weights = weights.to(torch.bfloat16)
        shared = (sw13, sw2, logits[:, experts])
        distinct = int(torch.unique(ids).numel())
        nbytes = (distinct + 1) * 3 * inter * hidden * 2
        rows = []
        for up_n, up_k, down_n, down_k, warps, stages in itertools.product(
            (16, 32, 64), (128, 256), (32, 64, 128), (64, 128), (4,), (3,)
        ):
            cfg = dict(block_m=16, up_n=up_n, up_k=up_k, down_n=down_n, down_k=down_k, warps=warps, stages=stages)
            try:
                ms = triton.testing.do_bench_cudagraph(lambda: fused_moe(x, w13, w2, weights, ids, shared=shared, config=cfg))
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is skipped
                print("skip", cfg, type(e).__name__)
                continue
            rows.append((ms, cfg))
        rows.sort(key=lambda r: r[0])
        best_ms, best = rows[0]
        default_ms = [ms for ms, c in rows if c == dict(block_m=16, up_n=32 if batch * top_k <= 64 else 64, up_k=128, down_n=64, down_k=64, warps=4, stages=3)]
        rec = {"batch": batch, "distinct_experts": distinct, "bytes": nbytes, "best_us": best_ms * 1e3, "best": best,
               "best_gb_s": nbytes / best_ms / 1e6, "default_us": default_ms[0] * 1e3 if default_ms else None,
               "top5": [(ms * 1e3, c) for ms, c in rows[:5]]}
        print(json.dumps(rec))
        results.append(rec)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

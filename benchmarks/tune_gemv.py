"""Decode-regime (1-4 rows) tile sizes on one GPU, timed as CUDA-graph replays against the path they
would replace, in the same run:

- the MoE GEMV kernels (`lamina.kernels.triton_moe_gemv`) vs the grouped-GEMM fused MoE, at the
  Qwen3.5-35B-A3B shape (256 experts of 512 x 2048, top-8, the shared expert fused);
- lamina's Triton GEMV (`lamina.kernels.triton_gemv`) vs `F.linear` (cuBLAS) on that model's
  decode linears.

    python benchmarks/tune_gemv.py --out tune_gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.triton_gemv import gemv  # noqa: E402
from lamina.kernels.triton_moe import DEFAULT_CONFIG_SMALL, fused_moe  # noqa: E402
from lamina.kernels.triton_moe_gemv import GEMV_CONFIG, GEMV_CONFIG_ONE_TOKEN, fused_moe_gemv  # noqa: E402


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn) * 1e3  # us


# A decode step reads each layer's experts once, so timings should see weights from HBM, not from
# the 50 MB L2: each timed call runs ROTATIONS routings whose experts' weights (>= 200 MB together)
# evict one another, and reports the time per routing.
ROTATIONS = 8


def bench_rotated(fn, routings) -> float:
    return bench(lambda: [fn(*r) for r in routings]) / len(routings)


def copy_bandwidth(dev) -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    us = bench(lambda: b.copy_(a))
    return 2 * a.numel() / us / 1e3  # GB/s (read + write)


def tune_moe(dev, results):
    hidden, inter, experts, top_k = 2048, 512, 256, 8
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02
    sw13 = torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    sw2 = torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02
    best_batch1 = None
    gen = torch.Generator(device=dev).manual_seed(0)
    for batch in (1, 2, 4):
        x = torch.randn(batch, hidden, device=dev, dtype=torch.bfloat16)
        routings = []
        for _ in range(ROTATIONS):
            logits = torch.randn(batch, experts + 1, device=dev, generator=gen)
            weights, ids = torch.softmax(logits[:, :experts], -1).topk(top_k, dim=-1)
            routings.append((weights.to(torch.bfloat16), ids, (sw13, sw2, logits[:, experts])))
        weights, ids, shared = routings[0]
        distinct = int(torch.unique(ids).numel())
        nbytes = (distinct + 1) * 3 * inter * hidden * 2
        grouped_us = bench_rotated(
            lambda w, i, s: fused_moe(x, w13, w2, w, i, shared=s, config=DEFAULT_CONFIG_SMALL), routings)
        ref = fused_moe(x, w13, w2, weights, ids, shared=shared, config=DEFAULT_CONFIG_SMALL).float()
        rows = []

        def trial(cfg):
            try:
                out = fused_moe_gemv(x, w13, w2, weights, ids, shared=shared, config=cfg).float()
                err = ((out - ref).norm() / ref.norm()).item()
                us = bench_rotated(lambda w, i, s: fused_moe_gemv(x, w13, w2, w, i, shared=s, config=cfg), routings)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                print("skip", cfg, type(e).__name__)
                return
            rows.append((us, cfg, err))

        if batch == 1:  # gate/up tiles with the default down tiles, then down tiles with the best gate/up
            base = dict(GEMV_CONFIG)
            trial(base)
            trial(dict(GEMV_CONFIG_ONE_TOKEN))
            # (a wider sweep, (16, 32, 64) x (128, 256, 512) x (4, 8) x (3, 4), found 32-64 x 256, 4 warps)
            for up_n, up_k, warps, stages in itertools.product((32, 64), (256,), (4,), (3, 4)):
                trial({**base, "up_n": up_n, "up_k": up_k, "up_warps": warps, "up_stages": stages})
            best_up = min(rows, key=lambda r: r[0])[1]
            for down_n, warps, stages in itertools.product((16, 32), (4,), (2, 3)):
                trial({**best_up, "down_split": False, "down_n": down_n, "down_warps": warps, "down_stages": stages})
            for down_n, warps, stages in itertools.product((8, 16, 32, 64, 128), (2, 4, 8), (1,)):
                trial({**best_up, "down_split": True, "down_n": down_n, "down_warps": warps, "down_stages": stages})
            best_batch1 = min(rows, key=lambda r: r[0])[1]
        else:
            trial(dict(GEMV_CONFIG))
            trial({**GEMV_CONFIG, "down_split": not GEMV_CONFIG["down_split"]})
            trial(best_batch1)
        rows.sort(key=lambda r: r[0])
        rec = {"op": "moe", "batch": batch, "bytes": nbytes, "l2": f"cold ({ROTATIONS} routings rotated)",
               "grouped_us": grouped_us, "grouped_gb_s": nbytes / grouped_us / 1e3,
               "default_us": next(us for us, c, _ in rows if c == (GEMV_CONFIG_ONE_TOKEN if batch == 1 else GEMV_CONFIG)),
               "best_us": rows[0][0], "best": rows[0][1],
               "best_gb_s": nbytes / rows[0][0] / 1e3, "max_rel_err_vs_grouped": max(r[2] for r in rows),
               "top5": [(us, c) for us, c, _ in rows[:5]]}
        print(json.dumps(rec))
        results.append(rec)


def tune_linear(dev, results):
    shapes = {"out_proj / o_proj": (2048, 4096), "router + shared gate": (257, 2048),
              "delta-net in_proj (joint)": (12352, 2048), "attention qkv+gate": (9216, 2048)}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        for batch in (1, 2, 4):
            x = torch.randn(batch, k, device=dev, dtype=torch.bfloat16)
            cublas_us = bench(lambda: F.linear(x, w))
            ref = F.linear(x.float(), w.float())
            rows = []
            for block_n, block_k, warps, stages in itertools.product((4, 8, 16), (128, 256, 512), (4, 8), (3,)):
                cfg = dict(block_n=block_n, block_k=block_k, warps=warps, stages=stages)
                try:
                    err = ((gemv(x, w, cfg).float() - ref).norm() / ref.norm()).item()
                    us = bench(lambda: gemv(x, w, cfg))
                except Exception as e:  # noqa: BLE001
                    print("skip", cfg, type(e).__name__)
                    continue
                rows.append((us, cfg, err))
            rows.sort(key=lambda r: r[0])
            nbytes = n * k * 2
            rec = {"op": name, "shape": [n, k], "batch": batch, "bytes": nbytes, "cublas_us": cublas_us,
                   "cublas_gb_s": nbytes / cublas_us / 1e3, "best_us": rows[0][0], "best": rows[0][1],
                   "best_gb_s": nbytes / rows[0][0] / 1e3, "max_rel_err": max(r[2] for r in rows),
                   "top5": [(us, c) for us, c, _ in rows[:5]]}
            print(json.dumps(rec))
            results.append(rec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=("moe", "linear"), default=None)
    args = ap.parse_args()
    dev = "cuda"
    results = [{"op": "copy", "gb_s": copy_bandwidth(dev), "gpu": torch.cuda.get_device_name()}]
    print(json.dumps(results[0]))
    if args.only in (None, "moe"):
        tune_moe(dev, results)
    if args.only in (None, "linear"):
        tune_linear(dev, results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

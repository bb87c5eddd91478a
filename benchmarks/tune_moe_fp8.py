"""The MoE decode GEMVs (FMA kernels) on block FP8 experts at the Qwen3.5-35B-A3B shape (256 experts
of 512 x 2048, top-8, the shared expert fused, 128 x 128 blocks), one to four tokens, L2-cold
(routings rotated, as benchmarks/tune_gemv.py), against the same kernels on bf16 weights in the
same run: the FMA tiles (rows per program, columns per step, warps) swept around the bf16
defaults, since a program of the default tiles reads half the bytes on FP8. `fp8_default_us`: FP8
weights on the bf16 tiles (GEMV_CONFIG_FMA); `fp8_shipped_us`: on GEMV_CONFIG_FMA_FP8.

    python benchmarks/tune_moe_fp8.py --out tune_moe_fp8.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_gemv import ROTATIONS, bench_rotated, copy_bandwidth  # noqa: E402

from lamina.kernels.expert_scales import ExpertScales  # noqa: E402
from lamina.kernels.triton_moe_gemv import GEMV_CONFIG_FMA, GEMV_CONFIG_FMA_FP8, fused_moe_gemv  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, BLOCK = 2048, 512, 256, 8, 128


def fp8_weights(shape, dev, gen):
    values = torch.randn(*shape, device=dev, generator=gen).to(torch.float8_e4m3fn)
    *lead, rows, cols = shape
    scales = torch.full((*lead, rows // BLOCK, cols // BLOCK), 0.02, device=dev)
    return values, scales


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w13, s13 = fp8_weights((EXPERTS, 2 * INTER, HIDDEN), dev, gen)
    w2, s2 = fp8_weights((EXPERTS, HIDDEN, INTER), dev, gen)
    sw13, ss13 = fp8_weights((2 * INTER, HIDDEN), dev, gen)
    sw2, ss2 = fp8_weights((HIDDEN, INTER), dev, gen)
    scales = ExpertScales(s13, s2, (BLOCK, BLOCK), ss13, ss2)
    bf16 = [t.to(torch.bfloat16) * 0.02 for t in (w13, w2, sw13, sw2)]
    results = [{"op": "copy", "gb_s": copy_bandwidth(dev)}]
    print(json.dumps(results[0]))
    best_one = None
    for batch in (1, 2, 4):
        x = torch.randn(batch, HIDDEN, device=dev, dtype=torch.bfloat16)
        routings = []
        for _ in range(ROTATIONS):
            logits = torch.randn(batch, EXPERTS + 1, device=dev, generator=gen)
            weights, ids = torch.softmax(logits[:, :EXPERTS], -1).topk(TOP_K, dim=-1)
            routings.append((weights.to(torch.bfloat16), ids, logits[:, EXPERTS]))
        distinct = int(torch.unique(routings[0][1]).numel())
        fp8_bytes = (distinct + 1) * 3 * INTER * HIDDEN * (1 + 4 / BLOCK / BLOCK)
        started = time.perf_counter()
        bf16_us = bench_rotated(lambda w, i, g: fused_moe_gemv(x, bf16[0], bf16[1], w, i, shared=(bf16[2], bf16[3], g)),
                                routings)
        weights, ids, gate = routings[0]
        ref = fused_moe_gemv(x, w13, w2, weights, ids, shared=(sw13, sw2, gate), scales=scales).float()
        rows = []

        def trial(cfg):
            if any(c == cfg for _, c, _ in rows):
                return
            try:
                out = fused_moe_gemv(x, w13, w2, weights, ids, shared=(sw13, sw2, gate), config=cfg, scales=scales)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = bench_rotated(lambda w, i, g: fused_moe_gemv(x, w13, w2, w, i, shared=(sw13, sw2, g),
                                                                  config=cfg, scales=scales), routings)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                print("skip", cfg, type(e).__name__, str(e)[:200])
                return
            rows.append((us, cfg, err))

        trial(dict(GEMV_CONFIG_FMA))
        trial(dict(GEMV_CONFIG_FMA_FP8))
        if batch == 1:  # coordinate descent: the gate/up tile, then the down tile
            for up_n, up_k, up_warps in itertools.product((2, 4, 8, 16, 32), (1024, 2048), (4, 8)):
                trial(dict(GEMV_CONFIG_FMA, up_n=up_n, up_k=up_k, up_warps=up_warps))
            up = min(rows, key=lambda r: r[0])[1]
            for down_n, down_k, down_warps in itertools.product((2, 4, 8), (256, 512), (2, 4)):
                trial(dict(up, down_n=down_n, down_k=down_k, down_warps=down_warps))
            best_one = min(rows, key=lambda r: r[0])[1]
        else:
            trial(best_one)
        rows.sort(key=lambda r: r[0])
        default_us = next(us for us, c, _ in rows if c == GEMV_CONFIG_FMA)  # FP8 weights on the bf16 tiles
        shipped_us = next(us for us, c, _ in rows if c == GEMV_CONFIG_FMA_FP8)
        keys = ("up_n", "up_k", "up_warps", "down_n", "down_k", "down_warps")
        rows = [(us, {k: c[k] for k in keys}, err) for us, c, err in rows]
        rec = {"op": "moe_fp8", "batch": batch, "fp8_bytes": fp8_bytes, "l2": f"cold ({ROTATIONS} routings rotated)",
               "bf16_default_us": bf16_us, "fp8_default_us": default_us, "fp8_default_gb_s": fp8_bytes / default_us / 1e3,
               "fp8_shipped_us": shipped_us, "fp8_shipped": {k: GEMV_CONFIG_FMA_FP8[k] for k in keys},
               "best_us": rows[0][0], "best": rows[0][1], "best_gb_s": fp8_bytes / rows[0][0] / 1e3,
               "max_rel_err": max(r[2] for r in rows), "trials": len(rows), "sweep_s": time.perf_counter() - started,
               "top5": [(us, c) for us, c, _ in rows[:5]]}
        print(json.dumps(rec))
        results.append(rec)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

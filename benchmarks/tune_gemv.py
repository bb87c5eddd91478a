"""Decode-regime (1-4 rows) tile sizes on one GPU, timed as CUDA-graph replays against the path they
would replace, in the same run:

- the MoE GEMV kernels (`lamina.kernels.triton_moe_gemv`) vs the grouped-GEMM fused MoE, at the
  Qwen3.5-35B-A3B shape (256 experts of 512 x 2048, top-8, the shared expert fused);
- lamina's split-K Triton GEMV (`lamina.kernels.triton_gemv`) vs `F.linear` (cuBLAS) on that
  model's decode linears, L2-cold (ROTATIONS weight copies per timed call).

    python benchmarks/tune_gemv.py --out tune_gemv.json
    python benchmarks/tune_gemv.py --only moe --out tune_gemv_moe.json   # the MoE sweep alone
    python benchmarks/tune_gemv.py --only moe --many-programs --out ...  # and many-program tiles at one token

The MoE sweep (about 25 trials, each printed record says how many and how long) is coordinate
descent at one token: gate/up tiles and split, then the down tile (down_n x down_k), warps,
stages and slots per program; at 2 and 4 tokens the defaults and the best one-token tiles.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.triton_gemv import gemv, gemv_config  # noqa: E402
from lamina.kernels.triton_moe import DEFAULT_CONFIG_SMALL, fused_moe  # noqa: E402
from lamina.kernels.triton_moe_gemv import GEMV_CONFIG, GEMV_CONFIG_ONE_TOKEN, _shared_memory, fused_moe_gemv  # noqa: E402


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


def best(rows, **match) -> dict | None:
    """The config of the fastest row whose config has the `match` items (None: no such row)."""
    matching = [r for r in rows if all(r[1].get(k) == v for k, v in match.items())]
    return min(matching, key=lambda r: r[0])[1] if matching else None


def tune_moe(dev, results, many_programs: bool = False):
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
        started = time.perf_counter()
        distinct = int(torch.unique(ids).numel())
        nbytes = (distinct + 1) * 3 * inter * hidden * 2
        grouped_us = bench_rotated(
            lambda w, i, s: fused_moe(x, w13, w2, w, i, shared=s, config=DEFAULT_CONFIG_SMALL), routings)
        ref = fused_moe(x, w13, w2, weights, ids, shared=shared, config=DEFAULT_CONFIG_SMALL).float()
        rows = []

        def trial(cfg):
            if cfg is None or any(c == cfg for _, c, _ in rows):
                return
            try:
                out = fused_moe_gemv(x, w13, w2, weights, ids, shared=shared, config=cfg).float()
                err = ((out - ref).norm() / ref.norm()).item()
                us = bench_rotated(lambda w, i, s: fused_moe_gemv(x, w13, w2, w, i, shared=s, config=cfg), routings)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                print("skip", cfg, type(e).__name__, str(e)[:200])
                return
            if err > 1e-2:
                print("WRONG (relative error vs the grouped GEMM", err, ")", cfg)
            rows.append((us, cfg, err))

        if batch == 1:
            one = dict(GEMV_CONFIG_ONE_TOKEN)
            trial(one)
            # Gate/up tiles (a wider sweep, (16, 32, 64) x (128, 256, 512) x (4, 8) x (3, 4), found
            # 32-64 x 256, 4 warps), then the hidden dim split over 2 or 4 programs (72 programs of
            # 512 KB at up_n 64 leave 60 of the 132 SMs idle; it did not win on 2026-12-02).
            for up_n, stages in itertools.product((32, 64), (3, 4)):
                trial({**one, "up_n": up_n, "up_stages": stages})
            for up_n, up_split in itertools.product((32, 64), (2, 4)):
                trial({**one, "up_n": up_n, "up_split": up_split})
            best_up = best(rows)
            # The down tile (output rows x intermediate columns per step) at one program per slot,
            # then warps, stages and slots per program around the best.
            for down_n, down_k in itertools.product((32, 64, 128), (128, 256)):
                trial({**best_up, "down_n": down_n, "down_k": down_k, "down_warps": 4, "down_stages": 3, "down_slots": 1})
            for key, values in (("down_warps", (2, 8)), ("down_stages", (2, 4)), ("down_slots", (3, top_k + 1))):
                for value in values:
                    trial({**best(rows), key: value})
            if many_programs:
                # Tiles that put several programs on each SM (shared memory <= ~110 KB) and many
                # programs in the grid: 72 gate/up programs of 512 KB leave 60 SMs idle, and 144 or
                # 288 programs that fit one per SM run in 2-3 uneven waves (the earlier split
                # trials, at up_k 256 and 4 stages, were all of that kind).
                base = best(rows)
                for up_n, up_k, up_split, stages, warps in itertools.product(
                        (16, 32, 64), (64, 128, 256), (1, 2, 4, 8), (2, 3, 4), (2, 4)):
                    cfg = {**base, "up_n": up_n, "up_k": up_k, "up_split": up_split, "up_stages": stages, "up_warps": warps}
                    programs = (top_k + 1) * (inter // up_n) * up_split
                    if programs >= 256 and up_k * up_split <= hidden and _shared_memory(cfg, 2)[0] <= 110 * 1024:
                        trial(cfg)
                base = best(rows)
                for down_n, down_k, stages, warps in itertools.product((16, 32, 64), (64, 128, 256), (2, 3, 4), (1, 2, 4)):
                    cfg = {**base, "down_n": down_n, "down_k": down_k, "down_stages": stages, "down_warps": warps}
                    if _shared_memory(cfg, 2)[1] <= 110 * 1024:
                        trial(cfg)
            best_batch1 = best(rows)
        else:
            trial(dict(GEMV_CONFIG))
            trial(best_batch1)
            # The best one-token down tile, one program per slot or per (token, tile).
            down = {k: v for k, v in best_batch1.items() if k.startswith("down_")}
            for down_n, down_slots in itertools.product((32, 64), (1, top_k + 1)):
                trial({**GEMV_CONFIG, **down, "down_n": down_n, "down_slots": down_slots})
        rows.sort(key=lambda r: r[0])
        rec = {"op": "moe", "batch": batch, "bytes": nbytes, "l2": f"cold ({ROTATIONS} routings rotated)",
               "trials": len(rows), "sweep_s": time.perf_counter() - started,
               "grouped_us": grouped_us, "grouped_gb_s": nbytes / grouped_us / 1e3,
               # the tl.dot kernels' default tiles (the engine's default is the FMA kernels since session 17)
               "dot_default_us": next(us for us, c, _ in rows if c == (GEMV_CONFIG_ONE_TOKEN if batch == 1 else GEMV_CONFIG)),
               "best_us": rows[0][0], "best": rows[0][1],
               "best_gb_s": nbytes / rows[0][0] / 1e3, "max_rel_err_vs_grouped": max(r[2] for r in rows),
               "top5": [(us, c) for us, c, _ in rows[:5]]}
        print(json.dumps(rec))
        results.append(rec)


def tune_linear(dev, results):
    """lamina's split-K GEMV against cuBLAS on the model's decode linears, L2-cold: each timed call
    runs over ROTATIONS copies of the weight (together past the 50 MB L2)."""
    shapes = {"out_proj / o_proj": (2048, 4096), "router + shared gate (padded)": (264, 2048),
              "delta-net in_proj (joint)": (12352, 2048), "attention qkv+gate": (9216, 2048)}
    grid = list(itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8), (4,), (3, 4)))
    grid += [(32, 128, 4, 8, 4), (64, 128, 4, 8, 4), (32, 256, 2, 8, 3)]
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(ROTATIONS)]
        top: list[dict] = []
        for batch in (1, 4):  # the whole grid at one row; at four rows the one-row top five
            x = torch.randn(batch, k, device=dev, dtype=torch.bfloat16)
            cublas_us = bench(lambda: [F.linear(x, w) for w in weights]) / ROTATIONS
            ref = F.linear(x.float(), weights[0].float())
            rows = []
            candidates = [dict(block_n=bn, block_k=bk, split=sp, warps=wa, stages=st) for bn, bk, sp, wa, st in grid]
            for cfg in candidates if batch == 1 else top:
                try:
                    err = ((gemv(x, weights[0], cfg).float() - ref).norm() / ref.norm()).item()
                    us = bench(lambda: [gemv(x, w, cfg) for w in weights]) / ROTATIONS
                except Exception as e:  # noqa: BLE001
                    print("skip", cfg, type(e).__name__)
                    continue
                rows.append((us, cfg, err))
            rows.sort(key=lambda r: r[0])
            top = [c for _, c, _ in rows[:5]]
            default_us = bench(lambda: [gemv(x, w) for w in weights]) / ROTATIONS
            nbytes = n * k * 2
            rec = {"op": name, "shape": [n, k], "batch": batch, "bytes": nbytes, "cublas_us": cublas_us,
                   "cublas_gb_s": nbytes / cublas_us / 1e3, "default_us": default_us, "default": dict(gemv_config(n, k, batch)),
                   "best_us": rows[0][0], "best": rows[0][1],
                   "best_gb_s": nbytes / rows[0][0] / 1e3, "max_rel_err": max(r[2] for r in rows),
                   "top5": [(us, c) for us, c, _ in rows[:5]]}
            print(json.dumps(rec))
            results.append(rec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=("moe", "linear"), default=None)
    ap.add_argument("--many-programs", action="store_true",
                    help="at one token, also the MoE tiles of >= 256 programs and <= 110 KB of shared memory")
    args = ap.parse_args()
    dev = "cuda"
    results = [{"op": "copy", "gb_s": copy_bandwidth(dev), "gpu": torch.cuda.get_device_name()}]
    print(json.dumps(results[0]))
    if args.only in (None, "moe"):
        tune_moe(dev, results, many_programs=args.many_programs)
    if args.only in (None, "linear"):
        tune_linear(dev, results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

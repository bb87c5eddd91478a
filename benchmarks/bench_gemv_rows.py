"""lamina's decode GEMV (`lamina.kernels.triton_gemv.gemv`) at 1-4 input rows on the dense decode
weights of Qwen3.5-35B-A3B (one H200, CUDA graphs of 40 distinct weights, L2-cold, PDL as the
engine launches them): the default (`gemv_config(out, in, rows)`), the split-K kernel's tiles and
FMA tiles of more features a program. Session 15 found the FMA kernel (1-4 features a program)
faster end to end at 1-2 rows and slower at 4 (every program reads its whole input rows, so 4
rows re-read 4 x 8 KB per program); wider FMA tiles read them once per more features. Each
config is checked against float32 `x @ W^T` and, row by row, against its one-row call (a row's sum
must not depend on the other rows).

    python benchmarks/bench_gemv_rows.py --out bench_gemv_rows.json [--rows 3,4] [--quick] [--shapes router,out_proj]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels import triton_gemv  # noqa: E402
from graph_timing import time_graph  # noqa: E402

LAYERS = 40
SHAPES = {"in_proj 12352x2048": (12352, 2048), "qkv+gate 9216x2048": (9216, 2048),
          "out_proj 2048x4096": (2048, 4096), "router 264x2048": (264, 2048)}


def fma_configs(quick: bool) -> list[dict]:
    grid = itertools.product((1, 4, 8, 16), (4, 8), (512, 2048))  # block_n, warps, preload
    if quick:
        grid = [(1, 4, 512), (8, 4, 2048)]
    return [dict(fma=1, block_n=bn, block_k=512, warps=w, preload=p) for bn, w, p in grid]


def check(x, weight, config) -> dict:
    """Relative error against float32 and whether each row alone equals its row of the batch."""
    y = triton_gemv.gemv(x, weight, config)
    ref = x.float() @ weight.float().t()
    rows_alone = all(torch.equal(triton_gemv.gemv(x[r : r + 1], weight, config), y[r : r + 1]) for r in range(x.shape[0]))
    return dict(rel_err=((y.float() - ref).norm() / ref.norm()).item(), rows_alone_equal=rows_alone)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="3,4", help="input row counts, comma-separated (1-4)")
    ap.add_argument("--quick", action="store_true", help="two FMA tiles (a smoke run)")
    ap.add_argument("--shapes", default=None, help=f"weights to run, comma-separated first words of {list(SHAPES)}")
    args = ap.parse_args()
    shapes = SHAPES
    if args.shapes:
        wanted = args.shapes.split(",")
        shapes = {name: nk for name, nk in SHAPES.items() if name.split()[0] in wanted}
        if len(shapes) != len(wanted):
            raise SystemExit(f"--shapes {args.shapes}: each must be one of {[n.split()[0] for n in SHAPES]}")
    row_counts = [int(r) for r in args.rows.split(",")]
    if not all(1 <= r <= triton_gemv.GEMV_MAX_ROWS for r in row_counts):
        raise SystemExit(f"--rows {args.rows}: each must be 1-{triton_gemv.GEMV_MAX_ROWS}")
    dev, dtype = "cuda", torch.bfloat16
    results = {"gpu": torch.cuda.get_device_name(), "layers_per_graph": LAYERS, "cells": []}
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(LAYERS)]
        nbytes = n * k * 2
        for rows in row_counts:
            x = torch.randn(rows, k, device=dev, dtype=dtype)
            # the default as its explicit tiles, so the one-row calls of the check take the same ones
            named = [("default", triton_gemv.gemv_config(n, k, rows)), ("split-K", {"fma": 0})] + [(f"fma {c}", c) for c in fma_configs(args.quick)]
            for label, config in named:
                try:
                    cell = dict(shape=name, rows=rows, config=label, **check(x, weights[0], config))
                    cell["us"] = time_graph(lambda i, c=config: triton_gemv.gemv(x, weights[i], c), LAYERS)
                    cell["gb_s"] = nbytes / cell["us"] / 1e3
                except Exception as error:  # noqa: BLE001 - a tile that does not compile or fit
                    cell = dict(shape=name, rows=rows, config=label, error=str(error)[:200])
                results["cells"].append(cell)
            timed = sorted((c for c in results["cells"] if c["shape"] == name and c["rows"] == rows and "us" in c),
                           key=lambda c: c["us"])
            base = {c["config"]: round(c["us"], 2) for c in timed if c["config"] in ("default", "split-K")}
            print(name, "rows", rows, base, "fastest:", [(c["config"], round(c["us"], 2)) for c in timed[:3]], flush=True)
            if args.out:  # after every shape and row count, so a run cut short keeps what it measured
                Path(args.out).write_text(json.dumps(results, indent=1))
        del weights


if __name__ == "__main__":
    main()

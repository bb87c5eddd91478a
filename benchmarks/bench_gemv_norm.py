"""The residual add + RMSNorm in the prologue of the decode GEMV that reads its output, against the
two launches (`add_rms_norm`, then `gemv`), on one GPU.

Shapes of the Qwen3.5-35B-A3B text model (H = 2048, bf16): the delta net's joint in_proj (12352
rows), the attention's q/gate/k/v rows (9216) and the router with the shared expert's gate row
(264 rows, which also writes the normed rows for the experts). Each timed replay is a CUDA graph of
LAYERS calls over distinct weights (more than the L2 holds, as in a decode step), with programmatic
dependent launch as the engine runs it (LAMINA_PDL), reported in microseconds per call; `gemv_only`
is the GEMV of already-normed rows (what the norm adds on top of it). Every record also says whether
the fused outputs equal the two launches' bitwise.

    python benchmarks/bench_gemv_norm.py --out bench_gemv_norm.json    # ~10 s
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.triton_gemv import gemv, gemv_add_norm  # noqa: E402
from lamina.kernels.triton_norm import add_rms_norm  # noqa: E402
from graph_timing import time_graph  # noqa: E402 (this folder, on the path as the script's own)

SHAPES = {"in_proj": (12352, False), "qkv": (9216, False), "router": (264, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", default="1,4")
    args = ap.parse_args()
    dev, dtype, hidden = "cuda", torch.bfloat16, args.hidden
    gen = torch.Generator(device=dev).manual_seed(0)
    results = [{"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden": hidden,
                "layers_per_graph": args.layers}]
    for name, (out_features, want_normed) in SHAPES.items():
        weights = [(torch.randn(out_features, hidden, device=dev, generator=gen) * 0.02).to(dtype)
                   for _ in range(args.layers)]  # [N, H] per layer
        norm_w = torch.randn(hidden, device=dev, generator=gen).to(dtype)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, hidden, device=dev, generator=gen).to(dtype)  # [M, H]: the block output
            residual = torch.randn(rows, hidden, device=dev, generator=gen).to(dtype)  # [M, H]
            total, normed = add_rms_norm(x, residual, norm_w, 1e-6, True)

            def two(layer):
                t, n = add_rms_norm(x, residual, norm_w, 1e-6, True)
                return gemv(n, weights[layer]), t, n

            def fused(layer):
                return gemv_add_norm(x, residual, norm_w, 1e-6, True, weights[layer], want_normed=want_normed)

            y_two, t_two, n_two = two(0)
            y_fused, t_fused, n_fused = fused(0)
            torch.cuda.synchronize()
            rec = {
                "shape": name, "out_features": out_features, "rows": rows, "write_normed": want_normed,
                "us_two_launches": time_graph(two, args.layers),
                "us_fused": time_graph(fused, args.layers),
                "us_gemv_only": time_graph(lambda layer: gemv(normed, weights[layer]), args.layers),
                "bitwise_equal": bool(torch.equal(y_two, y_fused) and torch.equal(t_two, t_fused)
                                      and (n_fused is None or torch.equal(n_two, n_fused))),
                "max_abs_diff": float((y_two.float() - y_fused.float()).abs().max()),
            }
            results.append(rec)
            print(json.dumps(rec), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

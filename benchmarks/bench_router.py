"""MoE routing at decode on one GPU: the two launches (router GEMV + `route_softmax_topk`) against
the one-launch router (`lamina.kernels.triton_router.fused_router`) at T = 1, 2, 4 tokens.

Default shape: Qwen3.5-35B-A3B (256 experts + the shared expert's gate row, H = 2048, top-8,
renormalised, bf16). Each timed replay is a CUDA graph of LAYERS routings over distinct router
weights (64 x 1 MB, more than an H200's 50 MB L2: as in a decode step, which reads each layer's
router once), timed with CUDA events and reported in microseconds per routing. Paths:

- `two_launch_cublas`: F.linear (cuBLAS) + route_softmax_topk, the default before the fused router;
- `two_launch_triton_gemv`: lamina's Triton GEMV + route_softmax_topk (LAMINA_TRITON_GEMV=1);
- `fused`: fused_router with its default tiles (ROUTER_CONFIG); with --sweep, other tiles too.

Each record also says how often the fused ids equal the cuBLAS path's (near ties may differ) and
the largest weight difference.

    python benchmarks/bench_router.py --out bench_router.json            # a few seconds
    python benchmarks/bench_router.py --out bench_router.json --sweep    # + tile sweep (~1-2 min)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.triton_gemv import gemv  # noqa: E402
from lamina.kernels.triton_moe import route_softmax_topk  # noqa: E402
from lamina.kernels.triton_router import ROUTER_CONFIG, fused_router  # noqa: E402
from graph_timing import time_graph  # noqa: E402 (this folder, on the path as the script's own)

LAYERS = 64
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--extra-rows", type=int, default=1, help="gate rows after the experts' (the shared expert's)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--sweep", action="store_true", help="also time other fused-router tiles")
    args = ap.parse_args()
    dev, dtype = "cuda", DTYPES[args.dtype]
    experts, top_k = args.experts, args.top_k
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = [(torch.randn(experts + args.extra_rows, args.hidden, device=dev, generator=gen) * 0.02).to(dtype)
            for _ in range(LAYERS)]  # [E+extra, H] per layer
    results = [{"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "experts": experts,
                "hidden": args.hidden, "top_k": top_k, "extra_rows": args.extra_rows, "dtype": args.dtype,
                "layers_per_graph": LAYERS, "default_config": ROUTER_CONFIG}]
    print(json.dumps(results[0]))
    configs = [dict(ROUTER_CONFIG)]
    if args.sweep:
        for block_e, block_k, warps in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4, 8)):
            cfg = dict(ROUTER_CONFIG, block_e=block_e, block_k=block_k, warps=warps)
            if cfg != ROUTER_CONFIG:
                configs.append(cfg)
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        xs = [torch.randn(num_tokens, args.hidden, device=dev, generator=gen).to(dtype) for _ in range(LAYERS)]

        def cublas(layer):
            logits = F.linear(xs[layer], rows[layer])  # [T, E+extra]
            return route_softmax_topk(logits[:, :experts], top_k, True, dtype)

        def triton_gemv(layer):
            logits = gemv(xs[layer], rows[layer])  # [T, E+extra]
            return route_softmax_topk(logits[:, :experts], top_k, True, dtype)

        record = {"tokens": num_tokens, "two_launch_cublas_us": time_graph(cublas, LAYERS),
                  "two_launch_triton_gemv_us": time_graph(triton_gemv, LAYERS)}
        same_ids, max_weight_diff = 0, 0.0
        for layer in range(LAYERS):
            ref_weights, ref_ids = cublas(layer)
            weights, ids, _ = fused_router(xs[layer], rows[layer], experts, top_k, True)
            same_ids += int(torch.equal(ids, ref_ids))
            max_weight_diff = max(max_weight_diff, (weights.float() - ref_weights.float()).abs().max().item())
        record.update(ids_equal_layers=f"{same_ids}/{LAYERS}", max_weight_diff=max_weight_diff)
        sweep = []
        for cfg in configs:
            try:
                us = time_graph(lambda layer, cfg=cfg: fused_router(xs[layer], rows[layer], experts, top_k, True,
                                                                    config=cfg), LAYERS)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported and skipped
                print("skip", cfg, type(e).__name__, str(e)[:120])
                continue
            sweep.append((us, cfg))
        record["fused_us"] = sweep[0][0]
        record["speedup_vs_cublas"] = record["two_launch_cublas_us"] / record["fused_us"]
        if args.sweep:
            sweep.sort(key=lambda r: r[0])
            record["sweep_best_us"], record["sweep_best"] = sweep[0]
            record["sweep_top5"] = sweep[:5]
        print(json.dumps(record))
        results.append(record)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

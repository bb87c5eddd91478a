"""The decode GEMV tiles of the router (264 x 2048) and out_proj / o_proj (2048 x 4096) timed where
they run in a decode step: each call behind its producer (the router behind an add + RMSNorm,
out_proj behind the delta net's gated RMSNorm of 32 heads x 128) and, for the router, before the
routing kernel, in a CUDA graph of 40 layers with distinct weights and PDL, us per
layer. benchmarks/tune_gemv.py timed the GEMVs alone (L2-cold single kernels); here a split-K
ticket tail or a ramp shows as the step sees it. Not yet run on a GPU (written in session 13 after
its device time was spent); a winner becomes GEMV_CONFIG_SMALL / GEMV_CONFIG in
lamina/kernels/triton_gemv.py only after an end-to-end batch-1 A/B against the tree before it.

    python benchmarks/tune_gemv_chain.py --out tune_gemv_chain.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels import triton_gemv, triton_moe, triton_norm  # noqa: E402
from graph_timing import time_graph  # noqa: E402 (this folder, on the path as the script's own)

LAYERS = 40
SPACES = {
    "router": ((264, 2048), dict(block_n=(16,), block_k=(128, 256), split=(2, 4, 8, 16), warps=(2, 4), stages=(3,))),
    "out_proj": ((2048, 4096), dict(block_n=(16, 32, 64), block_k=(128,), split=(1, 2, 4, 8), warps=(4,), stages=(4,))),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    results = [{"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers_per_graph": LAYERS}]
    for name, ((out_features, in_features), space) in SPACES.items():
        weights = [(torch.randn(out_features, in_features, device=dev, generator=gen) * 0.02).to(dtype)
                   for _ in range(LAYERS)]
        x, residual = torch.randn(1, in_features, device=dev, generator=gen).to(dtype), torch.randn(
            1, in_features, device=dev, generator=gen).to(dtype)
        norm_w = torch.randn(in_features, device=dev, generator=gen).to(dtype)
        heads, head_dim = in_features // 128, 128  # out_proj's input: the gated norm's [T, Hv, Dv] rows
        gate, head_w = x.view(1, heads, head_dim) * 0.5, norm_w[:head_dim]
        default = triton_gemv.gemv_config(out_features, in_features)

        def step(layer, cfg):
            if name == "router":
                normed = triton_norm.add_rms_norm(x, residual, norm_w, 1e-6, True)[1]
                logits = triton_gemv.gemv(normed, weights[layer], cfg)
                return triton_moe.route_softmax_topk(logits[:, :256], 8, True, dtype)
            core = triton_norm.gated_rms_norm(residual.view(1, heads, head_dim), gate, head_w, 1e-6, "silu")
            return triton_gemv.gemv(core.view(1, in_features), weights[layer], cfg)

        rows = []
        keys = list(space)
        for values in itertools.product(*(space[k] for k in keys)):
            cfg = dict(zip(keys, values))
            try:
                us = time_graph(lambda layer, c=cfg: step(layer, c), LAYERS)
            except Exception as error:  # a tile that does not compile or fit
                rows.append(dict(cfg, error=str(error)[:120]))
                continue
            rows.append(dict(cfg, us=us))
        us_default = time_graph(lambda layer: step(layer, default), LAYERS)
        timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        record = {"shape": name, "out_features": out_features, "in_features": in_features, "default": default,
                  "us_default": us_default, "best": timed[:5], "all": rows}
        results.append(record)
        print(json.dumps({"shape": name, "us_default": round(us_default, 3),
                          "best": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                                   for r in timed[:4]]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

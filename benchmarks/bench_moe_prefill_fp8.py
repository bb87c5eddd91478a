"""The fused MoE on a prefill chunk at the Qwen3.5-35B-A3B shape (256 experts of 512 x 2048, top-8,
the shared expert fused), bf16 weights on their default tiles against FP8 experts (128 x 128 blocks)
on theirs, in one run, in both forms: each weight tile dequantized into bf16 before its dot
(`fp8_scale_b` 1, the default) or the tile's products scaled after the dot in a second accumulator
(`fp8_scale_b` 0). `--sweep` then times the default form on other tiles (K tiles up to the
128-wide block), for 1,024 tokens or more.

    python benchmarks/bench_moe_prefill_fp8.py [--tokens 2048,8192] [--sweep] --out bench_moe_prefill_fp8.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.expert_scales import ExpertScales  # noqa: E402
from lamina.kernels.triton_moe import default_config, fused_moe  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, BLOCK = 2048, 512, 256, 8, 128
# (block_m, up_n, up_k, down_n, down_k, warps, stages) tried by --sweep, with n_fastest
SWEEP = [(128, 128, 128, 128, 128, 8, 3), (128, 128, 64, 128, 64, 8, 4), (128, 64, 128, 64, 128, 4, 3),
         (64, 128, 128, 128, 128, 4, 3), (64, 64, 128, 64, 128, 4, 4), (64, 128, 64, 128, 64, 4, 4),
         (128, 256, 64, 256, 64, 8, 3), (128, 128, 128, 128, 128, 8, 2), (64, 64, 64, 64, 64, 4, 4),
         (128, 128, 64, 128, 64, 8, 3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def fp8(*shape):
        values = torch.randn(*shape, device=dev, generator=gen).to(torch.float8_e4m3fn)
        return values, torch.full((*shape[:-2], shape[-2] // BLOCK, shape[-1] // BLOCK), 0.02, device=dev)

    (w13, s13), (w2, s2) = fp8(EXPERTS, 2 * INTER, HIDDEN), fp8(EXPERTS, HIDDEN, INTER)
    (sw13, ss13), (sw2, ss2) = fp8(2 * INTER, HIDDEN), fp8(HIDDEN, INTER)
    scales = ExpertScales(s13, s2, (BLOCK, BLOCK), ss13, ss2)
    bf16 = [t.to(torch.bfloat16) * 0.02 for t in (w13, w2, sw13, sw2)]
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(tokens, EXPERTS + 1, device=dev, generator=gen)
        weights, ids = torch.softmax(logits[:, :EXPERTS], -1).topk(TOP_K, dim=-1)
        weights = weights.to(torch.bfloat16)
        cfg = dict(default_config(tokens * TOP_K, torch.bfloat16, fp8=True))
        runs = {
            "bf16": lambda: fused_moe(x, bf16[0], bf16[1], weights, ids, shared=(bf16[2], bf16[3], logits[:, EXPERTS])),
            "fp8_scale_b": lambda: fused_moe(x, w13, w2, weights, ids, shared=(sw13, sw2, logits[:, EXPERTS]),
                                             scales=scales, config=dict(cfg, fp8_scale_b=1)),
            "fp8_scale_products": lambda: fused_moe(x, w13, w2, weights, ids, shared=(sw13, sw2, logits[:, EXPERTS]),
                                                    scales=scales, config=dict(cfg, fp8_scale_b=0)),
        }
        ref = runs["bf16"]().float()
        rec = {"tokens": tokens, "config": cfg, "bf16_config": default_config(tokens * TOP_K, torch.bfloat16)}
        for name, fn in runs.items():
            out = fn().float()
            rec[name + "_ms"] = triton.testing.do_bench(fn)
            rec[name + "_rel_err_vs_bf16"] = ((out - ref).norm() / ref.norm()).item()
        if args.sweep and tokens >= 1024:  # prefill tiles
            rec["sweep_fp8_scale_b_ms"] = []
            for bm, un, uk, dn, dk, warps, stages in SWEEP:
                tile = dict(block_m=bm, up_n=un, up_k=uk, down_n=dn, down_k=dk, warps=warps, stages=stages,
                            n_fastest=True)
                try:
                    ms = triton.testing.do_bench(lambda: fused_moe(
                        x, w13, w2, weights, ids, shared=(sw13, sw2, logits[:, EXPERTS]), scales=scales, config=tile))
                except Exception as e:  # a tile over shared memory: recorded, not fatal
                    ms = repr(e)[:120]
                rec["sweep_fp8_scale_b_ms"].append([tile, ms])
        print(json.dumps(rec))
        results.append(rec)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

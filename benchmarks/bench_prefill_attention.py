"""Prefill attention at the Qwen3.5-35B-A3B shape (16 query heads, 2 KV heads, head dim 256) on
one GPU: SDPA with the explicit boolean causal mask `paged_attention` builds today against SDPA's
own `is_causal`, and the outputs' largest difference.

    python benchmarks/bench_prefill_attention.py [--lens 1024,8192] --out bench_prefill_attention.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


def time_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="1024,8192")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    heads, kv_heads, dim = 16, 2, 256
    rows = []
    for n in (int(x) for x in args.lens.split(",")):
        q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(n, device="cuda")
        mask = (pos[None, :] <= pos[:, None])[None, None]  # [1, 1, n, n]
        masked = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
        causal = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        flops = 4 * heads * dim * n * (n + 1) / 2  # causal: QK^T and PV over the lower triangle
        rec = {"len": n, "mask_ms": time_ms(masked), "is_causal_ms": time_ms(causal),
               "max_abs_diff": (masked().float() - causal().float()).abs().max().item()}
        rec["mask_tflop_s"] = flops / rec["mask_ms"] / 1e9
        rec["is_causal_tflop_s"] = flops / rec["is_causal_ms"] / 1e9
        print(json.dumps(rec))
        rows.append(rec)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""SDPA's cost of a new shape on one GPU: the first call at each of several new prompt lengths (where a
backend that builds a plan per shape, cuDNN's, pays for it) and a repeat call, per backend, for the
causal rule and the explicit mask, at the Qwen3.5-35B-A3B attention shape (16 query heads, 2 KV heads,
head dim 256: 16 KV heads, or with --gqa 2 KV heads passed with enable_gqa as paged_attention does).

    python benchmarks/bench_sdpa_shapes.py [--gqa] --out bench_sdpa_shapes.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "default": None}


def call_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="997,1001,1013,2039,4093,8191")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--gqa", action="store_true", help="2 KV heads passed with enable_gqa (as paged_attention does)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    heads, dim = 16, 256
    kv_heads = 2 if args.gqa else heads
    records = []
    for mode in ("causal", "mask"):
        for name, backend in ((b, BACKENDS[b]) for b in args.backends.split(",")):
            if mode == "mask" and name == "flash":
                continue  # flash takes no mask
            for n in (int(x) for x in args.lens.split(",")):
                q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)  # [1, Hq, L, D]
                k = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)  # [1, Hkv, L, D]
                v = torch.randn_like(k)
                mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril() if mode == "mask" else None

                def run():
                    kw = {"is_causal": True} if mask is None else {"attn_mask": mask}
                    kw["enable_gqa"] = kv_heads != heads
                    if backend is None:
                        return F.scaled_dot_product_attention(q, k, v, **kw)
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v, **kw)

                try:
                    first = call_ms(run)
                    again = min(call_ms(run) for _ in range(3))
                except RuntimeError as e:
                    records.append({"mode": mode, "backend": name, "len": n, "error": str(e)[:160]})
                    print(mode, name, n, "error", str(e)[:100])
                    continue
                records.append({"mode": mode, "backend": name, "len": n, "first_ms": first, "again_ms": again})
                print(f"{mode:6s} {name:9s} L={n:5d}: first {first:8.1f} ms, again {again:7.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "kv_heads": kv_heads, "command": "python benchmarks/bench_sdpa_shapes.py"
                                              + (" --gqa" if args.gqa else ""),
                                              "records": records}, indent=2))


if __name__ == "__main__":
    main()

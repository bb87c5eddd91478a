"""One-token paged decode attention over a bf16 and an FP8 KV cache, and the kernel's launch
parameters for each, timed on one GPU.

Session 36 measured an FP8 cache slower to decode than a bf16 one at batch 32 / 4k context (14.84
against 14.17 ms a step, Qwen3.5-35B-A3B on an H200) although it reads half the KV bytes. This
times `lamina.kernels.triton_decode.paged_decode_attention` alone at that model's attention shape
(16 query heads, 2 KV heads, head dim 256, output gate, 16-token pages in shuffled order), as a
CUDA graph of LAYERS calls each over its own cache (as the 10 attention layers read theirs: nothing
stays in L2), for each cache dtype and each (keys an iteration, warps, software-pipeline stages,
splits). Reports microseconds a call, the KV bytes a call reads, the bandwidth that makes, and the
largest difference of each variant's output to the default's (the same cache).

    python benchmarks/bench_decode_attention_kv.py --out bench_decode_attention_kv.json   # ~1 min
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.triton_decode import paged_decode_attention  # noqa: E402
from graph_timing import time_graph  # noqa: E402 (this folder, on the path as the script's own)

LAYERS = 10
HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 2, 256, 16


def make_case(batch: int, context: int, cache_dtype: torch.dtype, dev, queries: int = 1):
    """LAYERS caches of `batch` requests at `context` tokens in shuffled pages, their block tables and
    lengths, and bf16 queries / gates `[batch * queries, HEADS, HEAD_DIM]`."""
    gen = torch.Generator(device=dev).manual_seed(0)
    pages_per_req = context // PAGE
    num_pages = batch * pages_per_req + 1
    caches = []
    for _ in range(LAYERS):
        k = (torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device=dev, generator=gen) * 0.5).to(cache_dtype)
        v = (torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device=dev, generator=gen) * 0.5).to(cache_dtype)
        caches.append((k, v))
    order = torch.randperm(num_pages - 1, device=dev, generator=gen) + 1
    block_tables = order.view(batch, pages_per_req).to(torch.int32)  # [B, pages]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch * queries, HEADS, HEAD_DIM, device=dev, generator=gen).to(torch.bfloat16)  # [B*Q, H, D]
    gate = torch.randn(batch * queries, HEADS, HEAD_DIM, device=dev, generator=gen).to(torch.bfloat16)
    return caches, block_tables, seq_lens, q, gate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 4],
                        help="0: the kernel's default (FP8_CACHE_STAGES over an FP8 cache, else Triton's)")
    parser.add_argument("--splits", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--out", default="bench_decode_attention_kv.json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    scale = HEAD_DIM ** -0.5
    rows = []
    for batch, context in itertools.product(args.batch, args.context):
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            caches, block_tables, seq_lens, q, gate = make_case(batch, context, cache_dtype, dev)
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * caches[0][0].element_size()
            default = paged_decode_attention(q, *caches[0], block_tables, seq_lens, scale, gate=gate).float()
            for block_n, warps, stages, splits in itertools.product(args.block_n, args.warps, args.stages, args.splits):
                options = dict(block_n=block_n, num_warps=warps, splits=splits, num_stages=stages or None)
                try:
                    out = paged_decode_attention(q, *caches[0], block_tables, seq_lens, scale, gate=gate, **options)
                    diff = (out.float() - default).abs().max().item()
                    us = time_graph(lambda layer: paged_decode_attention(  # noqa: B023 (timed in this iteration)
                        q, *caches[layer], block_tables, seq_lens, scale, gate=gate, **options), LAYERS)
                except Exception as e:  # noqa: BLE001 (a variant that does not compile is reported)
                    rows.append(dict(batch=batch, context=context, cache=str(cache_dtype), **options,
                                     error=str(e)[:300]))
                    print(rows[-1], flush=True)
                    continue
                rows.append(dict(batch=batch, context=context, cache=str(cache_dtype), **options, us=round(us, 2),
                                 kv_bytes=kv_bytes, tb_per_s=round(kv_bytes / us / 1e6, 3), max_diff_to_default=diff))
                print(rows[-1], flush=True)
            del caches
            torch.cuda.empty_cache()
    best = {}
    for row in rows:
        if "us" in row:
            key = (row["batch"], row["context"], row["cache"])
            if key not in best or row["us"] < best[key]["us"]:
                best[key] = row
    for row in best.values():
        print("best", row)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
                                          "layers": LAYERS, "rows": rows, "best": list(best.values())}, indent=1))


if __name__ == "__main__":
    main()

"""MTP verification attention (Q = K + 1 queries per request, causal inside the Q) against
one-token decode attention at the same context, timed on one GPU.

Times `paged_verify_attention` and `paged_decode_attention` of whichever lamina is first on the
path, at Qwen3.5-35B-A3B's attention shape (16 query heads, 2 KV heads, head dim 256, output gate,
16-token pages in shuffled order) over a bf16 and an FP8 cache, as a CUDA graph of LAYERS calls
each over its own cache (as the model's 10 attention layers read theirs: nothing stays in L2).
Run it from an earlier tree too (`cd .baseline && python ../benchmarks/bench_verify_attention.py
--label base`) to compare kernels in one device call. Reports microseconds a call per
(batch, context, queries, cache) and the KV bytes a call reads.

    python benchmarks/bench_verify_attention.py --label new --out bench_verify_attention_new.json   # ~1 min
    python benchmarks/bench_verify_attention.py --queries 2 4 --block-n 32 64 --stages 1 2 3 --out sweep.json

`--block-n` / `--stages` time this tree's kernel at those launch parameters (0: its default);
`--q-heads` sets the query heads (over the 2 KV heads: 32 is 16 query heads a KV head).

    python benchmarks/bench_verify_attention.py --q-heads 32 --queries 1 3 4 --context 4096 16384
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))  # the tree the command runs in (its lamina), before this script's own

from lamina.kernels.triton_decode import paged_decode_attention  # noqa: E402
from lamina.kernels.triton_verify import paged_verify_attention  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))
from bench_decode_attention_kv import HEAD_DIM, HEADS, KV_HEADS, LAYERS, make_case  # noqa: E402 (this script's folder)
from graph_timing import time_graph  # noqa: E402

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 2, 4], help="1: the one-token decode kernel")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--block-n", type=int, nargs="+", default=[0],
                        help="keys a loop iteration (0: the kernel's default); other values need this tree's kernel")
    parser.add_argument("--stages", type=int, nargs="+", default=[0],
                        help="software-pipeline stages (0: the kernel's default); other values need this tree's kernel")
    parser.add_argument("--q-heads", type=int, default=HEADS,
                        help=f"query heads (over {KV_HEADS} KV heads; default {HEADS}, the 35B model's)")
    parser.add_argument("--out", default="bench_verify_attention.json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    scale = HEAD_DIM ** -0.5
    rows = []
    for batch, context, queries in itertools.product(args.batch, args.context, args.queries):
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            caches, block_tables, seq_lens, q, gate = make_case(batch, context, cache_dtype, dev, queries)
            if args.q_heads != HEADS:  # other queries and gates, the same caches
                gen = torch.Generator(device=dev).manual_seed(1)
                q, gate = (torch.randn(batch * queries, args.q_heads, HEAD_DIM, device=dev, generator=gen)
                           .to(torch.bfloat16) for _ in range(2))
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * caches[0][0].element_size()
            for block_n, stages in itertools.product(args.block_n, args.stages):
                options = {k: v for k, v in (("block_n", block_n), ("num_stages", stages)) if v}
                if options:  # this tree's kernel, Q rows a program (session 40)
                    def call(layer):  # noqa: B023 (timed in this iteration)
                        return paged_decode_attention(q, *caches[layer], block_tables, seq_lens, scale, gate=gate,
                                                      queries=queries, **options)
                elif queries == 1:
                    def call(layer):  # noqa: B023
                        return paged_decode_attention(q, *caches[layer], block_tables, seq_lens, scale, gate=gate)
                else:
                    def call(layer):  # noqa: B023
                        return paged_verify_attention(q, *caches[layer], block_tables, seq_lens, scale, queries, gate=gate)
                case = dict(label=args.label, q_heads=args.q_heads, kv_heads=KV_HEADS, batch=batch, context=context,
                            queries=queries, cache=str(cache_dtype),
                            block_n=block_n, stages=stages)
                try:
                    call(0)
                    us = time_graph(call, LAYERS)
                except Exception as e:  # noqa: BLE001 (a case that does not run is reported)
                    rows.append(dict(case, error=str(e)[:300]))
                else:
                    rows.append(dict(case, us=round(us, 2), kv_bytes=kv_bytes, tb_per_s=round(kv_bytes / us / 1e6, 3)))
                print(rows[-1], flush=True)
                # rewritten after every case: a run cut by its time limit keeps the cases it timed
                Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "label": args.label,
                                                      "gpu": torch.cuda.get_device_name(), "layers": LAYERS,
                                                      "rows": rows}, indent=1))
            del caches
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Attention of prefill and mixed steps at the Qwen3.5-35B-A3B attention shape (16 query heads, 2 KV
heads, head dim 256, 16-token pages, bf16) on one GPU: lamina's two paths, each timed at its first
call (a backend that builds a plan per shape pays it there) and at a repeat, in the same run:

- `sdpa`: `paged_attention` per request group (as the attention layer calls it on the Triton set:
  fresh-prompt groups on the causal rule, decode groups on the decode kernel, the rest masked);
- `triton`: `triton_prefill_attention.paged_prefill_attention`, the whole flat step in one launch;
- `lamina`: `paged_attention(varlen=True)`, the attention layer's default: groups as `sdpa`, but
  chunks that continue cached context on the varlen kernel instead of the masked call.

Steps: one fresh 8k prompt; a 4k chunk continuing 4k of cached context; a concurrency-64 mixed step
(56 decodes at ~1.1k context and 8 fresh 1k prompts); the same with one prompt continued instead.

    python benchmarks/bench_varlen_attention.py --out bench_varlen_attention.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench_sdpa_shapes import call_ms  # a sibling script: one call, synchronised, in ms
from lamina.kernels import request_groups as rg
from lamina.kernels.paged_attention import paged_attention
from lamina.kernels.triton_prefill_attention import paged_prefill_attention

HQ, HKV, DIM, PAGE = 16, 2, 256, 16
STEPS = {
    "fresh_8k": [(0, 8192)],
    "continued_4k_over_4k": [(4096, 4096)],
    "c64_mixed": [(1024 + 40 + i, 1) for i in range(56)] + [(0, 1024)] * 8,
    "c64_mixed_continued": [(1024 + 40 + i, 1) for i in range(56)] + [(0, 1024)] * 7 + [(512, 512)],
}


def step_inputs(reqs, gen):
    pages = [-(-(c + n) // PAGE) for c, n in reqs]
    width = max(pages)
    k_cache = torch.randn(sum(pages) + 1, PAGE, HKV, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    starts = [1 + sum(pages[:i]) for i in range(len(reqs))]
    block_tables = torch.tensor([[s + j if j < n else 0 for j in range(width)] for s, n in zip(starts, pages)],
                                dtype=torch.int32, device="cuda")
    q_lens = [n for _, n in reqs]
    seq = [c + n for c, n in reqs]
    qsl = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(reqs))], device="cuda")
    q = torch.randn(sum(q_lens), HQ, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate = torch.randn_like(q)
    plan = rg.plan_groups(q_lens, seq)
    groups = rg.build_groups(plan, q_lens, seq, "cuda") if plan is not None else None
    fresh = all(c == 0 for c, _ in reqs)
    return dict(q=q, gate=gate, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                seq_lens=torch.tensor(seq, device="cuda"), qsl=qsl, max_q=max(q_lens), max_s=max(seq),
                groups=groups, fresh=fresh)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    records = []
    for name, reqs in STEPS.items():
        x = step_inputs(reqs, gen)

        def sdpa():
            return paged_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["qsl"],
                                   x["max_q"], x["max_s"], DIM**-0.5, groups=x["groups"], causal_from_start=x["fresh"],
                                   fast_groups=True, gate=x["gate"])

        def triton_varlen():
            return paged_prefill_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"],
                                           x["qsl"], x["max_q"], DIM**-0.5, gate=x["gate"])

        def hybrid():
            return paged_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["qsl"],
                                   x["max_q"], x["max_s"], DIM**-0.5, groups=x["groups"], causal_from_start=x["fresh"],
                                   fast_groups=True, gate=x["gate"], varlen=True)

        row = {"step": name, "tokens": int(x["q"].shape[0]), "requests": len(reqs),
               "groups": 0 if x["groups"] is None else len(x["groups"])}
        for label, fn in (("sdpa", sdpa), ("triton", triton_varlen), ("lamina", hybrid)):
            row[f"{label}_first_ms"] = call_ms(fn)
            row[f"{label}_ms"] = min(call_ms(fn) for _ in range(5))
        diff = (sdpa().float() - triton_varlen().float()).abs().max().item()
        row["max_abs_diff"] = diff
        row["lamina_max_abs_diff"] = (sdpa().float() - hybrid().float()).abs().max().item()
        records.append(row)
        print(f"{name:22s} {row['tokens']:6d} tok, {row['groups']} groups: sdpa first {row['sdpa_first_ms']:8.1f} "
              f"then {row['sdpa_ms']:7.2f} ms | triton first {row['triton_first_ms']:8.1f} then {row['triton_ms']:7.2f} ms"
              f" | lamina first {row['lamina_first_ms']:8.1f} then {row['lamina_ms']:7.2f} ms | max diff {diff:.3g}")
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "command": "python benchmarks/bench_varlen_attention.py",
                                              "records": records}, indent=2))


if __name__ == "__main__":
    main()

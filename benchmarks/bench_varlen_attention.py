"""Attention of prefill and mixed steps at the Qwen3.5-35B-A3B attention shape (16 query heads, 2 KV
heads, head dim 256, 16-token pages, bf16) on one GPU: lamina's two paths, each timed at its first
call (a backend that builds a plan per shape pays it there) and at a repeat, in the same run:

- `sdpa`: `paged_attention` per request group (as the attention layer calls it on the Triton set:
  fresh-prompt groups on the causal rule, decode groups on the decode kernel, the rest masked);
- `triton`: `triton_prefill_attention.paged_prefill_attention`, the whole flat step in one launch,
  its query blocks launched longest first (the default since session 28); `triton_first_block_first`:
  the same launch in the order before (each head's blocks from the first; bitwise the same output);
- `lamina`: `paged_attention(varlen=True, fresh_varlen=True)` on groups planned by kind
  (`plan_groups(by_kind=True, fresh_with_continued=True)`), the attention layer's default since
  session 28: decodes on the decode kernel, every prompt chunk on the varlen kernel;
- `lamina_fresh_on_sdpa`: the plan before (`LAMINA_FRESH_PROMPT_ATTENTION=sdpa`; the `lamina` column
  of earlier results): fresh prompts on the causal rule, grouped by length.

Steps: one fresh 8k prompt; a 4k chunk continuing 4k of cached context; a concurrency-64 mixed step
(56 decodes at ~1.1k context and 8 fresh 1k prompts); the same with one prompt continued instead.

    python benchmarks/bench_varlen_attention.py --out bench_varlen_attention.json
    python benchmarks/bench_varlen_attention.py --sweep --out bench_varlen_tiles.json   # the varlen kernel's tiles

`--sweep` times the varlen kernel over (BLOCK_M, BLOCK_N, warps, stages) on the fresh 8k prompt and
the continued 4k chunk instead (FLOP rate against the causal work; best first).
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
    "fresh_8x1k": [(0, 1024)] * 8,
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
    kinds = rg.plan_groups(q_lens, seq, by_kind=True, fresh_with_continued=True)  # the attention layer's plan
    kind_groups = rg.build_groups(kinds, q_lens, seq, "cuda") if kinds is not None else None
    sdpa_kinds = rg.plan_groups(q_lens, seq, by_kind=True)  # with LAMINA_FRESH_PROMPT_ATTENTION=sdpa
    sdpa_kind_groups = rg.build_groups(sdpa_kinds, q_lens, seq, "cuda") if sdpa_kinds is not None else None
    return dict(kind_groups=kind_groups, sdpa_kind_groups=sdpa_kind_groups, q=q, gate=gate, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                seq_lens=torch.tensor(seq, device="cuda"), qsl=qsl, max_q=max(q_lens), max_s=max(seq),
                groups=groups, fresh=fresh)


def causal_flop(reqs) -> float:
    """Multiply-adds x 2 of QK^T and PV over the causal pairs of a step, all query heads."""
    pairs = sum(n * c + n * (n + 1) / 2 for c, n in reqs)
    return 2 * 2 * pairs * DIM * HQ


def sweep(gen, out: str | None) -> list[dict]:
    records = []
    for name in ("continued_4k_over_4k", "fresh_8k"):
        x = step_inputs(STEPS[name], gen)
        ref = None
        for block_m in (64, 128):
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (1, 2, 3):
                        tile = (block_m, block_n, warps, stages)

                        def fn():
                            return paged_prefill_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"],
                                                           x["seq_lens"], x["qsl"], x["max_q"], DIM**-0.5,
                                                           gate=x["gate"], tile=tile)
                        row = {"step": name, "tile": list(tile)}
                        try:
                            result = fn()
                            ref = result if ref is None else ref
                            row["ms"] = min(call_ms(fn) for _ in range(5))
                            row["tflop_s"] = causal_flop(STEPS[name]) / row["ms"] / 1e9
                            row["max_abs_diff"] = (result.float() - ref.float()).abs().max().item()
                        except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
                            row["error"] = str(e)[:160]
                        records.append(row)
                        if out:  # after every tile: a run cut short keeps what it measured
                            Path(out).write_text(json.dumps({
                                "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "command": "python benchmarks/bench_varlen_attention.py --sweep", "records": records},
                                indent=2))
        timed = sorted((r for r in records if r["step"] == name and "ms" in r), key=lambda r: r["ms"])
        for r in timed[:6]:
            print(f"{name:22s} tile {r['tile']}: {r['ms']:7.2f} ms, {r['tflop_s']:6.1f} TFLOP/s, diff {r['max_abs_diff']:.3g}")
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="the varlen kernel's tiles instead of the three paths")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.sweep:
        sweep(gen, args.out)
        return
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

        def triton_first_block_first():
            return paged_prefill_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"],
                                           x["qsl"], x["max_q"], DIM**-0.5, gate=x["gate"], longest_first=False)

        def hybrid():
            return paged_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["qsl"],
                                   x["max_q"], x["max_s"], DIM**-0.5, groups=x["kind_groups"],
                                   causal_from_start=x["fresh"], fast_groups=True, gate=x["gate"], varlen=True,
                                   fresh_varlen=True)

        def hybrid_fresh_on_sdpa():
            return paged_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["qsl"],
                                   x["max_q"], x["max_s"], DIM**-0.5, groups=x["sdpa_kind_groups"],
                                   causal_from_start=x["fresh"], fast_groups=True, gate=x["gate"], varlen=True)

        row = {"step": name, "tokens": int(x["q"].shape[0]), "requests": len(reqs),
               "groups": 0 if x["groups"] is None else len(x["groups"])}
        for label, fn in (("sdpa", sdpa), ("triton", triton_varlen), ("triton_first_block_first", triton_first_block_first),
                          ("lamina", hybrid), ("lamina_fresh_on_sdpa", hybrid_fresh_on_sdpa)):
            row[f"{label}_first_ms"] = call_ms(fn)
            row[f"{label}_ms"] = min(call_ms(fn) for _ in range(5))
        diff = (sdpa().float() - triton_varlen().float()).abs().max().item()
        row["max_abs_diff"] = diff
        row["lamina_max_abs_diff"] = (sdpa().float() - hybrid().float()).abs().max().item()
        row["orders_equal"] = bool(torch.equal(triton_varlen(), triton_first_block_first()))
        records.append(row)
        print(f"{name:22s} {row['tokens']:6d} tok, {row['groups']} groups: sdpa first {row['sdpa_first_ms']:8.1f} "
              f"then {row['sdpa_ms']:7.2f} ms | triton first {row['triton_first_ms']:8.1f} then {row['triton_ms']:7.2f} ms"
              f" | first block first {row['triton_first_block_first_ms']:7.2f} ms (equal {row['orders_equal']})"
              f" | lamina first {row['lamina_first_ms']:8.1f} then {row['lamina_ms']:7.2f} ms"
              f" (fresh on sdpa {row['lamina_fresh_on_sdpa_ms']:7.2f} ms) | max diff {diff:.3g}")
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "command": "python benchmarks/bench_varlen_attention.py",
                                              "records": records}, indent=2))


if __name__ == "__main__":
    main()

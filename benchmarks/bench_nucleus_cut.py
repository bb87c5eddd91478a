"""Top-p without top-k, or with a top-k wider than the 128 window: the vocabulary sort (`sorted_cut`,
what the sampler runs for these rows by default) against the search cut
(`lamina.kernels.triton_window_cut.nucleus_cut_triton`: a fixed-width `topk`, a search for the k-th
largest logit by count when there is a top-k, one read of the row for the kept set's normaliser, and
a search by mass only when the window holds less than top-p of it), at the 248k vocabulary of
Qwen3.5, on one GPU. `--top-ks 0 1000`: top-p alone, then top-k 1000 with the same top-p.

Logits are Gaussian with a scale per case: "peaked" (scale 8: the 128 largest hold ~all the mass,
as a trained model's next-token distribution mostly does) and "flat" (scale 2: they hold ~10%, every
row bisects: the worst case). Milliseconds a call (CUDA events, median of 20 after 3), and whether
the kept sets equal the sort's; also each (window width, logits a loop step, search points a step,
warps) variant and
`topk`'s time at each width.

    python benchmarks/bench_nucleus_cut.py --out bench_nucleus_cut.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.triton_window_cut import nucleus_cut_triton  # noqa: E402
from lamina.worker.top_k_top_p import TOP_K_WINDOW, sorted_cut  # noqa: E402


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-ks", type=int, nargs="+", default=[0], help="0: no top-k (top-p alone)")
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 8192])
    parser.add_argument("--sections", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", default="bench_nucleus_cut.json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = []
    for (case, scale), k, batch in itertools.product((("peaked", 8.0), ("flat", 2.0)), args.top_ks, args.batch):
        gen = torch.Generator(device=dev).manual_seed(batch)
        logits = torch.randn(batch, args.vocab, device=dev, generator=gen) * scale  # [B, V]
        top_p = torch.full((batch,), args.top_p, device=dev)
        # as the sampler passes them: the vocabulary where a row has no top-k
        top_k = torch.full((batch,), k or args.vocab, device=dev, dtype=torch.int64)
        want = logits >= sorted_cut(logits, top_k, top_p)
        got = logits >= nucleus_cut_triton(logits, top_p, TOP_K_WINDOW, top_k=top_k)
        kept = logits.masked_fill(~want, float("-inf"))  # [B, V]
        # rows whose top-k's window holds less than top-p of the kept mass: they search by mass
        window_mass = logits.masked_fill(logits < logits.topk(k or args.vocab).values[:, -1:], float("-inf")
                                         ).softmax(-1).topk(TOP_K_WINDOW, dim=-1).values.sum(-1)  # [B]
        row = dict(case=case, batch=batch, vocab=args.vocab, top_p=args.top_p, top_k=k,
                   kept_tokens=int(torch.isfinite(kept).sum(1).median()),
                   sort_ms=round(time_ms(lambda: sorted_cut(logits, top_k, top_p)), 4),  # noqa: B023
                   nucleus_ms=round(time_ms(
                       lambda: nucleus_cut_triton(logits, top_p, TOP_K_WINDOW, top_k=top_k)), 4),  # noqa: B023
                   same_sets=bool(torch.equal(got, want)), rows_bisected=int((window_mass < args.top_p).sum()))
        for width in args.widths:
            row[f"topk{width}_ms"] = round(time_ms(lambda: logits.topk(width, dim=-1)), 4)  # noqa: B023
        variants = {}
        for width, block, sections, warps in itertools.product(args.widths, args.blocks, args.sections, args.warps):
            if block * sections > 32768 or width >= (k or args.vocab):  # past the registers; k inside the window
                continue

            def call():
                return nucleus_cut_triton(logits, top_p, width, top_k=top_k, block=block,  # noqa: B023
                                          sections=sections, num_warps=warps)  # noqa: B023
            same = bool(torch.equal(logits >= call(), want))
            variants[f"w{width}_b{block}_s{sections}_nw{warps}"] = (round(time_ms(call), 4), same)
        row["variants"] = variants
        rows.append(row)
        fastest = min((v for v in variants.items() if v[1][1]), key=lambda v: v[1][0], default=None)
        print({k: v for k, v in row.items() if k != "variants"}, "fastest:", fastest,
              "not the sort's set:", [k for k, v in variants.items() if not v[1]], flush=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

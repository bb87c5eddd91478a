"""Where the search cut and the vocabulary sort disagree on a flat row's top-p set, which of them the
exact arithmetic agrees with: for each row, the tokens each keeps and the float64 probability mass
before each one's last kept token (top-p keeps a token while the mass before it is below top_p).
Flat rows (Gaussian logits, scale 2) at Qwen3.5's 248k vocabulary keep ~89k tokens whose boundary
token holds ~3e-7 of the mass, the size of the float32 softmax's rounding in the sort.

    TRITON_INTERPRET=1 python benchmarks/check_nucleus_boundary.py --device cpu --batch 6   # ~15 s
    python benchmarks/check_nucleus_boundary.py --device cuda --batch 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.triton_window_cut import nucleus_cut_triton  # noqa: E402
from lamina.worker.top_k_top_p import TOP_K_WINDOW, sorted_cut  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=16)
    args = parser.parse_args()
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    logits = torch.randn(args.batch, args.vocab, device=dev, generator=gen) * 2.0  # [B, V] flat rows
    top_p = torch.full((args.batch,), args.top_p, device=dev)
    top_k = torch.full((args.batch,), args.vocab, device=dev, dtype=torch.int64)
    cuts = {"sort": sorted_cut(logits, top_k, top_p), "search": nucleus_cut_triton(logits, top_p, TOP_K_WINDOW, top_k=top_k)}
    for row in range(args.batch):
        probs = torch.softmax(logits[row].double(), -1).sort(descending=True).values  # [V] float64
        before = probs.cumsum(0) - probs  # [V]: the mass before each position
        line = []
        for name, cut in cuts.items():
            kept = int((logits[row] >= cut[row]).sum())
            exact = bool(before[kept - 1] < args.top_p and (kept == args.vocab or before[kept] >= args.top_p))
            line.append(f"{name} keeps {kept} (mass before its last {before[kept - 1].item():.9f}, exact: {exact})")
        print(f"row {row}: " + "; ".join(line))


if __name__ == "__main__":
    main()

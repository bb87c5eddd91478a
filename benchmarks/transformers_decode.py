"""transformers' `generate` on the Qwen3.5-35B-A3B text shape (random bf16 weights, its own init):
the baseline `lamina bench latency` is compared with, measured in the same run
(`lamina bench latency --compare transformers` does the same inside one process).

    python benchmarks/transformers_decode.py --batch 1 --layers 40 --out transformers_b1.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.entrypoints.bench import transformers_decode  # noqa: E402
from lamina.entrypoints.presets import preset_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = preset_dir("qwen3.5-35b-a3b", args.layers)
    record = transformers_decode(str(path), args.batch, args.input_len, args.output_len, torch.device("cuda"), torch.bfloat16)
    record.update(batch_size=args.batch, layers=args.layers, input_len=args.input_len, output_len=args.output_len,
                  command=" ".join(["python", *sys.argv]))
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

"""transformers' `generate` on the Qwen3.5-35B-A3B text shape (random bf16 weights, its own init):
the baseline `lamina bench latency` is compared with, measured in the same run.

    python benchmarks/transformers_decode.py --batch 1 --layers 40 --out transformers_b1.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.entrypoints.bench import _preset_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import transformers

    path = _preset_dir("qwen3.5-35b-a3b", args.layers)
    config = transformers.AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3_5MoeForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 200000, (args.batch, args.input_len), device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    tpot = (total - prefill) / (args.output_len - 1)
    record = {"engine": f"transformers {transformers.__version__}", "batch_size": args.batch, "layers": args.layers,
              "input_len": args.input_len, "output_len": args.output_len, "tpot_ms": tpot * 1e3,
              "output_tok_per_s": args.batch / tpot, "command": " ".join(["python", *sys.argv])}
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

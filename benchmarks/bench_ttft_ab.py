"""TTFT of prompt steps under two settings of one layer attribute, alternating in one process.

    python benchmarks/bench_ttft_ab.py --attr fresh_prompt_varlen --values True,False \
        --batch-size 1,8 --input-len 8192,1024 --rounds 8 --out ttft_ab.json

Comparing two settings with `lamina bench latency` takes a process (and a model load, plus any
first-use compiles) per sample, so a device call holds only a few samples of each, and the spread
between processes (1.5-2 ms of a 140 ms TTFT on an H100) hides gains of a few ms. Here the model is
loaded and warmed once; the attribute (read by the layers in each forward, e.g. the attention
layers' `fresh_prompt_varlen`) is set on every module that has it before each round, and rounds
alternate between the values (A B B A A B ...), so drift of the machine falls on both. Prefill steps
run eagerly, so nothing captured holds the old value; decode graphs are not used (one token a
request).

Each round adds `batch` fresh random prompts of `input_len` tokens (never a prefix-cache hit) with
one greedy token each and steps the engine until they are done: the TTFT of the slowest request,
as `lamina bench latency` measures it. Writes every round's TTFT and each setting's median and
min per shape.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def set_attr(model, name: str, value) -> int:
    """Set `name` on every module of `model` that has it; how many there were."""
    count = 0
    for module in model.modules():
        if hasattr(module, name):
            setattr(module, name, value)
            count += 1
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attr", required=True, help="module attribute to switch, e.g. fresh_prompt_varlen")
    ap.add_argument("--values", required=True, help="two Python literals, comma-separated, e.g. True,False")
    ap.add_argument("--batch-size", default="1", help="comma-separated, paired with --input-len")
    ap.add_argument("--input-len", default="8192", help="comma-separated, paired with --batch-size")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of each value per shape")
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from lamina import LLM, SamplingParams
    from lamina.entrypoints.presets import preset_dir, preset_label

    values = [ast.literal_eval(v) for v in args.values.split(",")]
    batches = [int(b) for b in args.batch_size.split(",")]
    lengths = [int(n) for n in args.input_len.split(",")]
    if len(values) != 2 or len(batches) != len(lengths):
        raise SystemExit("--values takes two literals; --batch-size and --input-len pair up one to one")
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    records = []
    with LLM(str(preset_dir(args.preset, args.num_layers)), dtype=args.dtype, load_format="dummy",
             max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(batches),
             max_model_len=max(lengths) + 16, show_progress=False) as llm:
        engine = llm.engine
        model = engine.executor.runner.model
        vocab = engine.model_config.vocab_size

        def ttft_ms(batch: int, input_len: int) -> float:
            for _ in range(batch):
                prompt = [rng.randrange(0, min(vocab, 200_000)) for _ in range(input_len)]
                engine.add_request({"prompt_token_ids": prompt}, params)
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            return (time.perf_counter() - start) * 1e3

        for batch, input_len in zip(batches, lengths):
            samples = {repr(v): [] for v in values}
            for value in values:  # warm each setting at this shape (first-use compiles), not timed
                if set_attr(model, args.attr, value) == 0:
                    raise SystemExit(f"no module of the model has an attribute {args.attr!r}")
                ttft_ms(batch, input_len)
            for r in range(args.rounds):
                order = values if r % 2 == 0 else values[::-1]  # A B, B A, A B, ...
                for value in order:
                    set_attr(model, args.attr, value)
                    samples[repr(value)].append(round(ttft_ms(batch, input_len), 3))
            summary = {v: {"median_ms": statistics.median(s), "min_ms": min(s)} for v, s in samples.items()}
            print(f"batch {batch} x {input_len}: " + ", ".join(
                f"{args.attr}={v}: median {m['median_ms']:.2f} min {m['min_ms']:.2f} ms" for v, m in summary.items()),
                flush=True)
            records.append({"batch_size": batch, "input_len": input_len, "ttft_ms": samples, "summary": summary})
    if args.out:
        import torch

        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/bench_ttft_ab.py " + " ".join(sys.argv[1:]),
                       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "model": preset_label(args.preset, args.num_layers), "dtype": args.dtype,
                       "attr": args.attr, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()

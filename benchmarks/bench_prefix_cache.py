"""TTFT with prefix caching: a new prompt, the same prompt again, and a conversation's next turn
(the prompt plus `--turn-len` new tokens), against the same engine with its prefix cache switched
off, in one process, rounds alternating.

    python benchmarks/bench_prefix_cache.py --input-len 2048,8192 --rounds 4 --out prefix_cache.json

One engine (`enable_prefix_caching=True`, the preset's dummy weights) is loaded and warmed once. For
the "off" samples every entry is dropped (`reset_prefix_cache`) and the cache manager's prefix cache
is detached, so those prompts run exactly as with `enable_prefix_caching` off (no chunk cut at a
block boundary, nothing kept, nothing looked up); it is attached again for the "on" samples. Each
sample is one request of `max_tokens=1`, stepped alone until done: its TTFT.
- off_new / on_new: a fresh random prompt (on: all but its last token in one step, kept, then the
  last token in a one-token step);
- on_same: the on_new prompt again (starts from the kept prefix: one token, a decode graph's step);
- on_turn: the on_new prompt plus `turn_len` new tokens (starts from the same prefix);
- off_turn: the same kind of prompt with the cache off (computed in full).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input-len", default="2048,8192", help="comma-separated prompt lengths")
    ap.add_argument("--turn-len", type=int, default=256, help="new tokens of the next turn")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from lamina import LLM, SamplingParams
    from lamina.entrypoints.presets import preset_dir, preset_label

    lengths = [int(n) for n in args.input_len.split(",")]
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    records = []
    with LLM(str(preset_dir(args.preset, args.num_layers)), dtype=args.dtype, load_format="dummy",
             max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=8, enable_prefix_caching=True,
             max_model_len=max(lengths) + args.turn_len + 16, show_progress=False) as llm:
        engine = llm.engine
        cache = engine.cache
        prefix = cache.prefix
        vocab = min(engine.model_config.vocab_size, 200_000)

        def ttft_ms(prompt: list[int]) -> tuple[float, int]:
            rid = engine.add_request({"prompt_token_ids": prompt}, params)
            start = time.perf_counter()
            cached = 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid:
                        cached = out.num_cached_tokens
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1e3, cached

        def switch(on: bool) -> None:
            engine.reset_prefix_cache()
            cache.prefix = prefix if on else None

        def fresh(n: int) -> list[int]:
            return [rng.randrange(0, vocab) for _ in range(n)]

        for input_len in lengths:
            samples: dict[str, list[float]] = {k: [] for k in ("off_new", "off_turn", "on_new", "on_same", "on_turn")}
            cached_tokens: dict[str, int] = {}
            for r in range(args.rounds + 1):  # round 0 warms both settings at this shape (not kept)
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    switch(on)
                    prompt = fresh(input_len)
                    runs = ({"on_new": prompt, "on_same": prompt, "on_turn": prompt + fresh(args.turn_len)} if on else
                            {"off_new": prompt, "off_turn": fresh(input_len + args.turn_len)})
                    for name, p in runs.items():
                        ms, cached = ttft_ms(p)
                        if r > 0:
                            samples[name].append(round(ms, 3))
                            cached_tokens[name] = cached
            summary = {k: {"median_ms": statistics.median(v), "min_ms": min(v), "cached_tokens": cached_tokens[k]}
                       for k, v in samples.items()}
            print(f"input {input_len} (+{args.turn_len}): " + ", ".join(
                f"{k} {m['median_ms']:.2f} ms ({m['cached_tokens']} cached)" for k, m in summary.items()), flush=True)
            records.append({"input_len": input_len, "turn_len": args.turn_len, "ttft_ms": samples, "summary": summary})
        switch(True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/bench_prefix_cache.py " + " ".join(sys.argv[1:]),
                       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "model": preset_label(args.preset, args.num_layers), "dtype": args.dtype,
                       "max_num_batched_tokens": args.max_num_batched_tokens, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()

"""One step that mixes many decoding requests with a long prompt chunk (continuous batching's
everyday case), with request groups on and off (`LAMINA_REQUEST_GROUPS`, lamina.kernels.request_groups).

    python benchmarks/bench_mixed_step.py --groups 1 --out grouped.json     # GPU
    python benchmarks/bench_mixed_step.py --groups 0 --out one_call.json    # the padded kernels in one call
    python benchmarks/bench_mixed_step.py --device cpu --tiny --groups 1    # a quick CPU smoke run

Run each setting in its own process (a run without groups may exhaust GPU memory). Reports the
mixed step's time and peak memory, and the greedy tokens of every request (to compare the runs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_mtp import REAL, TINY, write_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", choices=["0", "1"], required=True)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--decoders", type=int, default=128)
    parser.add_argument("--long-prompt", type=int, default=8000)
    args = parser.parse_args()
    os.environ["LAMINA_REQUEST_GROUPS"] = args.groups
    from lamina import LLM, SamplingParams

    shape = TINY if args.tiny else REAL
    path = write_config(Path(tempfile.mkdtemp()) / "cfg", shape, args.layers, max_positions=args.long_prompt + 256)
    cuda = args.device == "cuda"
    llm = LLM(str(path), device=args.device, dtype="bfloat16" if cuda else "float32", load_format="dummy",
              max_model_len=args.long_prompt + 256, max_num_seqs=args.decoders + 1,
              max_num_batched_tokens=args.long_prompt + args.decoders, show_progress=False)
    engine = llm.engine
    rng = random.Random(0)
    vocab = shape["vocab_size"] - 1
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": [rng.randrange(vocab) for _ in range(64)]}, params)
           for _ in range(args.decoders)]
    for _ in range(3):  # their prompts, then two decode steps
        engine.step()
    ids.append(engine.add_request({"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.long_prompt)]},
                                  params))
    result = {"groups": args.groups == "1", "device": args.device, "decoders": args.decoders,
              "long_prompt": args.long_prompt, "config": ("tiny" if args.tiny else "Qwen3.5-35B-A3B shape")
              + f", {args.layers} layers", "command": " ".join(sys.argv),
              "gpu": torch.cuda.get_device_name() if cuda else None, "gpus": 1 if cuda else 0}
    if cuda:
        torch.cuda.synchronize()
        result["allocated_before_gib"] = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    outputs: dict[str, list[int]] = {}
    try:
        t0 = time.perf_counter()
        outs = engine.step()  # the mixed step: every decoder plus the whole long prompt
        if cuda:
            torch.cuda.synchronize()
        result["mixed_step_s"] = time.perf_counter() - t0
        result["mixed_step_tokens"] = list(engine.step_token_counts[-1])
        if cuda:
            result["mixed_step_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        while True:
            for o in outs:
                if o.finished:
                    outputs[o.request_id] = list(o.outputs[0].token_ids)
            if not engine.has_unfinished_requests():
                break
            outs = engine.step()
        result["tokens"] = [outputs[i] for i in ids]
    except torch.OutOfMemoryError as e:
        result["oom"] = str(e).splitlines()[0]
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    llm.shutdown()


if __name__ == "__main__":
    main()

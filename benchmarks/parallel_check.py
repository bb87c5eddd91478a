"""TP2 and PP2 over NCCL vs one GPU on a real-width seeded random checkpoint (Qwen3.5-35B-A3B shape).

    python benchmarks/parallel_check.py --out results/parallel_h200x2.json

Greedy tokens of each layout are compared with the single-GPU run: identical sequences are
counted, and every token of a differing sequence is checked with the near-tie rule against the
single-GPU model's logits teacher-forced on that sequence. Decode throughput is measured at batch 8.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_random_checkpoint import write_checkpoint  # noqa: E402

from lamina import LLM, SamplingParams  # noqa: E402

BATCH, PROMPT_LEN, NEW = 8, 64, 32
DTYPE = "bfloat16"


def prompts():
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(0, 240000) for _ in range(PROMPT_LEN + 7 * i)]} for i in range(BATCH)]


def run(path, **layout):
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    llm = LLM(str(path), device="cuda", dtype=DTYPE, max_model_len=1024, max_num_seqs=BATCH, show_progress=False, **layout)
    llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    engine = llm.engine
    for p in prompts():
        engine.add_request(p, params)
    outs, decode_time, decode_tokens = {}, 0.0, 0
    while engine.has_unfinished_requests():
        running_before, waiting_before = engine.num_running, engine.num_waiting
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step = engine.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if waiting_before == 0 and sum(engine.step_token_counts[-1]) == running_before:  # a pure decode step
            decode_time += dt
            decode_tokens += running_before
        for o in step:
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return llm, [outs[k] for k in sorted(outs, key=int)], decode_tokens / max(decode_time, 1e-9)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    global DTYPE
    tmp = Path(tempfile.mkdtemp())
    t0 = time.time()
    path = write_checkpoint(tmp / "ckpt", args.layers)
    result = {"gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "config": f"Qwen3.5-35B-A3B shape, {args.layers} layers, seeded random bf16", "batch": BATCH,
              "new_tokens": NEW, "checkpoint_write_s": time.time() - t0, "command": " ".join(sys.argv), "layouts": {}}
    from tests.reference import lamina_logits

    for DTYPE in args.dtypes.split(","):
        single, ref_out, tps = run(path)
        result["layouts"][f"single_gpu_{DTYPE}"] = {"decode_tok_s": tps}
        print("single", DTYPE, tps, flush=True)
        for name, layout in (("tp2", dict(tensor_parallel_size=2)), ("pp2", dict(pipeline_parallel_size=2))):
            single.shutdown()  # free the GPU for the layout; reload after for the teacher-forced check
            llm, out, tps = run(path, **layout)
            llm.shutdown()
            single, _, _ = run(path)
            identical = sum(a == b for a, b in zip(ref_out, out))
            worst, tokens_checked = 0.0, 0
            for p, a, b in zip(prompts(), ref_out, out):
                if a != b:
                    logits = lamina_logits(single, p["prompt_token_ids"] + b)
                    for j, t in enumerate(b):
                        row = logits[len(p["prompt_token_ids"]) + j - 1].float()
                        worst = max(worst, (row.max() - row[t]).item())
                        tokens_checked += 1
            result["layouts"][f"{name}_{DTYPE}"] = {
                "decode_tok_s": tps, "identical_to_single_gpu": identical == len(ref_out),
                "sequences_identical": identical, "sequences": len(ref_out),
                "worst_near_tie_gap": worst, "tokens_teacher_forced": tokens_checked}
            print(name, DTYPE, json.dumps(result["layouts"][f"{name}_{DTYPE}"]), flush=True)
        single.shutdown()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()

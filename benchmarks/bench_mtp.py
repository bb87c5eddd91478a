"""Added cost per decode step of MTP speculation with K = 1, 2, 3 draft tokens, vs K = 0, at
batch 1 and 64, on a real-width random config (Qwen3.5-35B-A3B shape, few layers + 1 MTP layer).

    python benchmarks/bench_mtp.py --out results/mtp_cost_h200.json            # GPU
    python benchmarks/bench_mtp.py --device cpu --tiny                          # a quick CPU smoke run

Weights are seeded random (`load_format="dummy"`), so drafts are mostly rejected: the figure is
the cost of proposing and verifying K drafts, not the speed-up a trained checkpoint would get.
The K > 0 runs use the engine's fixed-K policy.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina import LLM, SamplingParams  # noqa: E402

REAL = dict(
    vocab_size=248320, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
)
TINY = dict(
    vocab_size=1024, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
)


def write_config(path: Path, shape: dict, layers: int) -> Path:
    from transformers import Qwen3_5MoeTextConfig

    layer_types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)]
    config = Qwen3_5MoeTextConfig(num_hidden_layers=layers, layer_types=layer_types, max_position_embeddings=4096,
                                  eos_token_id=shape["vocab_size"] - 1, mtp_num_hidden_layers=1, **shape)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    config.save_pretrained(path)
    return path


def step_time(path: Path, device: str, k: int, batch: int, new_tokens: int, vocab: int) -> dict:
    spec = None if k == 0 else {"method": "mtp", "num_speculative_tokens": k}
    llm = LLM(str(path), device=device, dtype="bfloat16" if device == "cuda" else "float32", load_format="dummy",
              max_model_len=1024, max_num_seqs=batch, speculative_config=spec, show_progress=False)
    engine = llm.engine
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(0, vocab - 1) for _ in range(64)]} for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    for p in prompts:
        engine.add_request(p, params)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, emitted = [], 0
    while engine.has_unfinished_requests():
        waiting = engine.num_waiting
        sync()
        t0 = time.perf_counter()
        outs = engine.step()
        sync()
        if waiting == 0 and all(len(o.outputs[0].token_ids) > 1 for o in outs) and len(outs) == batch:
            times.append(time.perf_counter() - t0)
        emitted += len(outs)
    metrics = engine.spec_decode_metrics
    llm.shutdown()
    times.sort()
    median = times[len(times) // 2] if times else float("nan")
    result = {"k": k, "batch": batch, "median_step_ms": median * 1e3, "steps_timed": len(times)}
    if metrics is not None:
        result["spec_metrics"] = {k2: v for k2, v in vars(metrics).items() if isinstance(v, (int, float, list))}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    shape = TINY if args.tiny else REAL
    path = write_config(Path(tempfile.mkdtemp()) / "cfg", shape, args.layers)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        base = None
        for k in (0, 1, 2, 3):
            r = step_time(path, args.device, k, batch, args.new_tokens, shape["vocab_size"])
            base = r["median_step_ms"] if k == 0 else base
            r["added_ms_vs_k0"] = r["median_step_ms"] - base
            print(json.dumps(r), flush=True)
            rows.append(r)
    result = {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "config": ("tiny" if args.tiny else "Qwen3.5-35B-A3B shape") + f", {args.layers} layers + 1 MTP layer",
              "command": " ".join(sys.argv), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Decode throughput of lamina vs transformers on a real-width random config, plus a bf16-GPU vs
fp32-CPU greedy agreement check on a tiny checkpoint.

    python benchmarks/bench_decode.py --out results/decode_baseline.json

Needs a CUDA device. Weights are seeded random (lamina: load_format="dummy"; transformers:
its own init), so the text is meaningless; throughput is what is measured.
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

# Qwen3.5-35B-A3B text shape, 8 of its 40 layers (6 delta-net + 2 full attention).
REAL_WIDTH = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, max_position_embeddings=8192, rms_norm_eps=1e-6,
    eos_token_id=248044, tie_word_embeddings=False,
)


def write_config(path: Path) -> Path:
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(**REAL_WIDTH)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    config.save_pretrained(path)
    return path


def lamina_decode(path: Path, batch: int, prompt_len: int, new_tokens: int) -> dict:
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(0, 240000) for _ in range(prompt_len)]} for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=2048,
              max_num_seqs=max(batch, 1), show_progress=False)
    engine = llm.engine
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    for p in prompts:
        engine.add_request(p, params)
    decode_time = decode_tokens = 0.0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        plan_before = engine.scheduler.num_running
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if plan_before == batch and all(len(o.outputs[0].token_ids) > 1 for o in outs) and len(outs) == batch:
            decode_time += dt
            decode_tokens += len(outs)
    total = time.perf_counter() - start
    mem = torch.cuda.max_memory_allocated() / 2**30
    llm.shutdown()
    torch.cuda.empty_cache()
    return {"batch": batch, "decode_tok_s": decode_tokens / decode_time, "decode_steps": int(decode_tokens // batch),
            "total_s": total, "peak_mem_gib": mem}


def transformers_decode(path: Path, batch: int, prompt_len: int, new_tokens: int) -> dict:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig.from_pretrained(path)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5MoeForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 240000, (batch, prompt_len), device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, min_new_tokens=1)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return {"batch": batch, "decode_tok_s": batch * (new_tokens - 1) / (total - prefill), "total_s": total}


def bf16_agreement(tmp: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tiny_checkpoints import make_qwen3_next

    path = make_qwen3_next(tmp / "tiny")
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(0, 990) for _ in range(n)]} for n in (1, 6, 17, 31, 45, 58)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", show_progress=False) as cpu:
        cpu_out = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
        with LLM(str(path), device="cuda", dtype="bfloat16", show_progress=False) as gpu:
            gpu_out = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
        # near-tie rule with the CPU fp32 model as reference, teacher-forced on the GPU's tokens
        from tests.reference import lamina_logits

        worst_gap, exact, total = 0.0, 0, 0
        for p, toks in zip(prompts, gpu_out):
            seq = p["prompt_token_ids"] + toks
            logits = lamina_logits(cpu, seq)
            for j, t in enumerate(toks):
                row = logits[len(p["prompt_token_ids"]) + j - 1]
                worst_gap = max(worst_gap, (row.max() - row[t]).item())
                exact += int(row.argmax().item() == t)
                total += 1
    identical = sum(a == b for a, b in zip(cpu_out, gpu_out))
    return {"sequences_identical": identical, "sequences": len(prompts), "tokens_exact_argmax": exact,
            "tokens": total, "worst_logit_gap": worst_gap}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "config": "Qwen3.5-35B-A3B shape, 8 layers",
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "command": " ".join(sys.argv)}
    result["bf16_vs_cpu_fp32"] = bf16_agreement(tmp)
    print(json.dumps(result["bf16_vs_cpu_fp32"]), flush=True)
    path = write_config(tmp / "real")
    result["lamina"], result["transformers"] = [], []
    for batch in [int(b) for b in args.batches.split(",")]:
        r = lamina_decode(path, batch, args.prompt_len, args.new_tokens)
        print("lamina", json.dumps(r), flush=True)
        result["lamina"].append(r)
        if not args.skip_transformers:
            r = transformers_decode(path, batch, args.prompt_len, args.new_tokens)
            print("transformers", json.dumps(r), flush=True)
            result["transformers"].append(r)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

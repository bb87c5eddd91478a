"""Qwen4-Exp on one H200: a real-width config with few layers and a full-size PLE table (~95 GiB
in bf16) on the host or on the GPU, in bf16; plus bf16-GPU vs fp32-CPU agreement on a tiny
checkpoint (host and GPU tables).

    python benchmarks/qwen4_gpu_check.py --out results/qwen4_h200.json
    python benchmarks/qwen4_gpu_check.py --placement gpu --skip-tiny --out results/qwen4_gpu_table_h200.json

With the table on the GPU the decode steps replay CUDA graphs (QSA fixed-shape decode); with it on
the host they run eagerly (the PLE gather reads host memory). Filling a host table with dummy
values takes ~7 minutes, a GPU one seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina import LLM, SamplingParams  # noqa: E402

# Qwen3.8-Flash-Next widths (FIELD_NOTES): hidden 2560, 512 experts top-10, moe 640, hc 4,
# 3-gram PLE with 8 heads per order on layer id 2; PLE table: 20M-base prime vocabularies x
# 160 dims per head = ~95 GiB in bf16. 4 of the 48 layers (3 delta net + 1 indexed attention).
REAL = dict(
    vocab_size=248320, hidden_size=2560, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=640, shared_expert_intermediate_size=640,
    hc_count=4, hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=2560, ngram_size=3, heads_per_ngram=8,
    ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=512,
    ple_conv_kernel_size=4, indexer_n_heads=64, indexer_kv_heads=1, indexer_head_dim=128,
    indexer_budget=2048, indexer_compress_ratio=4, max_position_embeddings=8192, eos_token_id=248044,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)


def real_width(tmp: Path, placement: str) -> dict:
    from transformers import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(**REAL)
    config.architectures = ["Qwen4ExpForCausalLM"]
    config.save_pretrained(tmp / "real")
    t0 = time.time()
    llm = LLM(str(tmp / "real"), device="cuda", dtype="bfloat16", load_format="dummy", ple_table_device=placement,
              max_model_len=4096, max_num_seqs=16, show_progress=False)
    load_s = time.time() - t0
    model = llm.engine.executor.runner.model
    by_component: dict[str, int] = {}
    for name, param in model.named_parameters():
        key = ("ple_table(host)" if "ngram_embedding" in name else
               "experts" if ".w13" in name or ".w2" in name else
               "embedding/lm_head" if "embed" in name or "lm_head" in name else
               "attention/delta-net/hc/other")
        by_component[key] = by_component.get(key, 0) + param.numel() * param.element_size()
    runner = llm.engine.executor.runner
    by_component["kv_cache"] = runner.kv_cache_bytes
    by_component["recurrent_state"] = runner.state_bytes
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(0, 240000) for _ in range(128)]} for _ in range(16)]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    result = {
        "ple_table_device": placement, "load_s": load_s, "bytes_by_component": by_component,
        "gib_by_component": {k: round(v / 2**30, 3) for k, v in by_component.items()},
        "cuda_graphs": runner.decode_graphs is not None, "no_graphs_reason": runner.no_graphs_reason,
    }
    for batch, new_tokens in ((1, 64), (16, 32)):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate(prompts[:batch], one, use_tqdm=False)  # this batch's prefill shapes compiled, untimed
        torch.cuda.synchronize()
        t0 = time.time()
        llm.generate(prompts[:batch], one, use_tqdm=False)  # prefill + one token: subtracted below
        torch.cuda.synchronize()
        t1 = time.time()
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.time() - t1
        decode_s = elapsed - (t1 - t0)
        result[f"batch{batch}_prompt128_new{new_tokens}_s"] = elapsed
        result[f"batch{batch}_output_tok_s"] = batch * new_tokens / elapsed
        result[f"batch{batch}_decode_ms_per_step"] = 1000 * decode_s / (new_tokens - 1)
        result[f"batch{batch}_all_finished"] = all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["host_max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    llm.shutdown()
    return result


def tiny_agreement(tmp: Path) -> dict:
    from tests.reference import lamina_logits
    from tests.tiny_checkpoints import make_qwen4_exp

    path = make_qwen4_exp(tmp / "tiny", hc_count=4, ple_layer_ids=(2, 4))
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(0, 990) for _ in range(n)]} for n in (3, 17, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = {}
    with LLM(str(path), device="cpu", dtype="float32", show_progress=False) as cpu:
        ref = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
        for placement in ("cpu", "gpu"):
            with LLM(str(path), device="cuda", dtype="bfloat16", ple_table_device=placement, show_progress=False) as gpu:
                got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
            worst = 0.0
            for p, toks in zip(prompts, got):
                logits = lamina_logits(cpu, p["prompt_token_ids"] + toks)
                for j, t in enumerate(toks):
                    row = logits[len(p["prompt_token_ids"]) + j - 1]
                    worst = max(worst, (row.max() - row[t]).item())
            out[f"ple_table_{placement}"] = {"sequences_identical": sum(a == b for a, b in zip(ref, got)),
                                             "sequences": len(ref), "worst_gap_vs_cpu_fp32": worst}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--placement", choices=["cpu", "gpu"], default="cpu", help="where the real-width PLE table lives")
    parser.add_argument("--skip-tiny", action="store_true", help="skip the tiny-checkpoint agreement check")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    if not args.skip_tiny:
        result["tiny_bf16_gpu_vs_fp32_cpu"] = tiny_agreement(tmp)
        print(json.dumps(result["tiny_bf16_gpu_vs_fp32_cpu"]), flush=True)
    result[f"real_width_{'host' if args.placement == 'cpu' else 'gpu'}_ple"] = real_width(tmp, args.placement)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

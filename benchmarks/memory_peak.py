"""Where an engine's GPU memory goes: weights, KV cache, recurrent states, and the activation peak of
its warm-up (graph capture included), of full-budget prefill steps and of decode steps at
max_num_seqs. Dummy weights of a preset, bf16, one GPU. The activation figures calibrate the headroom
the memory plan keeps (lamina.engine.memory_plan).

    python benchmarks/memory_peak.py --max-num-seqs 32 --max-num-batched-tokens 8192 --out memory_peak.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina import LLM, SamplingParams  # noqa: E402
from lamina.entrypoints.presets import DEFAULT_PRESET, preset_dir  # noqa: E402

GIB = 1 << 30


def _gib(n: int) -> float:
    return round(n / GIB, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=DEFAULT_PRESET)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="0: the engine's default (its memory plan may lower it)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--mamba-ssm-cache-dtype", default="auto", help="the recurrent state pool's dtype")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    start_allocated = torch.cuda.memory_allocated(dev)
    llm = LLM(str(preset_dir(args.preset)), device="cuda", dtype="bfloat16", load_format="dummy",
              max_num_seqs=args.max_num_seqs or None, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, show_progress=False)
    engine = llm.engine
    runner = engine.executor.runner
    weights = sum(t.numel() * t.element_size() for t in runner.model.parameters())
    free, total = torch.cuda.mem_get_info(dev)
    after_init = torch.cuda.memory_allocated(dev)
    record = {
        "gpu": torch.cuda.get_device_name(), "command": "python benchmarks/memory_peak.py " + " ".join(sys.argv[1:]),
        "max_num_seqs": engine.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens,
        "max_model_len": engine.max_model_len, "num_kv_blocks": engine.num_kv_blocks,
        "total_gib": _gib(total), "free_after_init_gib": _gib(free),
        "weights_gib": _gib(weights), "kv_cache_gib": _gib(runner.kv_cache_bytes),
        "state_gib": _gib(runner.state_bytes + runner.spare_state_bytes),
        "allocated_after_init_gib": _gib(after_init - start_allocated),
        "reserved_after_init_gib": _gib(torch.cuda.memory_reserved(dev)),
        # the warm-up's and the graph capture's peak over what stays allocated after them
        "init_peak_over_allocated_gib": _gib(torch.cuda.max_memory_allocated(dev) - after_init),
        "memory_plan": (None if engine.memory_plan is None
                        else engine.memory_plan.describe(engine.args.block_size, engine.max_model_len)),
    }
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    workloads = {
        # whole-budget prefill steps: prompts of 1k tokens, as many as one budget holds
        "prefill_budget": [[(i * 7919 + j) % vocab for j in range(1024)]
                           for i in range(max(1, args.max_num_batched_tokens // 1024))],
        # one prompt as long as max_model_len allows, in budget-sized chunks
        "long_prompt": [[(j * 31) % vocab for j in range(args.max_model_len - 8)]],
        # max_num_seqs decodes (CUDA graphs), sampled with top-k / top-p (the sampler's temporaries)
        "decode_full": [[(i * 13 + j) % vocab for j in range(64)] for i in range(engine.max_num_seqs)],
    }
    for name, prompts in workloads.items():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        p = params if name != "decode_full" else SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=16,
                                                                ignore_eos=True, seed=1)
        llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False)
        torch.cuda.synchronize()
        record[name + "_peak_over_base_gib"] = _gib(torch.cuda.max_memory_allocated(dev) - base)
        record[name + "_reserved_gib"] = _gib(torch.cuda.memory_reserved(dev))
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

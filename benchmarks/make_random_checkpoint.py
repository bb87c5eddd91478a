"""Write a seeded random checkpoint of a real-width config with HF's own tensor names and shapes.

Names and shapes come from the transformers model class built on the meta device (no memory);
each tensor is drawn from a generator seeded by its name, so every layout loads the same weights.

    python benchmarks/make_random_checkpoint.py OUT_DIR --layers 4
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

QWEN35_35B_A3B = dict(
    vocab_size=248320, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, max_position_embeddings=8192, rms_norm_eps=1e-6,
    eos_token_id=248044, tie_word_embeddings=False,
)


def write_checkpoint(out: Path, layers: int, device: str = "cuda", shard_bytes: int = 4 << 30) -> Path:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    layer_types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)]
    config = Qwen3_5MoeTextConfig(num_hidden_layers=layers, layer_types=layer_types, **QWEN35_35B_A3B)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shards, current, size, weight_map = [], {}, 0, {}
    for name, shape in shapes.items():
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        if name.endswith("A_log"):
            t = torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias") or ("norm" in name and len(shape) == 1 and "linear_attn.norm" not in name):
            t = torch.empty(shape, device=device).normal_(0.0, 0.05, generator=gen)
        elif "linear_attn.norm" in name:
            t = 1.0 + torch.empty(shape, device=device).normal_(0.0, 0.05, generator=gen)
        else:
            t = torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen)
        current[name] = t.to(torch.bfloat16).cpu()
        size += current[name].numel() * 2
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    write_checkpoint(Path(args.out), args.layers, args.device)

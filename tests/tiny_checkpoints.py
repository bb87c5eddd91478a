"""Tiny random checkpoints written with transformers' own `save_pretrained`, for tests.

Norm weights (which transformers initialises to zero or one) are randomised so that the
zero-centred and gated norms are really exercised.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lamina.models.default_model import ensure_default_model

VOCAB = 1024
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, max_position_embeddings=512, rms_norm_eps=1e-6,
    eos_token_id=999, pad_token_id=997, bos_token_id=997, tie_word_embeddings=False,
)
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]


def _randomise_norms(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=gen) * 0.2)
            if name.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def _copy_tokenizer(dst: Path) -> None:
    src = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def _save(model, path: Path, seed: int) -> Path:
    _randomise_norms(model, seed)
    model.save_pretrained(path)
    _copy_tokenizer(path)
    return path


def make_qwen3_next(path: Path, *, mixed_dense: bool = False, seed: int = 0) -> Path:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    extra = dict(mlp_only_layers=[1, 3], intermediate_size=96) if mixed_dense else dict(intermediate_size=96)
    config = Qwen3NextConfig(num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, **COMMON, **extra)
    return _save(Qwen3NextForCausalLM(config).float(), path, seed)


def make_qwen3_5_moe(path: Path, *, seed: int = 1) -> Path:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, **COMMON)
    return _save(Qwen3_5MoeForCausalLM(config).float(), path, seed)


def make_qwen3_5_moe_vl(path: Path, *, seed: int = 2) -> Path:
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    text = Qwen3_5MoeTextConfig(num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, **COMMON)
    config = Qwen3_5MoeConfig(
        text_config=text.to_dict(),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64),
    )
    return _save(Qwen3_5MoeForConditionalGeneration(config).float(), path, seed)


def fuse_experts_copy(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint with per-expert tensors rewritten as fused 3-D `gate_up_proj` / `down_proj`,
    split over two shards with an index json."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    fused: dict[str, torch.Tensor] = {}
    prefixes = sorted({k.split("experts.")[0] for k in tensors if ".experts." in k})
    for prefix in prefixes:
        num = len({k.split("experts.")[1].split(".")[0] for k in tensors if k.startswith(prefix + "experts.")})
        gate = [tensors.pop(f"{prefix}experts.{e}.gate_proj.weight") for e in range(num)]
        up = [tensors.pop(f"{prefix}experts.{e}.up_proj.weight") for e in range(num)]
        down = [tensors.pop(f"{prefix}experts.{e}.down_proj.weight") for e in range(num)]
        fused[f"{prefix}experts.gate_up_proj"] = torch.stack([torch.cat([g, u], 0) for g, u in zip(gate, up)])
        fused[f"{prefix}experts.down_proj"] = torch.stack(down)
    tensors.update(fused)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def add_mtp_tensors(path: Path, hidden: int = 64) -> None:
    """Append a few `mtp.*` tensors (as real checkpoints carry) to a single-file checkpoint."""
    tensors = load_file(str(path / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden)
    tensors["mtp.norm.weight"] = torch.randn(hidden)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


QWEN4_LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]


def make_qwen4_exp(
    path: Path,
    *,
    hc_count: int = 2,
    ple_layer_ids: tuple[int, ...] = (2,),
    output_gate_type: str | None = None,
    partial_rotary_factor: float = 1.0,
    conditional: bool = False,
    qsa: bool = True,
    seed: int = 4,
) -> Path:
    """A tiny Qwen4-Exp: hyper-connections, N-gram PLE on `ple_layer_ids` (1-based), QSA indexed
    attention whose budget (8 tokens in blocks of 4) is far below the test contexts. Norms, the PLE
    short-conv weights (zero in transformers' init) and the n-gram tables are randomised so that
    every PLE term matters. `layer_types` uses the real checkpoints' `full_attention` spelling."""
    import transformers

    torch.manual_seed(seed)
    common = {k: v for k, v in COMMON.items() if k not in ("pad_token_id", "bos_token_id")}
    text = dict(
        common, num_hidden_layers=len(QWEN4_LAYER_TYPES), layer_types=QWEN4_LAYER_TYPES,
        hc_count=hc_count, hc_lowrank=16, ple_layer_ids=list(ple_layer_ids), ple_embed_dim=32,
        ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4, seed=77,
        output_gate_type=output_gate_type, initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor},
    )
    if qsa:
        text.update(indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
    if conditional:
        config = transformers.Qwen4ExpConfig(
            text_config=text,
            vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64),
        )
        model = transformers.Qwen4ExpForConditionalGeneration(config)
    else:
        model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**text))
    model = model.float()
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("ple.conv1d.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif "ngram_embedding" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
    return _save(model, path, seed)

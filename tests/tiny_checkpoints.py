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

from tests.tiny_tokenizer import tiny_tokenizer_dir

VOCAB = 1024
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, max_position_embeddings=512, rms_norm_eps=1e-6,
    eos_token_id=999, pad_token_id=997, bos_token_id=997, tie_word_embeddings=False,
)
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
# The Triton-interpreter engine tests' depth: each kind of layer (two delta-net layers, so two state
# pools), at 3/5 of the interpreted kernel launches of LAYER_TYPES.
SHORT_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]


def _randomise_norms(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=gen) * 0.2)
            if name.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def _copy_tokenizer(dst: Path) -> None:
    src = tiny_tokenizer_dir()
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


def make_qwen3_5_moe(path: Path, *, seed: int = 1, layer_types: list[str] = LAYER_TYPES) -> Path:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types), **COMMON)
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
    indexer_n_heads: int = 8,
    indexer_budget: int = 8,
    indexer_compress_ratio: int = 4,
    layer_types: list[str] = QWEN4_LAYER_TYPES,
    seed: int = 4,
) -> Path:
    """A tiny Qwen4-Exp: hyper-connections, N-gram PLE on `ple_layer_ids` (1-based), QSA indexed
    attention whose budget (by default 8 tokens in blocks of 4) is far below the test contexts. Norms, the PLE
    short-conv weights (zero in transformers' init) and the n-gram tables are randomised so that
    every PLE term matters. `layer_types` uses the real checkpoints' `full_attention` spelling."""
    import transformers

    torch.manual_seed(seed)
    common = {k: v for k, v in COMMON.items() if k not in ("pad_token_id", "bos_token_id")}
    text = dict(
        common, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        hc_count=hc_count, hc_lowrank=16, ple_layer_ids=list(ple_layer_ids), ple_embed_dim=32,
        ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4, seed=77,
        output_gate_type=output_gate_type, initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor},
    )
    if qsa:
        text.update(
            indexer_n_heads=indexer_n_heads, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=indexer_budget,
            indexer_compress_ratio=indexer_compress_ratio,
        )
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


def _mtp_moe_tensors(prefix: str, text: dict, gen: torch.Generator, fused: bool) -> dict[str, torch.Tensor]:
    hidden, experts = text["hidden_size"], text["num_experts"]
    inter, shared = text["moe_intermediate_size"], text["shared_expert_intermediate_size"]

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.05

    out = {f"{prefix}gate.weight": w(experts, hidden)}
    if fused:
        out[f"{prefix}experts.gate_up_proj"] = w(experts, 2 * inter, hidden)
        out[f"{prefix}experts.down_proj"] = w(experts, hidden, inter)
    else:
        for e in range(experts):
            out[f"{prefix}experts.{e}.gate_proj.weight"] = w(inter, hidden)
            out[f"{prefix}experts.{e}.up_proj.weight"] = w(inter, hidden)
            out[f"{prefix}experts.{e}.down_proj.weight"] = w(hidden, inter)
    if shared:
        out[f"{prefix}shared_expert.gate_proj.weight"] = w(shared, hidden)
        out[f"{prefix}shared_expert.up_proj.weight"] = w(shared, hidden)
        out[f"{prefix}shared_expert.down_proj.weight"] = w(hidden, shared)
        out[f"{prefix}shared_expert_gate.weight"] = w(1, hidden)
    return out


def _mtp_attention_tensors(prefix: str, text: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, heads, kv = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = text.get("head_dim") or hidden // heads

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.05

    out = {
        f"{prefix}q_proj.weight": w(2 * heads * head_dim, hidden),
        f"{prefix}k_proj.weight": w(kv * head_dim, hidden),
        f"{prefix}v_proj.weight": w(kv * head_dim, hidden),
        f"{prefix}o_proj.weight": w(hidden, heads * head_dim),
        f"{prefix}q_norm.weight": torch.randn(head_dim, generator=gen) * 0.2,
        f"{prefix}k_norm.weight": torch.randn(head_dim, generator=gen) * 0.2,
    }
    if text.get("indexer_n_heads"):
        n, d = text["indexer_n_heads"], text["indexer_head_dim"]
        out[f"{prefix}indexer.index_qk_proj.weight"] = w((n + 1) * d, hidden)
        out[f"{prefix}indexer.q_layernorm.weight"] = torch.randn(d, generator=gen) * 0.2
        out[f"{prefix}indexer.k_layernorm.weight"] = torch.randn(d, generator=gen) * 0.2
    return out


def _hyper_connection_tensors(prefix: str, text: dict, gen: torch.Generator, inject: bool) -> dict[str, torch.Tensor]:
    width, hc, rank = text["hc_count"] * text["hidden_size"], text["hc_count"], text["hc_lowrank"]
    out = {
        f"{prefix}hc_norm.weight": torch.randn(width, generator=gen) * 0.2,
        f"{prefix}input_mix_weight_down.weight": torch.randn(rank, width, generator=gen) * 0.05,
        f"{prefix}input_mix_weight_up.weight": torch.randn(width, rank, generator=gen) * 0.05,
    }
    if inject:
        out[f"{prefix}block_inject_weight.weight"] = torch.randn(hc, width, generator=gen) * 0.05
    return out


def add_mtp_weights(
    path: Path, *, num_layers: int = 1, fused_experts: bool = False, shared_head: bool = False, seed: int = 11,
) -> Path:
    """Give a tiny checkpoint random MTP weights under their real names (a separate `mtp.safetensors`
    shard, listed in the index when there is one) and declare them in config.json:
    `num_nextn_predict_layers` (Qwen3-Next) or `mtp_num_hidden_layers` (Qwen3.5-MoE, Qwen4-Exp).
    Qwen4-Exp gets its multi-stream layout (fc_embedding / fc_hidden / hyper-connections), and
    `shared_head=True` adds `mtp.shared_head.head.weight`."""
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config") or config
    model_type = text.get("model_type", config.get("model_type", ""))
    qwen4 = "qwen4" in model_type
    gen = torch.Generator().manual_seed(seed)
    hidden = text["hidden_size"]

    def norm(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.05

    tensors: dict[str, torch.Tensor] = {"mtp.pre_fc_norm_embedding.weight": norm(hidden)}
    if qwen4:
        hc = text["hc_count"]
        tensors.update({
            "mtp.fc_embedding.weight": w(hidden, hidden), "mtp.fc_hidden.weight": w(hidden, hidden),
            "mtp.pre_fc_norm_hidden.weight": norm(hc * hidden),
        })
        tensors.update(_hyper_connection_tensors("mtp.hyper_connection_mixer.", text, gen, inject=True))
        if shared_head:
            tensors["mtp.shared_head.head.weight"] = w(text["vocab_size"], hidden)
    else:
        tensors.update({
            "mtp.fc.weight": w(hidden, 2 * hidden), "mtp.pre_fc_norm_hidden.weight": norm(hidden),
            "mtp.norm.weight": norm(hidden),
        })
    for i in range(num_layers):
        lp = f"mtp.layers.{i}."
        tensors.update(_mtp_attention_tensors(lp + "self_attn.", text, gen))
        tensors.update(_mtp_moe_tensors(lp + "mlp.", text, gen, fused_experts))
        if qwen4:
            tensors.update(_hyper_connection_tensors(lp + "attn_hyper_connection.", text, gen, inject=True))
            tensors.update(_hyper_connection_tensors(lp + "mlp_hyper_connection.", text, gen, inject=True))
        else:
            tensors[lp + "input_layernorm.weight"] = norm(hidden)
            tensors[lp + "post_attention_layernorm.weight"] = norm(hidden)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "mtp.safetensors" for name in tensors})
        index.write_text(json.dumps(data))
    field_name = "num_nextn_predict_layers" if model_type == "qwen3_next" else "mtp_num_hidden_layers"
    text[field_name] = num_layers
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path

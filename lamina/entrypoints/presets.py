"""Model presets: a known model shape written as a config-only checkpoint directory, run with dummy
(seeded random) weights, so that benchmarks and `lamina serve --preset` need no download.

A preset has no tokenizer: it is served with `skip_tokenizer_init` (token-id prompts only).

    lamina bench latency --preset qwen3.5-35b-a3b --num-layers 8
    lamina serve --preset qwen3.5-35b-a3b --dtype bfloat16
"""

from __future__ import annotations

import tempfile
from pathlib import Path

DEFAULT_PRESET = "qwen3.5-35b-a3b"

PRESETS: dict[str, dict] = {
    # Qwen3.5-35B-A3B text model (40 layers: 30 gated delta net, 10 gated attention).
    "qwen3.5-35b-a3b": dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=32768,
        rms_norm_eps=1e-6, eos_token_id=248044, tie_word_embeddings=False,
        mamba_ssm_dtype="float32",  # as the released checkpoint's config.json declares
    ),
    # The same family at toy width (4 layers: 3 gated delta net, 1 gated attention): CPU tests and
    # smoke runs of the preset path.
    "qwen3.5-moe-tiny": dict(
        vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=2048,
        rms_norm_eps=1e-6, eos_token_id=1023, tie_word_embeddings=False,
    ),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def check_preset(name: str) -> dict:
    """The preset's config fields; ValueError naming the valid presets for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(preset_names())}")
    return dict(PRESETS[name])


def preset_layer_types(num_layers: int) -> list[str]:
    """Qwen3.5's layout: every fourth layer is full (gated) attention, the others gated delta net."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


def write_preset(name: str, path: str | Path, num_layers: int | None = None) -> Path:
    """Write the preset's config.json (no weights, no tokenizer) into `path`; returns it."""
    from transformers import Qwen3_5MoeTextConfig

    fields = check_preset(name)
    if num_layers is not None:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"--num-layers must be a positive integer, got {num_layers!r}")
        fields["num_hidden_layers"] = num_layers
    fields["layer_types"] = preset_layer_types(fields["num_hidden_layers"])
    config = Qwen3_5MoeTextConfig(**fields)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    return path


def preset_dir(name: str, num_layers: int | None = None) -> Path:
    """A fresh temporary directory holding the preset's config.json."""
    check_preset(name)  # fail before making the directory
    return write_preset(name, tempfile.mkdtemp(prefix=f"lamina-preset-{name}-"), num_layers)


def preset_label(name: str, num_layers: int | None = None) -> str:
    """How records and model cards name a preset run: `qwen3.5-35b-a3b (40 layers, dummy)`."""
    layers = num_layers if num_layers is not None else check_preset(name)["num_hidden_layers"]
    return f"{name} ({layers} layers, dummy)"

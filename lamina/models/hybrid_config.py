"""The text-model facts lamina needs from a Qwen hybrid MoE `config.json`, checked before any weight is read."""

from __future__ import annotations

from dataclasses import dataclass

LAYER_KINDS = ("linear_attention", "full_attention")
MTP_LAYER_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


@dataclass(frozen=True)
class HybridTextConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    moe_layers: tuple[bool, ...]  # per layer: sparse MoE (True) or dense MLP (False)
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    attention_bias: bool
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP / MoE
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    eos_token_ids: tuple[int, ...]
    hidden_act: str
    # Scaled RoPE (rope_parameters' rope_type "yarn" or "linear"): the inverse frequencies and the
    # factor cos / sin are multiplied by, from transformers' own rope init functions
    # (transformers.modeling_rope_utils); None: plain RoPE from rope_theta.
    rope_inv_freq: tuple[float, ...] | None
    rope_attention_factor: float

    @property
    def num_attention_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def num_linear_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_hybrid_text_config(text_config, architecture: str, *, moe_every_layer: bool, eos_fallback=None) -> HybridTextConfig:
    """Read and validate a Qwen3-Next / Qwen3.5-MoE text config (a transformers config object)."""
    c = text_config
    num_layers = int(c.num_hidden_layers)
    layer_types = tuple(c.layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"config layer_types has {len(layer_types)} entries, expected num_hidden_layers = {num_layers}")
    for i, kind in enumerate(layer_types):
        if kind not in LAYER_KINDS:
            raise ValueError(f"config layer_types[{i}] = {kind!r} is not one of {LAYER_KINDS}")
    num_experts = int(getattr(c, "num_experts", 0) or 0)
    if moe_every_layer:
        moe_layers = tuple(num_experts > 0 for _ in range(num_layers))
    else:
        mlp_only = set(getattr(c, "mlp_only_layers", None) or [])
        step = int(getattr(c, "decoder_sparse_step", 1) or 1)
        moe_layers = tuple(
            (i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        )
    rope = dict(getattr(c, "rope_parameters", None) or {})
    inv_freq, attention_factor = scaled_rope(c, rope)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    partial = float(rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)))
    hidden_act = getattr(c, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: 'silu'")
    eos = _as_tuple(getattr(c, "eos_token_id", None)) or _as_tuple(eos_fallback)
    return HybridTextConfig(
        architecture=architecture,
        model_type=c.model_type,
        vocab_size=int(c.vocab_size),
        hidden_size=int(c.hidden_size),
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        moe_layers=moe_layers,
        rms_norm_eps=float(c.rms_norm_eps),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        max_position_embeddings=scaled_context(c, rope),
        num_attention_heads=int(c.num_attention_heads),
        num_key_value_heads=int(c.num_key_value_heads),
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        attention_bias=bool(getattr(c, "attention_bias", False)),
        linear_num_key_heads=int(c.linear_num_key_heads),
        linear_num_value_heads=int(c.linear_num_value_heads),
        linear_key_head_dim=int(c.linear_key_head_dim),
        linear_value_head_dim=int(c.linear_value_head_dim),
        linear_conv_kernel_dim=int(c.linear_conv_kernel_dim),
        intermediate_size=int(getattr(c, "intermediate_size", 0) or 0),
        num_experts=num_experts,
        num_experts_per_tok=int(getattr(c, "num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(getattr(c, "moe_intermediate_size", 0) or 0),
        shared_expert_intermediate_size=int(getattr(c, "shared_expert_intermediate_size", 0) or 0),
        norm_topk_prob=bool(getattr(c, "norm_topk_prob", True)),
        eos_token_ids=eos,
        hidden_act=hidden_act,
        rope_inv_freq=inv_freq,
        rope_attention_factor=attention_factor,
    )


# rope types whose frequencies do not depend on the sequence's length (dynamic NTK and longrope do)
SCALED_ROPE_TYPES = ("yarn", "linear")


def scaled_context(config, rope: dict) -> int:
    """The longest context the config supports: max_position_embeddings, or as vLLM derives it under a
    scaled RoPE (the Qwen cards extend 262,144 positions with YaRN by raising rope_parameters alone),
    factor x original_max_position_embeddings for yarn, factor x max_position_embeddings for linear."""
    native = int(config.max_position_embeddings)
    rope_type = rope.get("rope_type", "default")
    factor = float(rope.get("factor", 1.0) or 1.0)
    if rope_type == "yarn":
        return max(native, int(factor * int(rope.get("original_max_position_embeddings") or native)))
    if rope_type == "linear":
        return max(native, int(factor * native))
    return native


def scaled_rope(config, rope: dict) -> tuple[tuple[float, ...] | None, float]:
    """(inverse frequencies, cos/sin factor) of a config's scaled RoPE, from transformers' own init
    function for its rope_type; (None, 1.0) for plain RoPE. ValueError for a type lamina does not run."""
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return None, 1.0
    if rope_type not in SCALED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: 'default', "
                         + ", ".join(repr(t) for t in SCALED_ROPE_TYPES))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return tuple(float(f) for f in inv_freq.float()), float(attention_factor)


def num_mtp_layers(hf_config) -> int:
    """MTP layers a checkpoint declares (`num_nextn_predict_layers` or `mtp_num_hidden_layers`)."""
    for config in (getattr(hf_config, "text_config", None), hf_config):
        if config is None:
            continue
        for name in MTP_LAYER_FIELDS:
            value = getattr(config, name, None)
            if value:
                return int(value)
    return 0

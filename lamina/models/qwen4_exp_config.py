"""Qwen4-Exp text config: the hybrid fields plus hyper-connections, N-gram PLE and QSA, all checked
before any weight is read.

`layer_types` of real checkpoints say `full_attention` for the indexed layers and transformers
rewrites them to `indexed_attention` (5.18+; 5.17: `qwen_sparse_attention`); all of them mean an
attention layer here (`full_attention` in `layer_types`), indexed when the QSA fields are set, plain
gated attention when none is. A checkpoint saved by one transformers carries that version's
spelling, which another version refuses: `normalise_layer_type_spelling` rewrites a config.json's
dict to `full_attention`, the spelling every version reads, before transformers sees it.
`ple_layer_ids` count from 1: id L puts a PLE module on decoder layer L-1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lamina.models.hybrid_config import HybridTextConfig, parse_hybrid_text_config

QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
# Spellings of an attention layer: real checkpoints, transformers >= 5.18, transformers 5.17.
_ATTENTION_KINDS = ("full_attention", "indexed_attention", "qwen_sparse_attention")
QWEN4_EXP_MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
OUTPUT_GATE_TYPES = ("silu", "sigmoid")


@dataclass(frozen=True)
class Qwen4ExpTextConfig(HybridTextConfig):
    hc_count: int
    hc_lowrank: int
    output_gate_type: str
    # N-gram PLE (empty ple_layer_ids: off)
    ple_layer_ids: tuple[int, ...]
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    ngram_seed: int
    split_ngram_parts: int
    ple_eos_token_id: int | None
    # QSA indexer (None: attention layers are plain gated attention)
    indexer_n_heads: int | None
    indexer_head_dim: int | None
    indexer_budget: int | None
    indexer_compress_ratio: int | None

    @property
    def has_qsa(self) -> bool:
        return self.indexer_n_heads is not None

    def ple_index(self, layer_idx: int) -> int | None:
        """Index of decoder layer `layer_idx`'s PLE module among all PLE modules, or None."""
        layer_id = layer_idx + 1
        return self.ple_layer_ids.index(layer_id) if layer_id in self.ple_layer_ids else None

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """0-based decoder layer indices with a PLE module (what the parallel plan reads)."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    @property
    def indexed_attention_layers(self) -> tuple[int, ...]:
        """0-based indices of the attention layers that use the QSA indexer."""
        if not self.has_qsa:
            return ()
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram


def normalise_layer_type_spelling(config_dict: dict) -> bool:
    """Rewrite a Qwen4-Exp config.json dict's attention-layer spellings (and its `text_config`'s)
    to `full_attention`, in place. Returns whether anything changed; other models are untouched."""
    if config_dict.get("model_type") not in QWEN4_EXP_MODEL_TYPES:
        return False
    changed = False
    for part in (config_dict, config_dict.get("text_config")):
        types = part.get("layer_types") if isinstance(part, dict) else None
        if isinstance(types, list) and any(t in _ATTENTION_KINDS[1:] for t in types):
            part["layer_types"] = ["full_attention" if t in _ATTENTION_KINDS else t for t in types]
            changed = True
    return changed


class _WithLayerTypes:
    """A read-only view of a transformers config with `layer_types` replaced."""

    def __init__(self, config, layer_types: list[str]):
        self._config = config
        self.layer_types = layer_types

    def __getattr__(self, name):
        return getattr(self._config, name)


def _int_or_none(value):
    return None if value is None else int(value)


def _check_qsa(c, rotary_dim: int) -> dict:
    values = {name: _int_or_none(getattr(c, name, None)) for name in QSA_FIELDS}
    given = [n for n, v in values.items() if v is not None]
    if not given:
        return values
    missing = [n for n, v in values.items() if v is None]
    if missing:
        raise ValueError(
            f"QSA indexer config is incomplete: {', '.join(given)} set but {', '.join(missing)} missing; "
            f"set all of {', '.join(QSA_FIELDS)} or none"
        )
    bad = {n: v for n, v in values.items() if v <= 0}
    if bad:
        raise ValueError(f"QSA indexer config values must be positive integers, got {bad}")
    if values["indexer_kv_heads"] != 1:
        raise ValueError(f"indexer_kv_heads = {values['indexer_kv_heads']} is not supported: Qwen4-Exp QSA needs exactly 1")
    budget, ratio = values["indexer_budget"], values["indexer_compress_ratio"]
    if budget % ratio != 0:
        raise ValueError(
            f"indexer_budget = {budget} is not divisible by indexer_compress_ratio = {ratio}; use a multiple of {ratio}"
        )
    if rotary_dim > values["indexer_head_dim"]:
        raise ValueError(
            f"the attention rotary dim {rotary_dim} does not fit indexer_head_dim = {values['indexer_head_dim']}; "
            f"indexer_head_dim must be >= {rotary_dim}"
        )
    return values


def _check_ple(c, layer_types: tuple[str, ...], ple_ids: tuple[int, ...], embed_dim: int, eos) -> None:
    num_layers = len(layer_types)
    ngram_size, heads_per_ngram = int(getattr(c, "ngram_size", 3)), int(getattr(c, "heads_per_ngram", 8))
    if ngram_size < 2 or heads_per_ngram < 1:
        raise ValueError(
            f"PLE needs ngram_size >= 2 and heads_per_ngram >= 1, got ngram_size = {ngram_size}, "
            f"heads_per_ngram = {heads_per_ngram}"
        )
    out_of_range = [i for i in ple_ids if not 1 <= i <= num_layers]
    if out_of_range:
        raise ValueError(
            f"ple_layer_ids {out_of_range} are out of range: ids count from 1 and must lie in [1, {num_layers}] "
            f"(num_hidden_layers = {num_layers})"
        )
    not_linear = [i for i in ple_ids if layer_types[i - 1] != "linear_attention"]
    if not_linear:
        linear_ids = [i + 1 for i, kind in enumerate(layer_types) if kind == "linear_attention"]
        raise ValueError(
            f"ple_layer_ids {not_linear} are not linear-attention layers (1-based ids; layer types "
            f"{[layer_types[i - 1] for i in not_linear]}): PLE is only supported on linear-attention layers, "
            f"valid ids are {linear_ids}"
        )
    heads = (ngram_size - 1) * heads_per_ngram
    if embed_dim <= 0 or embed_dim % heads != 0:
        raise ValueError(
            f"ple_embed_dim = {embed_dim} is not divisible by the number of n-gram heads "
            f"(ngram_size - 1) * heads_per_ngram = {heads}; use a positive multiple of {heads}"
        )
    for name in ("ple_conv_kernel_size", "split_ngram_parts", "make_ngram_vocab_size_divisible_by", "ngram_vocab_size_base"):
        value = getattr(c, name, 1)
        if int(value) < 1:
            raise ValueError(f"{name} = {value} must be a positive integer")
    if eos is None:
        raise ValueError("eos_token_id must be set when ple_layer_ids is not empty (PLE fills n-gram gaps with EOS)")
    if not 0 <= eos < int(c.vocab_size):
        raise ValueError(f"eos_token_id = {eos} is outside the vocabulary [0, {c.vocab_size})")


def parse_qwen4_exp_text_config(
    text_config, architecture: str, *, eos_fallback=None, tie_word_embeddings=None
) -> Qwen4ExpTextConfig:
    c = text_config
    rope_type = dict(getattr(c, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":  # its indexer rotates block starts too: scaled RoPE is not wired there
        raise ValueError(f"rope_type {rope_type!r} is not supported for Qwen4-Exp; supported: 'default'")
    raw_types = list(c.layer_types)
    unknown = sorted({t for t in raw_types if t not in ("linear_attention", *_ATTENTION_KINDS)})
    if unknown:
        raise ValueError(
            f"config layer_types has unsupported entries {unknown}; supported: linear_attention, "
            f"{', '.join(_ATTENTION_KINDS)}"
        )
    layer_types = ["full_attention" if t in _ATTENTION_KINDS else t for t in raw_types]
    base = parse_hybrid_text_config(
        _WithLayerTypes(c, layer_types), architecture, moe_every_layer=True, eos_fallback=eos_fallback
    )
    if tie_word_embeddings is not None:
        base = dataclasses.replace(base, tie_word_embeddings=bool(tie_word_embeddings))

    hc_count, hc_lowrank = int(c.hc_count), int(c.hc_lowrank)
    if hc_count < 2:
        raise ValueError(f"hc_count = {hc_count} is not supported: Qwen4-Exp hyper-connections need hc_count >= 2")
    if hc_lowrank < 1:
        raise ValueError(f"hc_lowrank = {hc_lowrank} must be a positive integer")
    gate = getattr(c, "output_gate_type", None) or base.hidden_act
    if gate not in OUTPUT_GATE_TYPES:
        raise ValueError(f"output_gate_type = {gate!r} is not supported; supported: {', '.join(OUTPUT_GATE_TYPES)}")
    if base.num_experts <= 0 or base.shared_expert_intermediate_size <= 0:
        raise ValueError(
            f"Qwen4-Exp needs routed and shared experts: num_experts = {base.num_experts}, "
            f"shared_expert_intermediate_size = {base.shared_expert_intermediate_size} must be positive"
        )

    qsa = _check_qsa(c, base.rotary_dim)
    ple_ids = tuple(sorted({int(i) for i in (getattr(c, "ple_layer_ids", None) or [])}))
    embed_dim = int(getattr(c, "ple_embed_dim", None) or base.hidden_size)
    eos = base.eos_token_ids[0] if base.eos_token_ids else None
    if ple_ids:
        _check_ple(c, base.layer_types, ple_ids, embed_dim, eos)
    return Qwen4ExpTextConfig(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(HybridTextConfig)},
        hc_count=hc_count,
        hc_lowrank=hc_lowrank,
        output_gate_type=gate,
        ple_layer_ids=ple_ids,
        ple_embed_dim=embed_dim,
        ple_conv_kernel_size=int(getattr(c, "ple_conv_kernel_size", 4)),
        ngram_size=int(getattr(c, "ngram_size", 3)),
        heads_per_ngram=int(getattr(c, "heads_per_ngram", 8)),
        ngram_vocab_size_base=int(getattr(c, "ngram_vocab_size_base", 20_000_000)),
        make_ngram_vocab_size_divisible_by=int(getattr(c, "make_ngram_vocab_size_divisible_by", 128)),
        ngram_seed=int(getattr(c, "seed", 1234)),
        split_ngram_parts=int(getattr(c, "split_ngram_parts", 512)),
        ple_eos_token_id=eos if ple_ids else None,
        indexer_n_heads=qsa["indexer_n_heads"],
        indexer_head_dim=qsa["indexer_head_dim"],
        indexer_budget=qsa["indexer_budget"],
        indexer_compress_ratio=qsa["indexer_compress_ratio"],
    )

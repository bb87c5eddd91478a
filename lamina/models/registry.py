"""Architectures lamina runs, keyed by the `architectures` entry of `config.json`."""

from __future__ import annotations

import importlib

_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen3NextForCausalLM": ("lamina.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("lamina.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("lamina.models.qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
    "Qwen4ExpForCausalLM": ("lamina.models.qwen4_exp", "Qwen4ExpForCausalLM"),
    "Qwen4ExpForConditionalGeneration": ("lamina.models.qwen4_exp", "Qwen4ExpForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_model_class(hf_config):
    """The model class for a transformers config; refuses unknown architectures by name."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        raise ValueError(
            f"config.json has no 'architectures' entry (model_type {getattr(hf_config, 'model_type', None)!r}); "
            f"supported architectures: {', '.join(supported_architectures())}"
        )
    for arch in architectures:
        if arch in _ARCHITECTURES:
            module, name = _ARCHITECTURES[arch]
            return arch, getattr(importlib.import_module(module), name)
    raise ValueError(
        f"unsupported architecture {architectures}: supported architectures are {', '.join(supported_architectures())}"
    )

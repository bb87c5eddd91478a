"""Qwen3.5-MoE (and 3.6-MoE) text model: the Qwen3-Next decoder with separate delta-net projections.

Differences from Qwen3-Next handled here: `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`
instead of the per-key-head interleaved `in_proj_qkvz` / `in_proj_ba`; every layer is MoE; the
router always renormalises its top-k weights. Text-only multimodal RoPE gives every section the
same position, which is ordinary RoPE on the token position. `Qwen3_5MoeForConditionalGeneration`
keeps its decoder under `model.language_model.` and its vision tower (skipped) under `model.visual.`.
"""

from __future__ import annotations

import dataclasses

import torch

from lamina.layers.gated_delta_net import GatedDeltaNet
from lamina.models.hybrid_config import HybridTextConfig, parse_hybrid_text_config
from lamina.models.qwen3_next import Qwen3NextForCausalLM
from lamina.models.weight_map import WeightMap


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    checkpoint_prefix = "model."
    ignored_prefixes = ("model.visual.",)
    moe_every_layer = True

    @classmethod
    def parse_config(cls, hf_config, architecture: str) -> HybridTextConfig:
        text_config = getattr(hf_config, "text_config", None) or hf_config
        eos = getattr(text_config, "eos_token_id", None) or getattr(hf_config, "eos_token_id", None)
        cfg = parse_hybrid_text_config(text_config, architecture, moe_every_layer=True, eos_fallback=eos)
        return dataclasses.replace(cfg, norm_topk_prob=True)

    def _map_linear_attention(self, wm: WeightMap, lp: str, gdn: GatedDeltaNet) -> None:
        key_dim = self.cfg.linear_num_key_heads * self.cfg.linear_key_head_dim
        value_dim = self.cfg.linear_num_value_heads * self.cfg.linear_value_head_dim
        hidden = self.cfg.hidden_size

        def load_qkv(name: str, t: torch.Tensor) -> None:
            from lamina.layers.linear import check_shape

            check_shape(name, t, (2 * key_dim + value_dim, hidden))
            for shard_id, part in enumerate(t.split([key_dim, key_dim, value_dim], dim=0)):
                gdn.in_proj_qkvz.load_shard(name, part, shard_id)

        wm.add(lp + "in_proj_qkv.weight", load_qkv)
        wm.add(lp + "in_proj_z.weight", lambda n, t: gdn.in_proj_qkvz.load_shard(n, t, 3))
        wm.add(lp + "in_proj_b.weight", lambda n, t: gdn.in_proj_ba.load_shard(n, t, 0))
        wm.add(lp + "in_proj_a.weight", lambda n, t: gdn.in_proj_ba.load_shard(n, t, 1))
        self._map_linear_attention_common(wm, lp, gdn)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """Text part only; the vision tower's tensors are skipped without being read."""

    checkpoint_prefix = "model.language_model."
    ignored_prefixes = ("model.visual.",)

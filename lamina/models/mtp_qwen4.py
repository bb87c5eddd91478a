"""Qwen4-Exp's MTP drafter: the multi-stream (hyper-connection) variant.

Its input is the target's multi-stream hidden state before the final mixer, `[T, hc*H]`, and one
pass at position p (reading that state at p and the token at p+1) is:

    e       = fc_embedding(pre_fc_norm_embedding(embed(token_{p+1})))               [T, H]
    h       = fc_hidden(pre_fc_norm_hidden(streams_p))   norm over all hc*H features,
                                                         fc_hidden shared by the hc streams
    streams = h + e on every stream                      (e enters as a first block output
                                                         whose injection weight is 1)
    streams = layer(streams)     a Qwen4-Exp decoder layer: full attention (indexed when the
                                 model's attention is), MoE, hyper-connections, no PLE
    out     = hyper_connection_mixer(streams)  -> LM head (`mtp.shared_head.head` when the
                                                 checkpoint has one, else the target's)

The next pass reads `streams` (the pre-mixer multi-stream state), not `out`. Checkpoint names:
`mtp.fc_embedding`, `mtp.fc_hidden`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.layers.{i}.*`,
`mtp.hyper_connection_mixer.*` (its `block_inject_weight`, if present, is unused) and optionally
`mtp.shared_head.head.weight`.

The target's pre-mixer streams are taken with a forward pre-hook on its final mixer, so the
target model needs no second output; under sequence parallelism they are gathered here.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lamina.layers.embedding import ParallelLMHead
from lamina.layers.hyper_connections import HyperConnection
from lamina.layers.indexed_attention import IndexedGatedAttention
from lamina.layers.linear import ReplicatedLinear
from lamina.layers.metadata import ForwardMetadata
from lamina.layers.norm import RMSNorm
from lamina.models.mtp import MTPBase
from lamina.models.weight_map import WeightMap
from lamina.parallel import layout


class Qwen4ExpMTP(MTPBase):
    def __init__(self, target: nn.Module, *, num_layers: int, prefix: str, device, available_names=(),
                 fp8_experts=None):
        """`fp8_experts`: keep the drafter's experts block FP8 (as the target's, `attach_mtp`)."""
        super().__init__(target, num_layers=num_layers, prefix=prefix, device=device)
        from lamina.models.qwen4_exp import Qwen4ExpDecoderLayer

        cfg, dtype = target.cfg, target.dtype
        hidden, hc = cfg.hidden_size, cfg.hc_count
        self.hidden_size, self.hc_count = hidden, hc
        layer_cfg = dataclasses.replace(
            cfg, num_hidden_layers=1, layer_types=("full_attention",), moe_layers=(True,), ple_layer_ids=()
        )
        self.pre_fc_norm_embedding = RMSNorm(hidden, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.pre_fc_norm_hidden = RMSNorm(hc * hidden, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.fc_embedding = ReplicatedLinear(hidden, hidden, dtype=dtype, device=device)
        self.fc_hidden = ReplicatedLinear(hidden, hidden, dtype=dtype, device=device)
        self.layers = nn.ModuleDict({
            str(i): Qwen4ExpDecoderLayer(layer_cfg, 0, target.rotary, self.ctx, dtype, device, torch.device("cpu"),
                                         fp8_experts)
            for i in range(num_layers)
        })
        self.hyper_connection_mixer = HyperConnection(
            hidden, hc, cfg.hc_lowrank, cfg.rms_norm_eps, inject=False, dtype=dtype, device=device
        )
        head_name = f"{prefix}shared_head.head.weight"
        self.shared_head = (
            ParallelLMHead(cfg.vocab_size, hidden, self.ctx, dtype=dtype, device=device)
            if head_name in set(available_names) else None
        )
        self._streams: torch.Tensor | None = None
        target.hyper_connection_mixer.register_forward_pre_hook(self._keep_target_streams)

    def _keep_target_streams(self, module, args) -> None:
        self._streams = args[0]

    def target_hidden(self, stage_output: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        """The target's pre-mixer streams of this step, R [T, hc*H]."""
        streams, self._streams = self._streams, None
        assert streams is not None, "the target's final mixer did not run in this step"
        return self._from_stream(streams, meta.num_tokens)

    def forward(self, token_ids: torch.Tensor, streams: torch.Tensor, meta: ForwardMetadata, step: int = 0):
        """token_ids [T], streams R [T, hc*H] -> (mixed R [T, H] for the LM head, streams R [T, hc*H])."""
        num_tokens = meta.num_tokens
        embedded = self.fc_embedding(self.pre_fc_norm_embedding(self.embed(token_ids)))  # [T, H]
        normed = self.pre_fc_norm_hidden(streams).unflatten(-1, (self.hc_count, self.hidden_size))  # [T, hc, H]
        x = (self.fc_hidden(normed) + embedded[:, None, :]).flatten(-2)  # [T, hc, H] -> [T, hc*H]
        cos, sin = self.target.rotary.cos_sin(meta.positions)
        x = self.layer(step)(self._to_stream(x, num_tokens), meta, cos, sin, None)
        mixed = self.hyper_connection_mixer(x)  # [rows, H]
        return self._from_stream(mixed, num_tokens), self._from_stream(x, num_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.shared_head is None:
            return self.target.compute_logits(hidden)
        return self.ctx.tp.all_gather(self.shared_head.forward_local(hidden), dim=-1).float()

    def add_weights(self, wm: WeightMap) -> None:
        target, p = self.target, self.prefix
        for name in ("fc_embedding", "fc_hidden", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
            wm.add(f"{p}{name}.weight", getattr(self, name).load_shard)
        target._map_hyper_connection(wm, p + "hyper_connection_mixer.", self.hyper_connection_mixer)
        wm.ignore(p + "hyper_connection_mixer.block_inject_weight.weight")
        for idx, layer in self.layers.items():
            lp = f"{p}layers.{idx}."
            target._map_hyper_connection(wm, lp + "attn_hyper_connection.", layer.attn_hyper_connection)
            target._map_hyper_connection(wm, lp + "mlp_hyper_connection.", layer.mlp_hyper_connection)
            target._map_attention(wm, lp + "self_attn.", layer.self_attn)
            if isinstance(layer.self_attn, IndexedGatedAttention):
                indexer, ip = layer.self_attn.indexer, lp + "self_attn.indexer."
                wm.add(ip + "index_qk_proj.weight", indexer.index_qk_proj.load_shard)
                wm.add(ip + "q_layernorm.weight", indexer.q_layernorm.load_shard)
                wm.add(ip + "k_layernorm.weight", indexer.k_layernorm.load_shard)
            target._map_moe(wm, lp + "mlp.", layer.mlp)
        if self.shared_head is not None:
            wm.add(p + "shared_head.head.weight", self.shared_head.load_shard)
        self.add_embedding_weights(wm)

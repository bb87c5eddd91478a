"""MTP (multi-token prediction) drafters of Qwen3-Next and Qwen3.5-MoE, and how a model gets one.

One MTP pass at position p reads the target's hidden state h_p and the token at p+1:

    x   = fc(cat[pre_fc_norm_embedding(embed(token_{p+1})), pre_fc_norm_hidden(h_p)])   [T, H]
    x   = layer(x)        a full-attention decoder layer (MoE) with its own paged KV cache,
                          under the same block tables as the target
    out = norm(x)         -> the shared LM head gives the draft for token p+2

`h_p` is the target's last hidden state after its final norm on the first pass, and the previous
pass's `out` on later ones (K > 1 drafts reuse the layer). Embedding and LM head are shared with
the target; on a pipeline's last stage without the embedding the drafter loads its own copy.

Layouts follow the target's contract: the pass starts Replicate over TP, is sharded once for the
layer under sequence parallelism (S in, S out, the layer's MoE on the shard) and gathered once
after `norm`. The drafter lives on the last pipeline stage.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lamina.layers.embedding import VocabParallelEmbedding
from lamina.layers.linear import ReplicatedLinear
from lamina.layers.metadata import ForwardMetadata
from lamina.layers.moe import SparseMoE
from lamina.layers.norm import RMSNorm
from lamina.models.weight_map import Loader, WeightMap
from lamina.parallel import layout


def add_shared_loader(wm: WeightMap, name: str, loader: Loader) -> None:
    """Load checkpoint tensor `name` into one more place (a tensor the target also reads, or skips)."""
    wm.ignored.discard(name)
    previous = wm.loaders.get(name)
    if previous is None:
        wm.add(name, loader)
        return

    def both(n: str, t: torch.Tensor) -> None:
        previous(n, t)
        loader(n, t)

    wm.loaders[name] = both


class MTPBase(nn.Module):
    """What the proposer needs from any drafter (see `HybridMTP` for the contract)."""

    def __init__(self, target: nn.Module, *, num_layers: int, prefix: str, device):
        super().__init__()
        self._target = (target,)  # not a submodule: the target owns the drafter, not the reverse
        self.ctx = target.ctx
        self.prefix = prefix
        self.num_layers = num_layers
        cfg = target.cfg
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.ctx, dtype=target.dtype, device=device)
            if target.embed_tokens is None else None
        )

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] -> R [T, H] (the target's vocab-parallel table, or this stage's copy)."""
        table = self.embed_tokens if self.embed_tokens is not None else self.target.embed_tokens
        partial = layout.tag(table.forward_partial(token_ids), layout.P, self.ctx)
        return layout.all_reduce(partial, self.ctx)

    def layer(self, step: int) -> nn.Module:
        return self.layers[str(step % self.num_layers)]

    def paged_cache_modules(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers.values()]

    def target_hidden(self, stage_output: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        """The target's hidden states the first pass reads, from the last stage's output R [T, H]."""
        return stage_output

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def _to_stream(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        x = layout.tag(x, layout.R, self.ctx)
        return layout.replicate_to_shard(x, num_tokens, self.ctx) if self.ctx.sp else x

    def _from_stream(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if self.ctx.sp:
            return layout.all_gather_tokens(layout.tag(x, layout.S, self.ctx), num_tokens, self.ctx)
        return layout.tag(x, layout.R, self.ctx)

    def add_embedding_weights(self, wm: WeightMap) -> None:
        if self.embed_tokens is not None:
            add_shared_loader(wm, f"{self.target.checkpoint_prefix}embed_tokens.weight", self.embed_tokens.load_shard)


class HybridMTP(MTPBase):
    """Qwen3-Next / Qwen3.5-MoE drafter: `mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.layers.{i}`, `mtp.norm`."""

    # its first pass reads the target's final hidden states alone (`target_hidden`), so a target step
    # replayed from a graph that keeps them feeds it (lamina.worker.mixed_graphs.why_not_capturable)
    reads_final_hidden = True

    def __init__(self, target: nn.Module, *, num_layers: int, prefix: str, device, available_names=(),
                 fp8_experts=None):
        """`fp8_experts`: keep the drafter's experts block FP8 (as the target's, `attach_mtp`)."""
        super().__init__(target, num_layers=num_layers, prefix=prefix, device=device)
        from lamina.models.qwen3_next import HybridDecoderLayer

        cfg, dtype, hidden = target.cfg, target.dtype, target.cfg.hidden_size
        # One full-attention layer, MoE whenever the model has experts (as the hub checkpoints).
        layer_cfg = dataclasses.replace(
            cfg, num_hidden_layers=1, layer_types=("full_attention",), moe_layers=(cfg.num_experts > 0,)
        )
        self.pre_fc_norm_embedding = RMSNorm(hidden, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.pre_fc_norm_hidden = RMSNorm(hidden, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.fc = ReplicatedLinear(2 * hidden, hidden, dtype=dtype, device=device)
        self.layers = nn.ModuleDict({
            str(i): HybridDecoderLayer(layer_cfg, 0, target.rotary, self.ctx, dtype, device, fp8_experts)
            for i in range(num_layers)
        })
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, meta: ForwardMetadata, step: int = 0):
        """token_ids [T] (the token after each position), hidden R [T, H] -> (LM-head input R [T, H],
        the hidden state the next pass reads R [T, H]); here both are `norm`'s output."""
        num_tokens = meta.num_tokens
        embedded = self.pre_fc_norm_embedding(self.embed(token_ids))  # [T, H]
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden)], dim=-1))  # [T, 2H] -> [T, H]
        cos, sin = self.target.rotary.cos_sin(meta.positions)
        x = self.layer(step)(self._to_stream(x, num_tokens), meta, cos, sin)
        out = self._from_stream(self.norm(x), num_tokens)
        return out, out

    def add_weights(self, wm: WeightMap) -> None:
        target, p = self.target, self.prefix
        wm.add(p + "fc.weight", self.fc.load_shard)
        wm.add(p + "pre_fc_norm_embedding.weight", self.pre_fc_norm_embedding.load_shard)
        wm.add(p + "pre_fc_norm_hidden.weight", self.pre_fc_norm_hidden.load_shard)
        wm.add(p + "norm.weight", self.norm.load_shard)
        for idx, layer in self.layers.items():
            lp = f"{p}layers.{idx}."
            wm.add(lp + "input_layernorm.weight", layer.input_layernorm.load_shard)
            wm.add(lp + "post_attention_layernorm.weight", layer.post_attention_layernorm.load_shard)
            target._map_attention(wm, lp + "self_attn.", layer.self_attn)
            if isinstance(layer.mlp, SparseMoE):
                target._map_moe(wm, lp + "mlp.", layer.mlp)
            else:
                target._map_dense_mlp(wm, lp + "mlp.", layer.mlp)
        self.add_embedding_weights(wm)


def mtp_class_for(model_cls) -> type[MTPBase]:
    """The drafter class of a model family; a clear error for families without one."""
    from lamina.models.qwen3_next import Qwen3NextForCausalLM
    from lamina.models.qwen4_exp import Qwen4ExpForCausalLM

    if issubclass(model_cls, Qwen4ExpForCausalLM):
        from lamina.models.mtp_qwen4 import Qwen4ExpMTP

        return Qwen4ExpMTP
    if issubclass(model_cls, Qwen3NextForCausalLM):
        return HybridMTP
    raise ValueError(f"speculative_config method 'mtp' is not supported for {model_cls.__name__}")


def attach_mtp(model: nn.Module, *, num_layers: int, prefix: str, device, available_names=(),
               fp8_experts=None) -> MTPBase | None:
    """Give the last pipeline stage's model its drafter (`model.mtp`); other stages get none.
    `fp8_experts` (a BlockFp8): the drafter's MoE experts stay block FP8 on the Triton kernels, as
    the target's (`lamina.worker.model_loader` decides: every drafter expert tensor must be FP8)."""
    if not model.is_last_stage:
        return None
    cls = mtp_class_for(type(model))
    model.mtp = cls(model, num_layers=num_layers, prefix=prefix, device=device, available_names=available_names,
                    fp8_experts=fp8_experts)
    return model.mtp

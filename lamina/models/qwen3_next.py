"""Qwen3-Next text model (and the shared decoder of the Qwen3.5-MoE family).

The residual stream is `[T, hidden]`, Replicate over TP; every sub-block output (attention, MoE,
MLP) is Partial and is all-reduced explicitly before the residual add. A model instance owns the
contiguous layer range its pipeline stage was given; the embedding lives only on the first stage
and the final norm / LM head only on the last.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from lamina.layers.attention import GatedAttention
from lamina.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from lamina.layers.gated_delta_net import GatedDeltaNet
from lamina.layers.metadata import ForwardMetadata
from lamina.layers.moe import DenseMLP, SparseMoE, fp8_experts_for
from lamina.layers.norm import RMSNorm
from lamina.layers.rotary import RotaryEmbedding
from lamina.models.hybrid_config import HybridTextConfig, parse_hybrid_text_config
from lamina.models.weight_map import WeightMap
from lamina.parallel import layout
from lamina.parallel.context import ParallelContext
from lamina.quantization import BlockFp8


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: HybridTextConfig, layer_idx: int, rotary: RotaryEmbedding, ctx: ParallelContext, dtype, device,
                 fp8: BlockFp8 | None = None):
        """`fp8`: keep the MoE experts in block FP8 (`lamina.layers.moe.fp8_experts_for`)."""
        super().__init__()
        self.ctx = ctx
        self.layer_idx = layer_idx
        self.kind = cfg.layer_types[layer_idx]
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype, device=device)
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                hidden_size=cfg.hidden_size,
                total_num_k_heads=cfg.linear_num_key_heads,
                total_num_v_heads=cfg.linear_num_value_heads,
                head_k_dim=cfg.linear_key_head_dim,
                head_v_dim=cfg.linear_value_head_dim,
                conv_kernel_size=cfg.linear_conv_kernel_dim,
                rms_norm_eps=eps, ctx=ctx, dtype=dtype, device=device,
            )
        else:
            self.self_attn = GatedAttention(
                hidden_size=cfg.hidden_size,
                total_num_heads=cfg.num_attention_heads,
                total_num_kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim,
                rotary=rotary,
                rms_norm_eps=eps,
                attention_bias=cfg.attention_bias,
                ctx=ctx, dtype=dtype, device=device,
            )
        if cfg.moe_layers[layer_idx]:
            self.mlp: nn.Module = SparseMoE(
                hidden_size=cfg.hidden_size,
                num_experts=cfg.num_experts,
                top_k=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size,
                shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                norm_topk_prob=cfg.norm_topk_prob,
                ctx=ctx, dtype=dtype, device=device, fp8=fp8,
            )
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, ctx, dtype=dtype, device=device)

    def forward(
        self, hidden: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor,
        pending: torch.Tensor | None = None, *, defer_residual: bool = False,
    ):
        """hidden: the residual stream, R [T, H] (or S [ceil(T/tp), H] under SP); returns the same layout.

        `pending`: the previous layer's block output not yet added to `hidden` (same layout); it is
        added inside this layer's input norm (one fused launch on the Triton kernel set).
        `defer_residual`: return `(hidden, out)` without the final residual add, for the next
        layer (or the final norm) to fuse."""
        ctx, num_tokens = self.ctx, meta.num_tokens
        stream = layout.S if ctx.sp else layout.R
        layout.expect(hidden, stream, ctx, f"decoder layer {self.layer_idx} input")
        if pending is None:
            normed = self.input_layernorm(hidden)
        else:
            hidden, normed = self.input_layernorm.add_and_norm(hidden, pending)
            layout.tag(hidden, stream, ctx)
        if ctx.sp:
            normed = layout.all_gather_tokens(layout.tag(normed, layout.S, ctx), num_tokens, ctx)
        else:
            layout.tag(normed, layout.R, ctx)
        if num_tokens == 0:  # an idle data-parallel replica in a lockstep (EP) step
            mixed = torch.zeros_like(normed)
        elif self.kind == "linear_attention":
            mixed = self.linear_attn(normed, meta)
        else:
            mixed = self.self_attn(normed, meta, cos, sin)
        mixed = layout.tag(mixed, layout.P, ctx)
        update = layout.reduce_scatter_tokens(mixed, num_tokens, ctx) if ctx.sp else layout.all_reduce(mixed, ctx)
        hidden, normed = self.post_attention_layernorm.add_and_norm(hidden, update)  # residual add fused with the norm
        normed = layout.tag(normed, stream, ctx)
        if isinstance(self.mlp, SparseMoE) and self.mlp.output_layout == layout.S:
            out = layout.tag(self.mlp(normed, meta), stream, ctx)  # EP + SP: MoE on the shard, complete rows
        else:
            if ctx.sp:
                normed = layout.all_gather_tokens(normed, num_tokens, ctx)
            out = self.mlp(normed, meta) if isinstance(self.mlp, SparseMoE) else self.mlp(normed)
            out = layout.tag(out, layout.P, ctx)
            out = layout.reduce_scatter_tokens(out, num_tokens, ctx) if ctx.sp else layout.all_reduce(out, ctx)
        if defer_residual:
            return layout.tag(hidden, stream, ctx), layout.tag(out, stream, ctx)
        return layout.tag(hidden + out, stream, ctx)


class Qwen3NextForCausalLM(nn.Module):
    """Text decoder + LM head. Checkpoint names: `model.*` and `lm_head.weight`."""

    # Prefix of the decoder's tensors in the checkpoint; subclasses for multimodal wrappers change it.
    checkpoint_prefix = "model."
    # Checkpoint tensors that belong to other parts of a multimodal checkpoint: skipped silently.
    ignored_prefixes: tuple[str, ...] = ()
    moe_every_layer = False

    @classmethod
    def parse_config(cls, hf_config, architecture: str) -> HybridTextConfig:
        return parse_hybrid_text_config(hf_config, architecture, moe_every_layer=cls.moe_every_layer)

    def __init__(
        self,
        cfg: HybridTextConfig,
        ctx: ParallelContext,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layer_range: tuple[int, int] | None = None,
        options: dict | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.ctx = ctx
        self.dtype = dtype
        start, end = layer_range or (0, cfg.num_hidden_layers)
        self.layer_range = (start, end)
        self.is_first_stage = start == 0
        self.is_last_stage = end == cfg.num_hidden_layers
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings, device=device,
            inv_freq=cfg.rope_inv_freq, attention_factor=cfg.rope_attention_factor,
        )
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, dtype=dtype, device=device)
            if self.is_first_stage else None
        )
        self.layers = nn.ModuleDict(
            {str(i): HybridDecoderLayer(cfg, i, self.rotary, ctx, dtype, device, fp8_experts_for(options, device))
             for i in range(start, end)}
        )
        if self.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx, dtype=dtype, device="meta")
                self.lm_head.weight = self.embed_tokens.weight
            else:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx, dtype=dtype, device=device)

    # ---- forward -------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        """token_ids [T] -> the residual stream: R [T, H], or S [ceil(T/tp), H] under SP."""
        assert self.embed_tokens is not None, "embedding lives on the first pipeline stage"
        partial = layout.tag(self.embed_tokens.forward_partial(token_ids), layout.P, self.ctx)
        if self.ctx.sp:
            return layout.reduce_scatter_tokens(partial, meta.num_tokens, self.ctx)
        return layout.all_reduce(partial, self.ctx)

    @property
    def stream_layout(self) -> str:
        return layout.S if self.ctx.sp else layout.R

    def stream_width(self) -> int:
        """Feature width of the tensor that crosses a pipeline boundary."""
        return self.cfg.hidden_size

    def forward(self, token_ids: torch.Tensor, meta: ForwardMetadata, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: token_ids [T] -> stream; later stages continue the previous stage's stream.

        Returns this stage's output stream; on the last stage, the final-normed hidden states as
        R [T, H] (gathered once under SP), ready for the LM head.
        """
        if hidden is None:
            hidden = self.embed(token_ids, meta)
        else:
            layout.tag(hidden, self.stream_layout, self.ctx)
        cos, sin = self.rotary.cos_sin(meta.positions)
        # Each layer's block output is added to the stream inside the next norm (fused on Triton).
        pending = None
        for layer in self.layers.values():
            hidden, pending = layer(hidden, meta, cos, sin, pending, defer_residual=True)
        if self.is_last_stage:
            if pending is None:  # a stage without layers
                hidden = self.norm(hidden)
            else:
                hidden = self.norm.add_and_norm(hidden, pending)[1]
            hidden = layout.tag(hidden, self.stream_layout, self.ctx)
            if self.ctx.sp:
                hidden = layout.all_gather_tokens(hidden, meta.num_tokens, self.ctx)
        elif pending is not None:
            hidden = layout.tag(hidden + pending, self.stream_layout, self.ctx)  # the next stage's input: complete
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden [N, hidden] -> logits [N, vocab] in float32 (gathered over TP);
        `out`: a float32 `[N, vocab]` tensor to write them into (one conversion pass, no temporary,
        on one TP rank: the verify graphs' persistent logits)."""
        local = self.lm_head.forward_local(hidden)
        if out is not None and self.ctx.tp_size == 1:
            return out.copy_(local)
        logits = self.ctx.tp.all_gather(local, dim=-1).float()
        return logits if out is None else out.copy_(logits)

    # ---- cache binding -------------------------------------------------------------------
    def paged_cache_modules(self) -> list[nn.Module]:
        """Modules with a paged per-token cache (`bind_paged_cache`, `paged_cache_bytes_per_block`)."""
        return [l.self_attn for l in self.layers.values() if l.kind == "full_attention"]

    def state_modules(self) -> list[nn.Module]:
        """Modules with per-request state slots (`bind_state`)."""
        return [l.linear_attn for l in self.layers.values() if l.kind == "linear_attention"]

    # ---- weights -------------------------------------------------------------------------
    def build_weight_map(self) -> WeightMap:
        """Every checkpoint tensor this stage needs, with its loader."""
        wm = WeightMap()
        p = self.checkpoint_prefix
        tied = self.cfg.tie_word_embeddings
        if self.embed_tokens is not None:
            wm.add(f"{p}embed_tokens.weight", self.embed_tokens.load_shard)
        elif tied and self.is_last_stage:
            wm.add(f"{p}embed_tokens.weight", self.lm_head.load_shard)  # a last stage's own copy of the tied head
        else:
            wm.ignore(f"{p}embed_tokens.weight")  # another pipeline stage's
        if self.is_last_stage:
            wm.add(f"{p}norm.weight", self.norm.load_shard)
            if tied:
                wm.ignore("lm_head.weight")  # some checkpoints carry the tied copy anyway
            else:
                wm.add("lm_head.weight", self.lm_head.load_shard)
        else:
            wm.ignore(f"{p}norm.weight")
            wm.ignore("lm_head.weight")
        for idx, layer in self.layers.items():
            lp = f"{p}layers.{idx}."
            wm.add(lp + "input_layernorm.weight", layer.input_layernorm.load_shard)
            wm.add(lp + "post_attention_layernorm.weight", layer.post_attention_layernorm.load_shard)
            if layer.kind == "full_attention":
                self._map_attention(wm, lp + "self_attn.", layer.self_attn)
            else:
                self._map_linear_attention(wm, lp + "linear_attn.", layer.linear_attn)
            if isinstance(layer.mlp, SparseMoE):
                self._map_moe(wm, lp + "mlp.", layer.mlp)
            else:
                self._map_dense_mlp(wm, lp + "mlp.", layer.mlp)
        return wm

    @staticmethod
    def _map_attention(wm: WeightMap, ap: str, attn: GatedAttention) -> None:
        for proj in ("q_proj", "k_proj", "v_proj"):
            module = getattr(attn, proj)
            wm.add(f"{ap}{proj}.weight", module.load_shard)
            if module.bias is not None:
                wm.add(f"{ap}{proj}.bias", lambda n, t, m=module: m.load_shard(n, t, is_bias=True))
        wm.add(f"{ap}o_proj.weight", attn.o_proj.load_shard)
        wm.add(f"{ap}q_norm.weight", attn.q_norm.load_shard)
        wm.add(f"{ap}k_norm.weight", attn.k_norm.load_shard)

    def _map_linear_attention(self, wm: WeightMap, lp: str, gdn: GatedDeltaNet) -> None:
        """Qwen3-Next stores q/k/v/z interleaved per key head in `in_proj_qkvz`, b/a in `in_proj_ba`."""
        nk, nv = self.cfg.linear_num_key_heads, self.cfg.linear_num_value_heads
        dk, dv = self.cfg.linear_key_head_dim, self.cfg.linear_value_head_dim
        hidden = self.cfg.hidden_size
        ratio = nv // nk

        def load_qkvz(name: str, t: torch.Tensor) -> None:
            from lamina.layers.linear import check_shape

            check_shape(name, t, (nk * (2 * dk + 2 * ratio * dv), hidden))
            grouped = t.view(nk, 2 * dk + 2 * ratio * dv, hidden)  # [Hk, 2Dk + 2rDv, H]
            q, k, v, z = grouped.split([dk, dk, ratio * dv, ratio * dv], dim=1)
            for shard_id, part in enumerate((q, k, v, z)):
                gdn.in_proj_qkvz.load_shard(name, part.reshape(-1, hidden), shard_id)  # [Hk*rows, H]

        def load_ba(name: str, t: torch.Tensor) -> None:
            from lamina.layers.linear import check_shape

            check_shape(name, t, (2 * nv, hidden))
            grouped = t.view(nk, 2 * ratio, hidden)  # [Hk, 2r, H]
            b, a = grouped.split([ratio, ratio], dim=1)
            gdn.in_proj_ba.load_shard(name, b.reshape(nv, hidden), 0)  # [Hv, H]
            gdn.in_proj_ba.load_shard(name, a.reshape(nv, hidden), 1)

        wm.add(lp + "in_proj_qkvz.weight", load_qkvz)
        wm.add(lp + "in_proj_ba.weight", load_ba)
        self._map_linear_attention_common(wm, lp, gdn)

    @staticmethod
    def _map_linear_attention_common(wm: WeightMap, lp: str, gdn: GatedDeltaNet) -> None:
        wm.add(lp + "conv1d.weight", gdn.load_conv_weight)
        wm.add(lp + "A_log", gdn.load_head_vector)
        wm.add(lp + "dt_bias", gdn.load_head_vector)
        wm.add(lp + "norm.weight", gdn.norm.load_shard)
        wm.add(lp + "out_proj.weight", gdn.out_proj.load_shard)

    @staticmethod
    def _map_dense_mlp(wm: WeightMap, mp: str, mlp: DenseMLP) -> None:
        wm.add(mp + "gate_proj.weight", lambda n, t: mlp.gate_up_proj.load_shard(n, t, 0))
        wm.add(mp + "up_proj.weight", lambda n, t: mlp.gate_up_proj.load_shard(n, t, 1))
        wm.add(mp + "down_proj.weight", mlp.down_proj.load_shard)

    def _map_moe(self, wm: WeightMap, mp: str, moe: SparseMoE) -> None:
        wm.add(mp + "gate.weight", moe.gate.load_shard)
        fp8 = moe.fp8 is not None  # the experts' loaders keep block FP8 tensors as stored
        if moe.has_shared_expert:
            if moe.shared_fp8:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    wm.add(f"{mp}shared_expert.{proj}.weight", lambda n, t, proj=proj: moe.load_shared_fp8(n, t, proj),
                           keeps_fp8=True)
            else:
                self._map_dense_mlp(wm, mp + "shared_expert.", moe.shared_expert)
            wm.add(mp + "shared_expert_gate.weight", moe.shared_expert_gate.load_shard)
        # Per-expert tensors, or the fused 3-D pair: either layout satisfies the requirement.
        per_expert = []
        for e in range(moe.num_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"{mp}experts.{e}.{proj}.weight"
                per_expert.append(name)
                wm.add(name, lambda n, t, e=e, proj=proj: moe.load_expert(n, t, e, proj), required=False, keeps_fp8=fp8)
        fused = [mp + "experts.gate_up_proj", mp + "experts.down_proj"]
        wm.add(fused[0], lambda n, t: moe.load_fused(n, t, "gate_up_proj"), required=False, keeps_fp8=fp8)
        wm.add(fused[1], lambda n, t: moe.load_fused(n, t, "down_proj"), required=False, keeps_fp8=fp8)
        wm.require_one_of(f"{mp}experts", [per_expert, fused])


_LAYER_NAME = re.compile(r"layers\.(\d+)\.")


def checkpoint_layer_index(name: str) -> int | None:
    m = _LAYER_NAME.search(name)
    return int(m.group(1)) if m else None

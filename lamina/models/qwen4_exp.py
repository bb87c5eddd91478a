"""Qwen4-Exp (Qwen3.8-Flash-Next) text model: hybrid gated-delta-net / indexed-attention decoder with
hyper-connections, N-gram PLE and MoE on every layer.

The residual stream is `[T, hc_count*hidden]` from the (repeated) embedding to the final
`hyper_connection_mixer`, Replicate over TP; it is also what crosses a pipeline boundary. Each
layer: optional PLE (adds into the streams), then attention and MLP, each wrapped in a gated
residual that mixes the streams into the sub-block input and injects its all-reduced output back.
There are no layer norms besides the hyper-connections' own; the last stage's output is the
mixer's `[T, hidden]`, which goes straight to the LM head.

Weight mapping helpers (attention, gated delta net in the Qwen3.5 layout, MoE) and the LM head
are shared with Qwen3.5-MoE; construction and forward are this file's own.
"""

from __future__ import annotations

import torch
from torch import nn

from lamina.layers.attention import GatedAttention
from lamina.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from lamina.layers.gated_delta_net import GatedDeltaNet
from lamina.layers.hyper_connections import HyperConnection
from lamina.layers.indexed_attention import IndexedGatedAttention, QSAIndexer
from lamina.layers.metadata import ForwardMetadata
from lamina.layers.moe import SparseMoE, fp8_experts_for
from lamina.layers.ngram_hash import ngram_windows
from lamina.layers.ple import NGramHashEmbedding, PLELayer, ple_table_rows, resolve_ple_table_device
from lamina.layers.rotary import RotaryEmbedding
from lamina.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from lamina.models.qwen4_exp_config import Qwen4ExpTextConfig, parse_qwen4_exp_text_config
from lamina.models.weight_map import WeightMap
from lamina.parallel import layout
from lamina.parallel.context import ParallelContext


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(
        self, cfg: Qwen4ExpTextConfig, layer_idx: int, rotary: RotaryEmbedding, ctx: ParallelContext,
        dtype, device, ple_table_device, fp8=None,
    ):
        """`fp8`: keep the MoE experts in block FP8 (`lamina.layers.moe.fp8_experts_for`)."""
        super().__init__()
        self.ctx = ctx
        self.layer_idx = layer_idx
        self.kind = cfg.layer_types[layer_idx]
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                hidden_size=hidden,
                total_num_k_heads=cfg.linear_num_key_heads,
                total_num_v_heads=cfg.linear_num_value_heads,
                head_k_dim=cfg.linear_key_head_dim,
                head_v_dim=cfg.linear_value_head_dim,
                conv_kernel_size=cfg.linear_conv_kernel_dim,
                rms_norm_eps=eps, ctx=ctx, dtype=dtype, device=device,
                output_gate_activation=cfg.output_gate_type,
            )
        else:
            attn_args = dict(
                hidden_size=hidden, total_num_heads=cfg.num_attention_heads,
                total_num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rotary=rotary,
                rms_norm_eps=eps, attention_bias=cfg.attention_bias, ctx=ctx, dtype=dtype, device=device,
            )
            if cfg.has_qsa:
                indexer = QSAIndexer(
                    hidden_size=hidden, num_heads=cfg.indexer_n_heads, head_dim=cfg.indexer_head_dim,
                    budget=cfg.indexer_budget, compress_ratio=cfg.indexer_compress_ratio, rotary=rotary,
                    rms_norm_eps=eps, dtype=dtype, device=device,
                )
                self.self_attn: GatedAttention = IndexedGatedAttention(indexer=indexer, **attn_args)
            else:
                self.self_attn = GatedAttention(**attn_args)
        self.mlp = SparseMoE(
            hidden_size=hidden, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob, ctx=ctx, dtype=dtype, device=device, fp8=fp8,
        )
        ple_index = cfg.ple_index(layer_idx)
        self.ple: PLELayer | None = None
        if ple_index is not None:
            table = NGramHashEmbedding(
                vocab_size=cfg.vocab_size, ngram_size=cfg.ngram_size, heads_per_ngram=cfg.heads_per_ngram,
                embed_dim=cfg.ple_embed_dim, ple_index=ple_index, seed=cfg.ngram_seed,
                vocab_base=cfg.ngram_vocab_size_base, divisible_by=cfg.make_ngram_vocab_size_divisible_by,
                split_parts=cfg.split_ngram_parts, dtype=dtype, device=device, table_device=ple_table_device,
                tp_size=ctx.tp_size, tp_rank=ctx.tp_rank,
            )
            self.ple = PLELayer(
                hidden_size=hidden, hc_count=cfg.hc_count, embedding=table, embed_dim=cfg.ple_embed_dim,
                conv_kernel_size=cfg.ple_conv_kernel_size, dilation=cfg.ngram_size, rms_norm_eps=eps,
                dtype=dtype, device=device, tp=ctx.tp,
            )
        hc = dict(hidden_size=hidden, hc_count=cfg.hc_count, lowrank=cfg.hc_lowrank, eps=eps, dtype=dtype, device=device)
        self.attn_hyper_connection = HyperConnection(**hc)
        self.mlp_hyper_connection = HyperConnection(**hc)

    def forward(
        self, streams: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor,
        window: torch.Tensor | None,
    ) -> torch.Tensor:
        """streams: R [T, hc*H], or S [ceil(T/tp), hc*H] under SP; returns the same layout.

        Hyper-connection mixing and injection are per token, so they run on whatever rows the
        rank holds; attention and PLE (sequential over tokens) read all T rows.
        """
        ctx, num_tokens = self.ctx, meta.num_tokens
        stream = layout.S if ctx.sp else layout.R
        layout.expect(streams, stream, ctx, f"decoder layer {self.layer_idx} input")
        if self.ple is not None and num_tokens > 0:
            if ctx.sp:
                full = self.ple(layout.all_gather_tokens(streams, num_tokens, ctx), window, meta)  # [T, hc*H]
                streams = layout.replicate_to_shard(layout.tag(full, layout.R, ctx), num_tokens, ctx)
            else:
                streams = self.ple(streams, window, meta)
        x, inject = self.attn_hyper_connection.mix(streams)  # [rows, H], [rows, hc]
        x = self._gather(x, num_tokens)  # R [T, H]
        if num_tokens == 0:  # an idle data-parallel replica in a lockstep (EP) step
            out = torch.zeros_like(x)
        elif self.kind == "linear_attention":
            out = self.linear_attn(x, meta)
        else:
            out = self.self_attn(x, meta, cos, sin)
        streams = HyperConnection.combine(streams, self._reduce(out, num_tokens), inject)

        x, inject = self.mlp_hyper_connection.mix(layout.tag(streams, stream, ctx))  # [rows, H], [rows, hc]
        if self.mlp.output_layout == layout.S:  # EP + SP: experts and shared expert on the shard
            out = self.mlp(layout.tag(x, layout.S, ctx), meta)  # S
        else:
            out = self._reduce(self.mlp(self._gather(x, num_tokens), meta), num_tokens)
        return layout.tag(HyperConnection.combine(streams, out, inject), stream, ctx)

    def _gather(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """A sub-block input computed on the stream's rows -> R [T, H] (all-gather under SP)."""
        if self.ctx.sp:
            return layout.all_gather_tokens(layout.tag(x, layout.S, self.ctx), num_tokens, self.ctx)
        return layout.tag(x, layout.R, self.ctx)

    def _reduce(self, partial: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """A sub-block's P [T, H] output -> the stream's rows (all-reduce, or reduce-scatter under SP)."""
        partial = layout.tag(partial, layout.P, self.ctx)
        if self.ctx.sp:
            return layout.reduce_scatter_tokens(partial, num_tokens, self.ctx)
        return layout.all_reduce(partial, self.ctx)


class Qwen4ExpForCausalLM(Qwen3_5MoeForCausalLM):
    """Text decoder + LM head. Checkpoint names: `model.*` and `lm_head.weight`."""

    checkpoint_prefix = "model."
    ignored_prefixes: tuple[str, ...] = ("model.visual.",)

    @classmethod
    def parse_config(cls, hf_config, architecture: str) -> Qwen4ExpTextConfig:
        text_config = getattr(hf_config, "text_config", None) or hf_config
        eos = getattr(hf_config, "eos_token_id", None)
        tie = getattr(hf_config, "tie_word_embeddings", None) if text_config is not hf_config else None
        return parse_qwen4_exp_text_config(text_config, architecture, eos_fallback=eos, tie_word_embeddings=tie)

    @classmethod
    def token_history_len_for(cls, cfg: Qwen4ExpTextConfig) -> int:
        """Earlier token ids each chunk needs: the n-gram window's `ngram_size - 1` (0 without PLE)."""
        return cfg.ngram_size - 1 if cfg.ple_layer_ids else 0

    def __init__(
        self,
        cfg: Qwen4ExpTextConfig,
        ctx: ParallelContext,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layer_range: tuple[int, int] | None = None,
        options: dict | None = None,
    ):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.ctx = ctx
        self.dtype = dtype
        start, end = layer_range or (0, cfg.num_hidden_layers)
        self.layer_range = (start, end)
        self.is_first_stage = start == 0
        self.is_last_stage = end == cfg.num_hidden_layers
        # The scheduler hands every chunk this many earlier token ids (the same on every stage).
        self.token_history_len = self.token_history_len_for(cfg)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings, device=device
        )
        self.ple_table_device = self._ple_table_device((options or {}).get("ple_table_device", "auto"), device)
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, dtype=dtype, device=device)
            if self.is_first_stage else None
        )
        self.layers = nn.ModuleDict({
            str(i): Qwen4ExpDecoderLayer(cfg, i, self.rotary, ctx, dtype, device, self.ple_table_device,
                                         fp8_experts_for(options, device))
            for i in range(start, end)
        })
        if self.is_last_stage:
            self.hyper_connection_mixer = HyperConnection(
                cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps, inject=False, dtype=dtype, device=device
            )
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx, dtype=dtype, device="meta")
                self.lm_head.weight = self.embed_tokens.weight
            else:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx, dtype=dtype, device=device)

    def _ple_table_device(self, option: str, device) -> torch.device:
        cfg = self.cfg
        start, end = self.layer_range
        local = [cfg.ple_index(i) for i in range(start, end) if cfg.ple_index(i) is not None]
        head_dim = cfg.ple_embed_dim // max(cfg.ngram_heads, 1)
        if self.ctx.tp_size > 1 and head_dim % self.ctx.tp_size == 0:
            head_dim //= self.ctx.tp_size  # the table is TP-sharded along its features
        row_bytes = head_dim * self.dtype.itemsize
        table_bytes = sum(
            ple_table_rows(cfg.ngram_vocab_size_base, p, cfg.ngram_heads, cfg.make_ngram_vocab_size_divisible_by)
            for p in local
        ) * row_bytes
        return resolve_ple_table_device(option, torch.device(device), table_bytes)

    # ---- forward -------------------------------------------------------------------------
    def stream_width(self) -> int:
        """Feature width of the tensor that crosses a pipeline boundary: all hc streams."""
        return self.cfg.hc_count * self.cfg.hidden_size

    def forward(self, token_ids: torch.Tensor, meta: ForwardMetadata, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: token_ids [T] -> streams; later stages continue the previous stage's
        streams [T, hc*H] (S rows under SP). Returns this stage's streams, or on the last stage
        the mixed hidden states R [T, H] for the LM head (gathered once under SP)."""
        if hidden is None:
            hidden = self.embed(token_ids, meta).repeat(1, self.cfg.hc_count)  # [rows, hc*H]: hc copies side by side
        hidden = layout.tag(hidden, self.stream_layout, self.ctx)
        cos, sin = self.rotary.cos_sin(meta.positions)
        window = None
        if meta.num_tokens > 0 and any(layer.ple is not None for layer in self.layers.values()):
            window = ngram_windows(
                token_ids, meta.history_token_ids, meta.token_request_index, meta.query_start_loc,
                self.cfg.ngram_size, self.cfg.ple_eos_token_id,
            )  # [T, ngram_size]
        for layer in self.layers.values():
            hidden = layer(hidden, meta, cos, sin, window)
        if self.is_last_stage:
            hidden = layout.tag(self.hyper_connection_mixer(hidden), self.stream_layout, self.ctx)  # [rows, H]
            if self.ctx.sp:
                hidden = layout.all_gather_tokens(hidden, meta.num_tokens, self.ctx)
        return hidden

    # ---- cache binding -------------------------------------------------------------------
    def paged_cache_modules(self) -> list[nn.Module]:
        """Attention layers (indexed ones also page their indexer's raw keys)."""
        return [l.self_attn for l in self.layers.values() if l.kind == "full_attention"]

    def state_modules(self) -> list[nn.Module]:
        """Gated delta nets and PLE short convolutions."""
        modules: list[nn.Module] = []
        for layer in self.layers.values():
            if layer.kind == "linear_attention":
                modules.append(layer.linear_attn)
            if layer.ple is not None:
                modules.append(layer.ple)
        return modules

    # ---- weights -------------------------------------------------------------------------
    def build_weight_map(self) -> WeightMap:
        wm = WeightMap()
        p = self.checkpoint_prefix
        if self.embed_tokens is not None:
            wm.add(f"{p}embed_tokens.weight", self.embed_tokens.load_shard)
        elif not (self.is_last_stage and self.cfg.tie_word_embeddings):
            wm.ignore(f"{p}embed_tokens.weight")
        mixer = f"{p}hyper_connection_mixer."
        if self.is_last_stage:
            self._map_hyper_connection(wm, mixer, self.hyper_connection_mixer)
            if self.lm_head.weight is not getattr(self.embed_tokens, "weight", None):
                if self.cfg.tie_word_embeddings:  # tied, but the embedding lives on another stage
                    wm.add(f"{p}embed_tokens.weight", self.lm_head.load_shard)
                else:
                    wm.add("lm_head.weight", self.lm_head.load_shard)
            if self.cfg.tie_word_embeddings:
                wm.ignore("lm_head.weight")
        else:
            for name in ("hc_norm.weight", "input_mix_weight_down.weight", "input_mix_weight_up.weight"):
                wm.ignore(mixer + name)
            wm.ignore("lm_head.weight")
        for idx, layer in self.layers.items():
            lp = f"{p}layers.{idx}."
            self._map_hyper_connection(wm, lp + "attn_hyper_connection.", layer.attn_hyper_connection)
            self._map_hyper_connection(wm, lp + "mlp_hyper_connection.", layer.mlp_hyper_connection)
            if layer.kind == "full_attention":
                self._map_attention(wm, lp + "self_attn.", layer.self_attn)
                if isinstance(layer.self_attn, IndexedGatedAttention):
                    indexer, ip = layer.self_attn.indexer, lp + "self_attn.indexer."
                    wm.add(ip + "index_qk_proj.weight", indexer.index_qk_proj.load_shard)
                    wm.add(ip + "q_layernorm.weight", indexer.q_layernorm.load_shard)
                    wm.add(ip + "k_layernorm.weight", indexer.k_layernorm.load_shard)
            else:
                self._map_linear_attention(wm, lp + "linear_attn.", layer.linear_attn)
            self._map_moe(wm, lp + "mlp.", layer.mlp)
            if layer.ple is not None:
                self._map_ple(wm, lp + "ple.", layer.ple)
        return wm

    @staticmethod
    def _map_hyper_connection(wm: WeightMap, hp: str, hc: HyperConnection) -> None:
        wm.add(hp + "hc_norm.weight", hc.hc_norm.load_shard)
        wm.add(hp + "input_mix_weight_down.weight", hc.input_mix_weight_down.load_shard)
        wm.add(hp + "input_mix_weight_up.weight", hc.input_mix_weight_up.load_shard)
        if hc.block_inject_weight is not None:
            wm.add(hp + "block_inject_weight.weight", hc.block_inject_weight.load_shard)

    @staticmethod
    def _map_ple(wm: WeightMap, pp: str, ple: PLELayer) -> None:
        for proj in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv"):
            wm.add(f"{pp}{proj}.weight", getattr(ple, proj).load_shard)
        wm.add(pp + "conv1d.weight", ple.load_conv_weight)
        table, ep = ple.ple_embedding, pp + "ple_embedding."
        for part in range(table.num_parts):
            wm.add(f"{ep}ngram_embedding.shard_{part}.weight", lambda n, t, part=part: table.load_part(n, t, part))
        for buffer in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
            wm.add(ep + buffer, table.check_buffer, required=False)


class Qwen4ExpForConditionalGeneration(Qwen4ExpForCausalLM):
    """Text part only; the vision tower's tensors are skipped without being read."""

    checkpoint_prefix = "model.language_model."
    ignored_prefixes = ("model.visual.",)

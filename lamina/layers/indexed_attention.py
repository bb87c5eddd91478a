"""Qwen4-Exp indexed attention: gated full attention that reads only the blocks its QSA indexer picks.

The indexer projects each token to `Hi` query heads and one raw key (`index_qk_proj`). Raw keys are
cached per request in a paged tensor `[num_blocks, block_size, 1, D]` that shares the KV cache's
block tables (so it is allocated and freed with the request). Each step the block keys are
rebuilt from the cached raw keys: mean of `ratio` consecutive raw keys, `k_layernorm`, RoPE at
the block's first position. Queries get `q_layernorm` and RoPE at their own positions. The
selection itself is `lamina.kernels.indexed_attention.qsa_key_mask`.

Indexer weights are small and replicated over TP (every rank computes the same mask).
"""

from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.indexed_attention import pool_block_keys, qsa_key_mask
from lamina.kernels.paged_attention import gather_paged_context, write_paged_rows
from lamina.kernels.qsa_decode import decode_block_selection, qsa_decode_attention, select_decode_blocks
from lamina.kernels.selection import is_one_token_decode, kernel_set, qsa_fixed_shape_decode
from lamina.layers.attention import GatedAttention
from lamina.layers.linear import ReplicatedLinear
from lamina.layers.metadata import ForwardMetadata
from lamina.layers.norm import RMSNorm
from lamina.layers.rotary import RotaryEmbedding


class QSAIndexer(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        budget: int,
        compress_ratio: int,
        rotary: RotaryEmbedding,
        rms_norm_eps: float,
        dtype: torch.dtype,
        device=None,
    ):
        super().__init__()
        if budget % compress_ratio != 0:
            raise ValueError(f"indexer_budget = {budget} is not divisible by indexer_compress_ratio = {compress_ratio}")
        if rotary.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim = {rotary.rotary_dim} does not fit indexer_head_dim = {head_dim}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.ratio = compress_ratio
        self.top_blocks = budget // compress_ratio
        self.rotary = rotary
        # rows: [Hi query heads | 1 raw key], each head_dim wide
        self.index_qk_proj = ReplicatedLinear(hidden_size, (num_heads + 1) * head_dim, dtype=dtype, device=device)
        self.q_layernorm = RMSNorm(head_dim, rms_norm_eps, dtype=dtype, device=device)
        self.k_layernorm = RMSNorm(head_dim, rms_norm_eps, dtype=dtype, device=device)
        self.key_cache: torch.Tensor | None = None  # [num_blocks, block_size, 1, D], bound by the runner
        # the raw keys stay in the layer's dtype whatever the KV cache's (kv_cache_dtype): they choose
        # the blocks attention reads, so they are kept as computed
        self.key_dtype = dtype
        self.kernels = kernel_set(device)  # 'triton': one-token decode scores blocks in lamina.kernels.triton_qsa

    # ---- paged raw-key cache --------------------------------------------------------------
    def paged_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * self.head_dim * dtype.itemsize

    def bind_paged_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> int:
        self.key_cache = torch.zeros((num_blocks, block_size, 1, self.head_dim), dtype=dtype, device=device)
        return self.key_cache.numel() * dtype.itemsize

    def paged_cache_tensors(self) -> list[torch.Tensor]:
        """Every paged cache tensor (block-major), for block-to-block copies."""
        return [self.key_cache]

    # ---- forward ---------------------------------------------------------------------------
    def _query_and_write(self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] -> indexer queries [T, Hi, D]; this step's raw keys go to the paged cache."""
        assert self.key_cache is not None, "indexer key cache not bound"
        num_tokens = meta.num_tokens
        qk = self.index_qk_proj(x).view(num_tokens, self.num_heads + 1, self.head_dim)  # [T, Hi+1, D]
        query, raw_key = qk.split([self.num_heads, 1], dim=1)  # [T, Hi, D], [T, 1, D]
        query = self.rotary.apply(self.q_layernorm(query), cos, sin)  # [T, Hi, D]
        write_paged_rows(self.key_cache, raw_key, meta.slot_mapping)
        return query

    def decode_selection(self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor):
        """One-token decode (graph-safe): x [B, hidden] -> chosen complete blocks `[B, nb]` bool,
        nb = meta.max_seq_len // ratio (a graph's fixed capacity; lamina.kernels.qsa_decode)."""
        query = self._query_and_write(x, meta, cos, sin)  # [B, Hi, D]
        if self.kernels != "triton":
            block_keys = self._block_keys(meta.block_tables, meta.max_seq_len)  # [B, nb, D]
            return decode_block_selection(query, block_keys, meta.seq_lens, self.ratio, self.top_blocks)
        from lamina.kernels.triton_qsa import qsa_block_scores

        num_index_blocks = meta.max_seq_len // self.ratio
        starts = torch.arange(num_index_blocks, device=query.device) * self.ratio  # [nb]
        start_cos, start_sin = self.rotary.cos_sin(starts)  # [nb, rotary_dim]
        norm = self.k_layernorm
        scores = qsa_block_scores(
            query, self.key_cache, meta.block_tables, meta.seq_lens, norm.weight, norm.eps, norm.zero_centred,
            start_cos, start_sin, self.ratio,
        )  # [B, nb]: each request's complete blocks only
        return select_decode_blocks(scores, meta.seq_lens, self.ratio, self.top_blocks)

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] -> the key mask for `paged_attention`, as a function of a request group
        (None: the whole step) returning `[B_g, max(1, max_query_len_g), ctx_len_g]` bool. Per group,
        so a step mixing decodes with a long prompt chunk never builds a whole-step padded mask."""
        query = self._query_and_write(x, meta, cos, sin)  # [T, Hi, D]

        def key_mask(group) -> torch.Tensor:
            if group is None:
                return self._mask(query, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  meta.max_query_len, meta.max_seq_len)
            return self._mask(
                query.index_select(0, group.tokens), meta.block_tables.index_select(0, group.requests),
                meta.seq_lens.index_select(0, group.requests), group.query_start_loc, group.max_query_len,
                group.max_seq_len,
            )

        return key_mask

    def _block_keys(self, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """Block keys `[B, max_seq_len // ratio, D]` from the cached raw keys (host-int shapes only)."""
        block_size = self.key_cache.shape[1]
        blocks_used = max(1, -(-max_seq_len // block_size))
        raw = gather_paged_context(self.key_cache, block_tables, blocks_used)[:, :, 0]  # [B, S, D]
        num_index_blocks = max_seq_len // self.ratio
        block_keys = self.k_layernorm(pool_block_keys(raw, self.ratio, num_index_blocks))  # [B, nb, D]
        starts = torch.arange(num_index_blocks, device=raw.device) * self.ratio  # [nb]
        start_cos, start_sin = self.rotary.cos_sin(starts)  # [nb, rotary_dim]
        return self.rotary.apply(block_keys.transpose(0, 1), start_cos, start_sin).transpose(0, 1)  # [B, nb, D]

    def _mask(self, query, block_tables, seq_lens, query_start_loc, max_query_len: int, max_seq_len: int):
        block_size = self.key_cache.shape[1]
        ctx_len = max(1, -(-max_seq_len // block_size)) * block_size
        block_keys = self._block_keys(block_tables, max_seq_len)  # [B, nb, D]
        return qsa_key_mask(
            query, block_keys, seq_lens, query_start_loc, max_query_len, self.ratio, self.top_blocks, ctx_len,
        )


class IndexedGatedAttention(GatedAttention):
    """`GatedAttention` whose paged attention is restricted to the indexer's selection."""

    def __init__(self, *, indexer: QSAIndexer, **kwargs):
        super().__init__(**kwargs)
        self.indexer = indexer
        # One-token decode with fixed shapes (graph-safe); LAMINA_QSA_DECODE=0 turns it off.
        self.fixed_shape_decode = qsa_fixed_shape_decode(self.kernels)

    def paged_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return super().paged_cache_bytes_per_block(block_size, dtype) + self.indexer.paged_cache_bytes_per_block(
            block_size, self.indexer.key_dtype
        )

    def bind_paged_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> int:
        """K/V (in `dtype`, the KV cache's) and the indexer's raw keys (in the layer's), all under the
        same block ids."""
        kv_bytes = super().bind_paged_cache(num_blocks, block_size, dtype, device)
        return kv_bytes + self.indexer.bind_paged_cache(num_blocks, block_size, self.indexer.key_dtype, device)

    def paged_cache_tensors(self) -> list[torch.Tensor]:
        """K/V and the indexer's raw keys (same block ids)."""
        return super().paged_cache_tensors() + self.indexer.paged_cache_tensors()

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (Replicate) -> [T, hidden] (Partial). One-token decode steps take the
        graph-safe path (`lamina.kernels.qsa_decode`) where `fixed_shape_decode` is on; everything
        else builds the reference key mask."""
        if self.fixed_shape_decode and is_one_token_decode(meta):
            return self._decode(x, meta, cos, sin)
        key_mask = self.indexer(x, meta, cos, sin)
        return super().forward(x, meta, cos, sin, key_mask=key_mask)

    def _decode(self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, hidden] (one token per request) -> [B, hidden] (Partial): fixed shapes for a
        given batch size, block-table width and `max_seq_len` (a graph's capacity), no host reads."""
        chosen = self.indexer.decode_selection(x, meta, cos, sin)  # [B, nb]
        if self.qkv_rows is not None:
            query, gate = self._project_and_cache_fused(x, meta, cos, sin)  # [B, H, D] each
        else:
            query, gate = self._project_and_cache(x, meta, cos, sin)  # [B, H, D], [B, H*D]
        attn = qsa_decode_attention(
            query, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, chosen, self.indexer.ratio,
            self.indexer.top_blocks, self.scale,
        )  # [B, H, D]
        width = self.num_heads * self.head_dim
        gate = gate.reshape(meta.num_tokens, width)  # [B, H*D]
        return self.o_proj(attn.reshape(meta.num_tokens, width) * torch.sigmoid(gate))

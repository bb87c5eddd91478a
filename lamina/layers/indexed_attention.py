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
    def forward(self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] -> the key mask for `paged_attention`, as a function of a request group
        (None: the whole step) returning `[B_g, max(1, max_query_len_g), ctx_len_g]` bool. Per group,
        so a step mixing decodes with a long prompt chunk never builds a whole-step padded mask."""
        assert self.key_cache is not None, "indexer key cache not bound"
        num_tokens = meta.num_tokens
        qk = self.index_qk_proj(x).view(num_tokens, self.num_heads + 1, self.head_dim)  # [T, Hi+1, D]
        query, raw_key = qk.split([self.num_heads, 1], dim=1)  # [T, Hi, D], [T, 1, D]
        query = self.rotary.apply(self.q_layernorm(query), cos, sin)  # [T, Hi, D]
        write_paged_rows(self.key_cache, raw_key, meta.slot_mapping)

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

    def _mask(self, query, block_tables, seq_lens, query_start_loc, max_query_len: int, max_seq_len: int):
        block_size = self.key_cache.shape[1]
        blocks_used = max(1, -(-max_seq_len // block_size))
        ctx_len = blocks_used * block_size
        raw = gather_paged_context(self.key_cache, block_tables, blocks_used)[:, :, 0]  # [B, S, D]
        num_index_blocks = max_seq_len // self.ratio
        block_keys = self.k_layernorm(pool_block_keys(raw, self.ratio, num_index_blocks))  # [B, nb, D]
        starts = torch.arange(num_index_blocks, device=query.device) * self.ratio  # [nb]
        start_cos, start_sin = self.rotary.cos_sin(starts)  # [nb, rotary_dim]
        block_keys = self.rotary.apply(block_keys.transpose(0, 1), start_cos, start_sin).transpose(0, 1)  # [B, nb, D]
        return qsa_key_mask(
            query, block_keys, seq_lens, query_start_loc, max_query_len, self.ratio, self.top_blocks, ctx_len,
        )


class IndexedGatedAttention(GatedAttention):
    """`GatedAttention` whose paged attention is restricted to the indexer's selection."""

    def __init__(self, *, indexer: QSAIndexer, **kwargs):
        super().__init__(**kwargs)
        self.indexer = indexer

    def paged_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return super().paged_cache_bytes_per_block(block_size, dtype) + self.indexer.paged_cache_bytes_per_block(
            block_size, dtype
        )

    def bind_paged_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> int:
        """K/V and the indexer's raw keys, all under the same block ids."""
        kv_bytes = super().bind_paged_cache(num_blocks, block_size, dtype, device)
        return kv_bytes + self.indexer.bind_paged_cache(num_blocks, block_size, dtype, device)

    def paged_cache_tensors(self) -> list[torch.Tensor]:
        """K/V and the indexer's raw keys (same block ids)."""
        return super().paged_cache_tensors() + self.indexer.paged_cache_tensors()

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (Replicate) -> [T, hidden] (Partial)."""
        key_mask = self.indexer(x, meta, cos, sin)
        return super().forward(x, meta, cos, sin, key_mask=key_mask)

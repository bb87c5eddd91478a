"""Plain-PyTorch reference kernels over flat varlen batches."""

from lamina.kernels.causal_conv1d import causal_conv1d_varlen
from lamina.kernels.gated_delta_rule import (
    chunk_gated_delta_rule_varlen,
    gated_delta_rule_varlen,
    recurrent_gated_delta_rule_step,
)
from lamina.kernels.indexed_attention import pool_block_keys, qsa_key_mask
from lamina.kernels.paged_attention import gather_paged_context, paged_attention, write_kv_cache, write_paged_rows
from lamina.kernels.varlen import flat_positions, from_padded, padded_index, query_lens, to_padded

__all__ = [
    "causal_conv1d_varlen",
    "chunk_gated_delta_rule_varlen",
    "flat_positions",
    "from_padded",
    "gather_paged_context",
    "gated_delta_rule_varlen",
    "padded_index",
    "paged_attention",
    "pool_block_keys",
    "qsa_key_mask",
    "query_lens",
    "recurrent_gated_delta_rule_step",
    "to_padded",
    "write_kv_cache",
    "write_paged_rows",
]

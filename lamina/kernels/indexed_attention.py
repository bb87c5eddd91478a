"""QSA (query-selected sparse attention) block selection over a flat varlen batch.

Qwen4-Exp's indexed attention layers let every query read only part of its causal context:

- The context 0..p of a query at position p is cut into blocks of `ratio` consecutive
  positions. Block n covers positions n*ratio .. n*ratio + ratio-1; it is *complete* for that
  query when its last position is <= p, i.e. n < (p + 1) // ratio.
- Each block has one key: the mean of its `ratio` raw indexer keys (normed and rotated at the
  block's first position by the caller).
- The query's score for a block is `sum_h relu(q_h . k_block) / sqrt(D)` over its indexer heads.
- The query attends to the tokens of its `top_blocks` highest-scoring complete blocks plus every
  token of the incomplete tail block (positions (p+1)//ratio*ratio .. p); when (p+1) is a
  multiple of ratio there is no tail and the query's own block competes like any other.

Everything is computed for all queries of all requests at once in the padded `[B, Lq, ...]`
layout that `paged_attention` uses; the result is its `key_mask`.
"""

from __future__ import annotations

import math

import torch

from lamina.kernels.varlen import padded_index, query_lens, to_padded

__all__ = ["pool_block_keys", "qsa_key_mask"]


def pool_block_keys(raw_keys: torch.Tensor, ratio: int, num_blocks: int) -> torch.Tensor:
    """Mean of `ratio` consecutive raw keys (in float32, returned in their dtype).

    Args:
        raw_keys: `[B, S, D]` each request's raw indexer keys in logical order (S >= num_blocks*ratio);
        ratio: keys per block; num_blocks: host int, blocks to pool from the start.

    Returns:
        `[B, num_blocks, D]`; blocks past a request's length hold whatever the cache held (the
        selection masks them).
    """
    bsz, _, dim = raw_keys.shape
    grouped = raw_keys[:, : num_blocks * ratio].reshape(bsz, num_blocks, ratio, dim)  # [B, nb, r, D]
    return grouped.float().mean(dim=2).to(raw_keys.dtype)  # [B, nb, D]


def qsa_key_mask(
    q: torch.Tensor,
    block_keys: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    ratio: int,
    top_blocks: int,
    ctx_len: int,
) -> torch.Tensor:
    """Which context keys each query reads.

    Args:
        q: `[T, Hi, D]` indexer queries (normed and rotated at their own positions);
        block_keys: `[B, nb, D]` block keys of each request (nb = max_seq_len // ratio);
        seq_lens: `[B]` context length after this step; query_start_loc: `[B+1]`;
        max_query_len: host int; ratio: tokens per block; top_blocks: complete blocks kept per
        query; ctx_len: host int, the key length of the mask (>= max_seq_len).

    Returns:
        `[B, max(1, max_query_len), ctx_len]` bool: True where query (b, i) may read key
        position j. Padded query rows are all True (the attention's causal mask limits them).
    """
    device = q.device
    max_len = max(1, max_query_len)
    num_blocks = block_keys.shape[1]
    index, valid = padded_index(query_start_loc, max_len)  # [B, Lq]
    q_pos = (seq_lens.long() - query_lens(query_start_loc))[:, None] + torch.arange(max_len, device=device)  # [B, Lq]
    num_complete = torch.div(q_pos + 1, ratio, rounding_mode="floor")  # [B, Lq]

    k_pos = torch.arange(ctx_len, device=device)  # [S]
    key_block = torch.div(k_pos, ratio, rounding_mode="floor")  # [S]
    causal = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Lq, S]
    in_complete = key_block[None, None, :] < num_complete[:, :, None]  # [B, Lq, S]

    if num_blocks > 0 and top_blocks > 0:
        queries = to_padded(q.float(), index, valid)  # [B, Lq, Hi, D]
        scores = torch.einsum("blhd,bnd->blhn", queries, block_keys.float())  # [B, Lq, Hi, nb]
        scores = scores.relu().sum(dim=2) / math.sqrt(q.shape[-1])  # [B, Lq, nb]
        block_ids = torch.arange(num_blocks, device=device)  # [nb]
        incomplete = block_ids[None, None, :] >= num_complete[:, :, None]  # [B, Lq, nb]
        scores = scores.masked_fill(incomplete, float("-inf"))
        top_values, top_ids = scores.topk(min(top_blocks, num_blocks), dim=-1)  # [B, Lq, k]
        # Picks that landed on incomplete blocks (fewer complete blocks than k) go to a spare column.
        top_ids = torch.where(top_values > float("-inf"), top_ids, num_blocks)  # [B, Lq, k]
        chosen = torch.zeros(*scores.shape[:2], num_blocks + 1, dtype=torch.bool, device=device)  # [B, Lq, nb+1]
        chosen.scatter_(-1, top_ids, True)
        chosen[..., num_blocks] = False
        chosen_keys = chosen.index_select(-1, key_block.clamp(max=num_blocks))  # [B, Lq, S]
    else:
        chosen_keys = torch.zeros_like(causal)
    allowed = causal & (~in_complete | chosen_keys)  # [B, Lq, S]
    return allowed | ~valid[:, :, None]

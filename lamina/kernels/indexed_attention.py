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

Ties. Block scores are sums of ReLUs, so they are often exactly 0 and the top-k has ties. Which
tied block a query gets must depend on its own scores and its own number of complete blocks
only, never on how far its score row was padded (the longest request of the step, the chunk's
later queries). `select_top_blocks` makes that choice per query over exactly its complete blocks:

- on the CPU (the reference path) with `torch.topk` over each query's `num_complete` scores,
  i.e. the very call transformers makes, so ties resolve as there;
- on other devices by the canonical rule "higher score first, equal scores: lower block index
  first" (a stable descending sort), which padding with -inf cannot change and which needs no
  host sync.
"""

from __future__ import annotations

import math

import torch

from lamina.kernels.varlen import padded_index, query_lens, to_padded

__all__ = ["block_scores", "pool_block_keys", "qsa_key_mask", "select_top_blocks"]


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
        scores = block_scores(to_padded(q, index, valid), block_keys)  # [B, Lq, nb]
        # Padded query rows select nothing (their key rows are all True below anyway).
        candidates = torch.where(valid, num_complete, 0).clamp(max=num_blocks)  # [B, Lq]
        chosen = select_top_blocks(scores, candidates, top_blocks)  # [B, Lq, nb]
        chosen = torch.cat([chosen, chosen.new_zeros(*chosen.shape[:2], 1)], dim=-1)  # [B, Lq, nb+1]: spare column
        chosen_keys = chosen.index_select(-1, key_block.clamp(max=num_blocks))  # [B, Lq, S]
    else:
        chosen_keys = torch.zeros_like(causal)
    allowed = causal & (~in_complete | chosen_keys)  # [B, Lq, S]
    return allowed | ~valid[:, :, None]


def block_scores(queries: torch.Tensor, block_keys: torch.Tensor) -> torch.Tensor:
    """Scores `sum_h relu(q_h . k_block) / sqrt(D)` in float32.

    Args:
        queries: `[B, Lq, Hi, D]` indexer queries in the padded layout; block_keys: `[B, nb, D]`.

    Returns:
        `[B, Lq, nb]` float32. One function for the reference mask and the graph-safe decode
        (lamina.kernels.qsa_decode), so both compute every score the same way.
    """
    scores = torch.einsum("blhd,bnd->blhn", queries.float(), block_keys.float())  # [B, Lq, Hi, nb]
    return scores.relu().sum(dim=2) / math.sqrt(queries.shape[-1])  # [B, Lq, nb]


def select_top_blocks(scores: torch.Tensor, num_candidates: torch.Tensor, top_blocks: int) -> torch.Tensor:
    """Each row's `top_blocks` highest-scoring blocks among its first `num_candidates` (all of them
    when it has fewer), chosen over exactly those candidates (see the module docstring on ties).

    Args:
        scores: `[..., nb]` float block scores; entries past a row's candidates are ignored;
        num_candidates: `[...]` long, each row's number of complete blocks, in [0, nb];
        top_blocks: host int, blocks kept per row.

    Returns:
        `[..., nb]` bool, True for the chosen blocks.
    """
    num_blocks = scores.shape[-1]
    block_ids = torch.arange(num_blocks, device=scores.device)  # [nb]
    is_candidate = block_ids < num_candidates[..., None]  # [..., nb]
    if top_blocks >= num_blocks:
        return is_candidate
    if scores.device.type == "cpu":
        return _select_like_reference(scores, num_candidates, top_blocks, is_candidate)
    return _select_canonical(scores, num_candidates, top_blocks)


def _select_canonical(scores: torch.Tensor, num_candidates: torch.Tensor, top_blocks: int) -> torch.Tensor:
    """Higher score first; equal scores: lower block index first. A stable descending sort keeps
    equal scores in block order and the -inf of non-candidates sorts them after every candidate,
    so padding never reorders a row's candidates. No host sync (graph-capturable)."""
    num_blocks = scores.shape[-1]
    is_candidate = torch.arange(num_blocks, device=scores.device) < num_candidates[..., None]  # [..., nb]
    k = min(top_blocks, num_blocks)
    masked = scores.float().masked_fill(~is_candidate, float("-inf"))  # [..., nb]
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]  # [..., k]
    in_row = torch.gather(is_candidate, -1, order)  # [..., k]: False where a row has fewer than k
    return torch.zeros_like(is_candidate).scatter_(-1, order, in_row)


def _select_like_reference(
    scores: torch.Tensor, num_candidates: torch.Tensor, top_blocks: int, is_candidate: torch.Tensor
) -> torch.Tensor:
    """CPU reference: rows with more candidates than `top_blocks` run `topk` over exactly their
    candidates, one call per distinct candidate count (so ties fall as in transformers, which calls
    `topk` on each query's complete blocks). Rows with fewer keep all of them. CPU only: it reads
    the distinct counts on the host."""
    num_blocks = scores.shape[-1]
    flat_scores = scores.reshape(-1, num_blocks)  # [N, nb]
    flat_counts = num_candidates.reshape(-1)  # [N]
    chosen = is_candidate.reshape(-1, num_blocks).clone()  # [N, nb]
    for count in torch.unique(flat_counts[flat_counts > top_blocks]).tolist():
        rows = torch.nonzero(flat_counts == count).squeeze(1)  # [n_rows]
        top_ids = flat_scores.index_select(0, rows)[:, :count].topk(top_blocks, dim=-1).indices  # [n_rows, k]
        picked = torch.zeros(rows.shape[0], num_blocks, dtype=torch.bool)
        chosen.index_copy_(0, rows, picked.scatter_(-1, top_ids, True))
    return chosen.reshape(is_candidate.shape)

"""Graph-safe one-token decode of QSA indexed attention (Qwen4-Exp), over the paged caches.

The reference (`lamina.kernels.indexed_attention.qsa_key_mask` + `paged_attention` with a key
mask) builds `[B, Lq, ctx]` masks and gathers every request's whole context, with `ctx` following
the step's longest request. For a decode step (one query per request, at position
p = seq_len - 1) this module does the same selection with shapes fixed by host ints that do not
change from step to step inside a CUDA graph (the batch size, the block-table width, the budget):

1. `decode_block_selection` (torch; on the Triton kernel set `lamina.kernels.triton_qsa` scores
   the blocks, reading only each request's complete ones): the query's scores over `nb` block
   keys (`nb` = the step's
   `max_seq_len // ratio`; a graph passes the block-table capacity, so `nb` is bounded by
   `max_model_len`, never by the step's lengths) and the chosen blocks, by
   `select_top_blocks` over exactly the query's `(p + 1) // ratio` complete blocks, i.e. the
   same call, the same candidates and the same tie rule as the reference on that device.
2. `qsa_decode_attention`: attention of the query over at most `top_blocks * ratio + ratio`
   keys: the tokens of the chosen blocks and of the incomplete tail block (positions
   `(p + 1) // ratio * ratio .. p`), gathered from the paged K/V through the block table and
   masked where a slot is unused. Keys are visited in another order than the reference's
   whole-context softmax, so results agree up to float rounding.

Everything reads lengths from device tensors (`seq_lens`, `block_tables`) and never reads a
tensor value on the host (on the CPU, `select_top_blocks` takes its reference path, which does:
that is the CPU oracle's own tie rule, and CPUs do not capture graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.indexed_attention import block_scores, select_top_blocks
from lamina.kernels.paged_attention import gather_slots

__all__ = ["decode_block_selection", "qsa_decode_attention", "select_decode_blocks"]


def decode_block_selection(
    query: torch.Tensor, block_keys: torch.Tensor, seq_lens: torch.Tensor, ratio: int, top_blocks: int,
) -> torch.Tensor:
    """Which complete blocks each decode query reads.

    Args:
        query: `[B, Hi, D]` indexer queries (normed, rotated at their positions);
        block_keys: `[B, nb, D]` block keys (blocks past a request's length hold anything);
        seq_lens: `[B]` context length after this step (the query sits at seq_len - 1);
        ratio: tokens per block; top_blocks: complete blocks kept per query.

    Returns:
        `[B, nb]` bool, True for the chosen blocks (only complete ones).
    """
    if block_keys.shape[1] == 0 or top_blocks <= 0:
        return torch.zeros(block_keys.shape[:2], dtype=torch.bool, device=block_keys.device)
    scores = block_scores(query[:, None], block_keys)[:, 0]  # [B, 1, nb] -> [B, nb]
    return select_decode_blocks(scores, seq_lens, ratio, top_blocks)


def select_decode_blocks(scores: torch.Tensor, seq_lens: torch.Tensor, ratio: int, top_blocks: int) -> torch.Tensor:
    """scores `[B, nb]` (any value past a request's complete blocks) -> chosen blocks `[B, nb]` bool:
    `select_top_blocks` over each query's `(p + 1) // ratio` complete blocks."""
    num_blocks = scores.shape[1]
    if num_blocks == 0 or top_blocks <= 0:
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    complete = torch.div(seq_lens.long(), ratio, rounding_mode="floor").clamp(max=num_blocks)  # [B]: (p+1)//ratio
    return select_top_blocks(scores, complete, top_blocks)  # [B, nb]


def _key_positions(chosen: torch.Tensor, seq_lens: torch.Tensor, ratio: int, top_blocks: int):
    """The key positions a decode query reads, in a fixed number of columns.

    Returns (positions `[B, K]` long, valid `[B, K]` bool) with K = min(top_blocks, nb) * ratio
    + ratio: the chosen blocks' tokens (block order), then the tail block's tokens up to p.
    Invalid columns hold position 0."""
    bsz, num_blocks = chosen.shape
    device = chosen.device
    in_block = torch.arange(ratio, device=device)  # [r]
    last = seq_lens.long() - 1  # [B]: the query's position p
    columns = []
    valid = []
    k = min(max(top_blocks, 0), num_blocks)
    if k > 0:
        # Chosen blocks first, lower ids first: a unique key per block, so topk has no ties.
        ids = torch.arange(num_blocks, device=device)  # [nb]
        order_key = chosen.long() * num_blocks + (num_blocks - 1 - ids)  # [B, nb]
        picked = order_key.topk(k, dim=-1).indices  # [B, k]
        picked_ok = chosen.gather(1, picked)  # [B, k]
        columns.append((picked[:, :, None] * ratio + in_block).reshape(bsz, k * ratio))  # [B, k*r]
        valid.append(picked_ok[:, :, None].expand(bsz, k, ratio).reshape(bsz, k * ratio))  # [B, k*r]
    tail = torch.div(last + 1, ratio, rounding_mode="floor")[:, None] * ratio + in_block  # [B, r]
    columns.append(tail)
    valid.append(tail <= last[:, None])
    positions = torch.cat(columns, dim=1)  # [B, K]
    valid = torch.cat(valid, dim=1)  # [B, K]
    return positions.masked_fill(~valid, 0), valid


def qsa_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    chosen: torch.Tensor,
    ratio: int,
    top_blocks: int,
    scale: float,
) -> torch.Tensor:
    """One query per request over its chosen blocks and its tail block.

    Args:
        query: `[B, Hq, D]` (normed, rotated); k_cache, v_cache: `[num_blocks, block_size, Hkv, D]`
            already holding this step's keys; block_tables: `[B, max_blocks]`; seq_lens: `[B]`
            (>= 1, padded graph rows included); chosen: `[B, nb]` bool from
            `decode_block_selection`; ratio, top_blocks: the indexer's block size and count;
            scale: softmax scale.

    Returns:
        `[B, Hq, D]` in query's dtype.
    """
    bsz, num_q_heads, _ = query.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    positions, valid = _key_positions(chosen, seq_lens, ratio, top_blocks)  # [B, K]
    pages = block_tables.long().gather(1, torch.div(positions, page, rounding_mode="floor"))  # [B, K]
    slots = pages * page + positions % page  # [B, K]
    keys = gather_slots(k_cache, slots)  # [B, K, Hkv, D] (an FP8 cache: gathered as its bytes)
    values = gather_slots(v_cache, slots)  # [B, K, Hkv, D]
    out = F.scaled_dot_product_attention(
        query[:, :, None],  # [B, Hq, 1, D]
        keys.transpose(1, 2).to(query.dtype),  # [B, Hkv, K, D]
        values.transpose(1, 2).to(query.dtype),  # [B, Hkv, K, D]
        attn_mask=valid[:, None, None, :],  # [B, 1, 1, K]
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    )  # [B, Hq, 1, D]
    return out[:, :, 0]  # [B, Hq, D]

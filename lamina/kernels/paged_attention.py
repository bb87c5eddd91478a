"""Paged KV cache write and causal attention over it, for a flat varlen batch.

Cache layout: `[num_blocks, block_size, Hkv, D]`; token slot = block_id * block_size + offset.
A request's logical position p lives in block `block_tables[b, p // block_size]` at offset
`p % block_size`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lamina.kernels.varlen import flat_positions, from_padded, padded_index, query_lens, to_padded

__all__ = ["write_kv_cache", "write_paged_rows", "gather_paged_context", "gather_slots", "paged_attention",
           "to_cache_dtype"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`rows` as a cache of `dtype` stores them: an FP8 cache (kv_cache_dtype fp8, scale 1.0) clamps
    to the format's finite range, then rounds to nearest even (as the Triton writers convert)."""
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        return rows.clamp(-limit, limit).to(dtype)
    return rows.to(dtype)

# SDPA backends in order of preference for the causal rule (fresh prompts) on CUDA. SDPA's own
# choice there is cuDNN, which builds an execution plan for every new shape: on an H200, 66-103 ms
# at each new prompt length with GQA, against 0.07-0.99 ms for the attention itself (2 KV heads,
# benchmarks/results/bench_sdpa_shapes_gqa_h200.json). Prompt lengths rarely repeat in serving, so
# flash, which has no per-shape cost (0.11 ms at 1k, 2.05 ms at 8k), comes first. The masked path
# keeps SDPA's choice: with GQA and a mask only cuDNN (and the math fallback) take it.
CAUSAL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]


def _write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> None:
    """`cache.view(S, ...)[slots[t]] = rows[t]` for valid t, without a host sync.

    Invalid rows are redirected to slot 0 and carry the value slot 0 must hold afterwards:
    the row of a valid token that writes slot 0 if there is one, else slot 0's current
    contents. Every duplicate write of slot 0 then carries the same value, so the
    (unspecified) order of duplicate writes in index_copy_ does not matter.
    """
    flat = cache.view(-1, *cache.shape[2:])  # [num_blocks*block_size, Hkv, D]
    rows = to_cache_dtype(rows, cache.dtype)
    if cache.dtype in FP8_DTYPES:  # few torch ops take FP8 (index_copy_ none on the CPU): the same bytes as uint8
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    hits0 = valid & (slots == 0)  # [T]
    first0 = hits0.to(torch.int32).argmax().reshape(1)  # [1]: first valid writer of slot 0 (0 if none)
    fill = torch.where(hits0.any(), rows.index_select(0, first0)[0], flat[0])  # [Hkv, D]
    src = torch.where(valid[:, None, None], rows, fill)  # [T, Hkv, D]
    dst = torch.where(valid, slots, torch.zeros_like(slots))  # [T]
    flat.index_copy_(0, dst, src)


def write_paged_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `rows [T, H, D]` in a paged cache `[num_blocks, block_size, H, D]` at `slot_mapping [T]`
    (entries < 0 skipped), in place: the writer of `write_kv_cache`, for any one paged tensor."""
    if rows.shape[0] == 0:
        return
    slots = slot_mapping.long()
    _write_rows(cache, rows, slots, slots >= 0)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's keys/values in the paged caches, in place.

    Args:
        k, v: `[T, Hkv, D]`; k_cache, v_cache: `[num_blocks, block_size, Hkv, D]` (contiguous);
        slot_mapping: `[T]` int; entries < 0 (padding tokens) are skipped.
    """
    if k.shape[0] == 0:
        return
    slots = slot_mapping.long()
    valid = slots >= 0  # [T]
    _write_rows(k_cache, k, slots, valid)
    _write_rows(v_cache, v, slots, valid)


def gather_paged_context(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks_used: int) -> torch.Tensor:
    """Each request's first `num_blocks_used` cache blocks in logical order:
    `[num_blocks, block_size, H, D]` x block_tables `[B, >= nb]` -> `[B, nb*block_size, H, D]`."""
    block_size = cache.shape[1]
    blocks = block_tables[:, :num_blocks_used].long()  # [B, nb]
    in_block = torch.arange(block_size, device=cache.device)  # [bs]
    slots = (blocks[:, :, None] * block_size + in_block).reshape(blocks.shape[0], -1)  # [B, nb*bs]
    return gather_slots(cache, slots)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`[num_blocks, block_size, Hkv, D]` x slots `[B, S]` -> `[B, S, Hkv, D]`."""
    flat = cache.view(-1, *cache.shape[2:])  # [num_blocks*block_size, Hkv, D]
    if cache.dtype in FP8_DTYPES:  # gathered as bytes (FP8 has few torch kernels), read back as FP8
        rows = flat.view(torch.uint8).index_select(0, slots.reshape(-1)).view(cache.dtype)  # [B*S, Hkv, D]
    else:
        rows = flat.index_select(0, slots.reshape(-1))  # [B*S, Hkv, D]
    return rows.reshape(*slots.shape, *cache.shape[2:])  # [B, S, Hkv, D]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    key_mask: torch.Tensor | None = None,
    groups: list | None = None,
    causal_from_start: bool = False,
    fast_groups: bool = False,
    gate: torch.Tensor | None = None,
    varlen: bool = False,
    decodes_only: bool = False,
    fresh_varlen: bool = False,
) -> torch.Tensor:
    """Causal attention of each request's new queries over its cached context.

    Args:
        q: `[T, Hq, D]`; k_cache, v_cache: `[num_blocks, block_size, Hkv, D]`, already holding
            this step's keys/values; block_tables: `[B, max_blocks]` int (unused entries any
            valid block id); seq_lens: `[B]` context length including this step's tokens;
            query_start_loc: `[B+1]`; max_query_len, max_seq_len: host ints; scale: softmax scale;
            key_mask: optional `[B, max_query_len, S]` bool (S = ceil(max_seq_len / block_size) *
            block_size, padded query layout): keys a query may read besides the causal rule
            (sparse attention); every valid query must keep at least one causal key, and padded
            query rows must keep key 0. Or a function of a request group (None: the whole step)
            that returns that mask for the group's requests, so no whole-step mask is built.
        groups: optional request groups (lamina.kernels.request_groups, by context length): one
            call per group, so no request's queries and context are padded to another's much
            longer ones. Same results.
        causal_from_start: the caller knows (from the plan, on the host) that every request's
            queries start at position 0 (fresh prompts: seq_lens equal the query lengths) and there
            is no key_mask: then SDPA takes its own top-left causal rule (`is_causal`) instead of a
            built [B, Lq, S] mask, and its kernels skip the blocks above the diagonal (an 8k prompt
            on an H200: 0.88 against 4.26 ms per layer, equal outputs,
            benchmarks/results/bench_prefill_attention_h200.json). Same rule: query i of a fresh
            request sees keys 0..i, all inside its context.
        fast_groups: with no key_mask, on the Triton kernel set: a step or request group of
            one-query requests (decodes riding a prefill step) runs the Triton paged decode kernel
            that pure decode steps run (`lamina.kernels.triton_decode`), so a decode's attention
            is computed the same way whatever shares its step, and a group of fresh prompts
            (`RequestGroup.from_start`) takes the causal rule; neither needs the masked SDPA call
            (cuDNN's, which builds a plan for every new shape: 70-95 ms on an H200,
            benchmarks/results/bench_sdpa_shapes_gqa_h200.json).
        gate: optional `[T, Hq, D]` output gate: the result becomes attn * sigmoid(gate) (the decode
            kernel of a decode group applies it as decode steps' kernel does, the same compiled
            variant; every other call multiplies afterwards).
        varlen: with no key_mask, on the Triton kernel set: queries that continue cached context
            (prompt chunks after the first, verification chunks riding a prefill step) run
            lamina's varlen paged kernel (`lamina.kernels.triton_prefill_attention`) instead of
            the masked SDPA call, with the gate inside; fresh prompts keep the causal rule and
            decodes the decode kernel (the attention layer then plans groups by kind,
            `request_groups.plan_groups(by_kind=True)`). On an H200 a 4k chunk over 4k of
            context took 4.2 against 20.9 ms, and no per-shape plan (cuDNN's masked call: 195 ms
            at its first 4k shape), benchmarks/results/bench_varlen_attention_h200.json.
        decodes_only: the caller knows from the step's metadata (host ints) that every request has
            exactly one query; with `fast_groups` and no groups, the step runs the decode kernel.
        fresh_varlen: with `varlen`, fresh prompts run the varlen kernel too instead of SDPA's
            causal rule (`selection.fresh_prompt_varlen_enabled`).

    Query i of request b (q_len_b queries) sits at position seq_lens[b] - q_len_b + i and
    attends to keys 0..that position. Query head h reads kv head h // (Hq // Hkv).

    Returns:
        `[T, Hq, D]` in q's dtype.
    """
    if groups is not None:
        return _grouped(q, k_cache, v_cache, block_tables, seq_lens, scale, key_mask, groups, causal_from_start,
                        fast_groups and key_mask is None, gate, varlen and key_mask is None, fresh_varlen)
    if callable(key_mask):
        key_mask = key_mask(None)
    causal_from_start = causal_from_start and key_mask is None
    if fast_groups and key_mask is None and decodes_only:  # the decode steps' kernel
        return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, gate)
    if varlen and key_mask is None and (fresh_varlen or not causal_from_start):
        return _varlen(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, gate)
    total_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    bsz = query_start_loc.shape[0] - 1
    max_len = max(1, max_query_len)
    num_blocks_used = max(1, -(-max_seq_len // block_size))
    ctx_len = num_blocks_used * block_size  # S: whole blocks, masked beyond seq_lens
    device = q.device

    # Context slots of every request, in logical order.
    blocks = block_tables[:, :num_blocks_used].long()  # [B, nb]
    in_block = torch.arange(block_size, device=device)  # [bs]
    slots = (blocks[:, :, None] * block_size + in_block).reshape(bsz, ctx_len)  # [B, S]
    if causal_from_start:  # no valid query reads past key max_len - 1: square scores, as SDPA's causal kernels want
        slots = slots[:, :max_len]  # [B, S = Lq]
    keys = gather_slots(k_cache, slots)  # [B, S, Hkv, D]
    values = gather_slots(v_cache, slots)  # [B, S, Hkv, D]

    index, valid = padded_index(query_start_loc, max_len)  # [B, Lq]
    queries = to_padded(q, index, valid)  # [B, Lq, Hq, D]

    mask = None
    if not causal_from_start:
        # Causal mask in absolute positions; padded query rows still see key 0, so no row is empty.
        seq = seq_lens.long()  # [B]
        q_pos = (seq - query_lens(query_start_loc))[:, None] + torch.arange(max_len, device=device)  # [B, Lq]
        k_pos = torch.arange(ctx_len, device=device)  # [S]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq[:, None, None])  # [B, Lq, S]
        if key_mask is not None:
            mask = mask & key_mask

    # KV heads are shared by query-head groups inside SDPA (enable_gqa), never expanded: on an H200
    # a batch-64 decode over 4096 tokens took 0.22 ms and no extra memory this way, 5.5 ms and
    # 4 GiB with expanded copies (benchmarks/results/sdpa_gqa_h200.json).
    backends = sdpa_kernel(CAUSAL_BACKENDS, set_priority=True) if mask is None and q.is_cuda else contextlib.nullcontext()
    with backends:
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),  # [B, Hq, Lq, D]
            keys.transpose(1, 2).to(q.dtype),  # [B, Hkv, S, D]
            values.transpose(1, 2).to(q.dtype),  # [B, Hkv, S, D]
            attn_mask=None if mask is None else mask[:, None],  # [B, 1, Lq, S]
            is_causal=mask is None,  # top-left: query i sees keys 0..i (fresh prompts only, above)
            scale=scale,
            enable_gqa=group > 1,
        )  # [B, Hq, Lq, D]
    out = out.transpose(1, 2)  # [B, Lq, Hq, D]
    flat = flat_positions(query_start_loc, max_len, total_tokens)  # [T]
    out = from_padded(out, valid, flat)  # [T, Hq, D]
    return out if gate is None else out * torch.sigmoid(gate)


def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, gate):
    from lamina.kernels import triton_decode  # Triton: only on the fast kernel set

    return triton_decode.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, gate=gate)


def _varlen(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, gate):
    from lamina.kernels import triton_prefill_attention  # Triton: only on the fast kernel set

    return triton_prefill_attention.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, gate=gate,
    )  # [T, Hq, D], gated


def _grouped(q, k_cache, v_cache, block_tables, seq_lens, scale, key_mask, groups, causal_from_start, fast_groups,
             gate, varlen, fresh_varlen):
    """`paged_attention` once per request group; outputs scattered back in batch order."""
    out = torch.empty_like(q)  # [T, Hq, D]
    block_size = k_cache.shape[1]
    for group in groups:
        group_gate = None if gate is None else gate.index_select(0, group.tokens)  # [Tg, Hq, D]
        if fast_groups and group.max_query_len == 1:  # decodes: the paged decode kernel of decode steps
            result = _decode(q.index_select(0, group.tokens), k_cache, v_cache,
                             block_tables.index_select(0, group.requests), seq_lens.index_select(0, group.requests),
                             scale, group_gate)  # [Tg, Hq, D]
            out.index_copy_(0, group.tokens, result)
            continue
        if varlen and (fresh_varlen or not (causal_from_start or group.from_start)):  # continued chunks: varlen
            result = _varlen(q.index_select(0, group.tokens), k_cache, v_cache,
                             block_tables.index_select(0, group.requests), seq_lens.index_select(0, group.requests),
                             group.query_start_loc, group.max_query_len, scale, group_gate)  # [Tg, Hq, D]
            out.index_copy_(0, group.tokens, result)
            continue
        mask = None
        if callable(key_mask):
            mask = key_mask(group)
        elif key_mask is not None:  # the step's padded layout: keep the group's rows, queries and keys
            ctx_len = max(1, -(-group.max_seq_len // block_size)) * block_size
            mask = key_mask.index_select(0, group.requests)[:, : max(1, group.max_query_len), :ctx_len]
        result = paged_attention(
            q.index_select(0, group.tokens), k_cache, v_cache, block_tables.index_select(0, group.requests),
            seq_lens.index_select(0, group.requests), group.query_start_loc, group.max_query_len,
            group.max_seq_len, scale, key_mask=mask,
            causal_from_start=causal_from_start or (fast_groups and group.from_start), gate=group_gate,
        )
        out.index_copy_(0, group.tokens, result)
    return out

"""Prompt logprobs: score every prompt position of the chunks whose request asked for them.

A chunk covering positions [start, end) of a request with a P-token prompt scores positions
p < P - 1: the hidden state at p predicts the prompt token at p + 1, which is the chunk's next
token id (or the chunk's `next_token_id` for its last position). With chunked prefill every chunk
scores its own positions in its step, so the whole prompt is covered once prefill ends.

Logits are computed in pieces of at most `PROMPT_LOGPROBS_ROWS` positions, so a long prompt never
materialises a [T, vocab] float32 tensor: each piece is [rows, vocab], reduced on the device to the
target's logprob and the top-k before the next piece. Rows of a request that asked the whole
vocabulary (`prompt_logprobs=-1`) are sorted and moved to the host piece by piece (what they ask
is vocab entries a position, as in vLLM); other requests' rows stay top-k. Under tensor parallelism `compute_logits` is
a collective; every rank of the last stage runs the same pieces (the plan decides them).
"""

from __future__ import annotations

from typing import Sequence

import torch

from lamina.host_to_device import to_device
from lamina.outputs import Logprob
from lamina.step_plan import ScheduledChunk

__all__ = ["PROMPT_LOGPROBS_ROWS", "prompt_positions", "score_prompt_chunks"]

PROMPT_LOGPROBS_ROWS = 256


def prompt_positions(chunk: ScheduledChunk) -> tuple[int, list[int]]:
    """(number of positions to score from the chunk's start, their target token ids)."""
    if not chunk.num_prompt_tokens:
        return 0, []
    count = max(0, min(chunk.end_position, chunk.num_prompt_tokens - 1) - chunk.start_position)
    following = list(chunk.token_ids[1:]) + ([chunk.next_token_id] if chunk.next_token_id is not None else [])
    return count, following[:count]


@torch.inference_mode()
def score_prompt_chunks(
    model, hidden: torch.Tensor, chunks: Sequence[ScheduledChunk], max_rows: int = PROMPT_LOGPROBS_ROWS,
) -> dict[str, tuple[int, list[dict[int, float]], list[int]]]:
    """{request id: (first scored prompt position + 1, [{target: logprob, top-k...}, ...], [the
    target's rank in the vocabulary, 1 = most likely, ...])} for the chunks with prompt logprobs;
    `hidden` is the last stage's [T, H] output of the step."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[str, int, int, int]] = []  # (request id, first target position, count, k; -1: all)
    offset = 0
    for chunk in chunks:
        count, following = prompt_positions(chunk)
        if count:
            if len(following) != count:
                raise ValueError(f"chunk of request {chunk.request_id} lacks the prompt token after its last position")
            rows.extend(range(offset, offset + count))
            targets.extend(following)
            owners.append((chunk.request_id, chunk.start_position + 1, count, int(chunk.sampling_params.prompt_logprobs)))
        offset += chunk.num_tokens
    if not rows:
        return {}
    max_k = max(k for *_, k in owners)  # over the top-k requests (-1 asks the whole vocabulary)
    whole_rows = [j for (_, _, count, k), first in zip(owners, _first_rows(owners)) if k == -1
                  for j in range(first, first + count)]  # rows whose request asked -1
    device = hidden.device
    row_t = to_device(rows, device)
    target_t = to_device(targets, device)
    whole_t = to_device(whole_rows, device) if whole_rows else None
    target_lp, target_rank, top_lp, top_ids = [], [], [], []
    whole: dict[int, tuple[list[int], list[float]]] = {}  # row -> (every token id, its logprob), best first
    for begin in range(0, len(rows), max_rows):
        piece = slice(begin, begin + max_rows)
        logprobs = torch.log_softmax(model.compute_logits(hidden.index_select(0, row_t[piece])).float(), dim=-1)
        target = logprobs.gather(1, target_t[piece].unsqueeze(1))  # [rows, 1]
        target_lp.append(target.squeeze(1))  # [rows]
        target_rank.append((logprobs > target).sum(dim=1) + 1)  # [rows]: 1 + tokens strictly likelier
        if max_k > 0:
            values, ids = logprobs.topk(max_k, dim=-1)  # [rows, k]
            top_lp.append(values)
            top_ids.append(ids)
        if whole_t is not None:  # this piece's rows of -1 requests, sorted, to the host before the next piece
            mine = whole_t[(whole_t >= begin) & (whole_t < begin + max_rows)]  # [W] (one sync a piece, -1 only)
            if mine.numel():
                values, ids = logprobs.index_select(0, mine - begin).sort(dim=-1, descending=True)  # [W, vocab]
                for j, row_ids, row_values in zip(mine.tolist(), ids.tolist(), values.tolist()):
                    whole[j] = (row_ids, row_values)
        del logprobs
    target_list = torch.cat(target_lp).tolist()
    rank_list = torch.cat(target_rank).tolist()
    top_lp_list = torch.cat(top_lp).tolist() if top_lp else [[] for _ in rows]
    top_ids_list = torch.cat(top_ids).tolist() if top_ids else [[] for _ in rows]
    results = {}
    for (request_id, start, count, k), first in zip(owners, _first_rows(owners)):
        entries = []
        for j in range(first, first + count):
            entry = {targets[j]: Logprob(target_list[j], rank_list[j])}
            best_ids, best_values = whole[j] if k == -1 else (top_ids_list[j][:k], top_lp_list[j][:k])
            for rank, (tok, lp) in enumerate(zip(best_ids, best_values), start=1):
                entry.setdefault(tok, Logprob(lp, rank))
            entries.append(entry)
        results[request_id] = (start, entries, rank_list[first:first + count])
    return results


def _first_rows(owners: list[tuple[str, int, int, int]]) -> list[int]:
    """Each owner's first row among the scored rows (owners' rows are consecutive, in order)."""
    firsts, row = [], 0
    for _, _, count, _ in owners:
        firsts.append(row)
        row += count
    return firsts

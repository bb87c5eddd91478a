"""Groups of requests of similar size, so the padded reference kernels never pad a whole batch to
its longest request.

The varlen kernels in this package pad every request of a step to the step's longest query
(delta rule, causal conv) and, for attention, to its longest context. A step that mixes many
decoding requests with one long prompt chunk (continuous batching does this all the time) would
then pad, say, 200 one-token requests to 8000 tokens: hundreds of GB at real width. Splitting the
requests into groups whose padded size stays near their real size bounds that, at the price of
one kernel call per group. Steps that need no split (all decodes, uniform verification chunks,
a lone prefill) keep a single call and pay nothing.

Groups are planned from host ints the step plan already has (`ForwardMetadata.query_lens_host`,
`seq_lens_host`), never from tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from lamina.host_to_device import to_device

__all__ = ["RequestGroup", "plan_groups", "build_groups", "enabled", "check_group_capture"]


def enabled() -> bool:
    """`LAMINA_REQUEST_GROUPS=0` turns splitting off (to measure what it saves). Read by the model
    runner when it is built (`ForwardMetadata.allow_groups`), never inside a forward."""
    return os.environ.get("LAMINA_REQUEST_GROUPS", "1") != "0"

# A group may pad to at most PAD_FACTOR x its real size plus SLACK (in query tokens for the
# delta rule and conv, in context tokens for attention) before the planner starts a new group.
PAD_FACTOR = 2
TOKEN_SLACK = 4096
CONTEXT_SLACK = 1 << 16
SHORT_QUERY = 16  # attention: decode / verification queries are never grouped with prompt chunks
# Attention gathers each group's context as [B_g, S_g] rows (S_g its longest context): at most
# this many rows per group, so 256 decodes at 32k context run as 16 groups, not one 68 GB gather.
CONTEXT_ROWS_CAP = 1 << 19


@dataclass
class RequestGroup:
    requests: torch.Tensor  # [Bg] long: the group's requests (rows of the step's batch)
    tokens: torch.Tensor  # [Tg] long: their tokens' rows in the flat batch, request by request
    query_start_loc: torch.Tensor  # [Bg+1] long: cumulative query lengths inside the group
    num_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    # every member's queries start at position 0 (a fresh prompt: its context is its queries), from
    # the host lengths; attention may take SDPA's own causal rule for such a group
    from_start: bool = False
    # Speculative state capture inside the group: (req [Rg] group-local, offset [Rg], max offset),
    # and which rows of the step's capture list they are ([Rg]); None when the group has none.
    capture: tuple[torch.Tensor, torch.Tensor, int] | None = None
    capture_rows: torch.Tensor | None = None


def _greedy(order: list[int], size: Sequence[int], slack: int, cap: int | None = None) -> list[list[int]]:
    """Walk requests in ascending `size`; close a group when adding the next request would pad it
    beyond PAD_FACTOR x its real size + slack, or its padded size beyond `cap`."""
    groups: list[list[int]] = [[]]
    total = 0
    for r in order:
        current = groups[-1]
        padded = (len(current) + 1) * size[r]
        if current and (padded > PAD_FACTOR * (total + size[r]) + slack or (cap is not None and padded > cap)):
            groups.append([])
            current, total = groups[-1], 0
        current.append(r)
        total += size[r]
    return groups


def plan_groups(
    query_lens: Sequence[int], seq_lens: Sequence[int] | None = None, by_kind: bool = False,
    fresh_with_continued: bool = False,
) -> list[list[int]] | None:
    """Request indices per group, each in batch order; None when one call over the whole batch
    pads little enough. Without `seq_lens`: groups by query length (delta rule, conv). With
    them: short queries (decode, verification) apart from prompt chunks, then by context length
    (attention). With them and `by_kind` (attention on the Triton set, whose decode and varlen
    kernels pad nothing): one group of one-token decodes, one of queries that continue cached
    context, and fresh prompts (context = queries) by context length, for SDPA's causal call;
    None only when the step holds one group. `fresh_with_continued` (fresh prompts on the varlen
    kernel too, `LAMINA_FRESH_PROMPT_ATTENTION=varlen`): the fresh prompts join the continued
    chunks' group, so a step is at most two calls."""
    n = len(query_lens)
    if by_kind and seq_lens is not None:
        decodes = [r for r in range(n) if query_lens[r] == 1]
        fresh = [r for r in range(n) if query_lens[r] > 1 and seq_lens[r] == query_lens[r]]
        continued = [r for r in range(n) if query_lens[r] > 1 and seq_lens[r] != query_lens[r]]
        groups = [decodes, continued + fresh] if fresh_with_continued else [decodes, continued]
        if fresh and not fresh_with_continued:
            groups += _greedy(sorted(fresh, key=lambda r: seq_lens[r]), seq_lens, CONTEXT_SLACK, CONTEXT_ROWS_CAP)
        groups = [sorted(g) for g in groups if g]
        return groups if len(groups) > 1 else None
    if n <= 1:
        return None
    if seq_lens is None:
        if n * max(query_lens) <= PAD_FACTOR * sum(query_lens) + TOKEN_SLACK:
            return None
        groups = _greedy(sorted(range(n), key=lambda r: query_lens[r]), query_lens, TOKEN_SLACK)
    else:
        short = [r for r in range(n) if query_lens[r] <= SHORT_QUERY]
        long = [r for r in range(n) if query_lens[r] > SHORT_QUERY]
        padded = n * max(query_lens) * max(seq_lens)
        real = sum(q * s for q, s in zip(query_lens, seq_lens))
        if padded <= PAD_FACTOR * real + CONTEXT_SLACK and n * max(seq_lens) <= CONTEXT_ROWS_CAP:
            return None
        groups = []
        for part in (short, long):
            if part:
                order = sorted(part, key=lambda r: seq_lens[r])
                groups += _greedy(order, seq_lens, CONTEXT_SLACK, CONTEXT_ROWS_CAP)
    groups = [sorted(g) for g in groups if g]
    return groups if len(groups) > 1 else None


def build_groups(
    requests_per_group: list[list[int]],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    device,
    capture_host: tuple[Sequence[int], Sequence[int]] | None = None,
) -> list[RequestGroup]:
    """Device index tensors of planned groups (a handful of small host-to-device copies)."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)

    groups = []
    for members in requests_per_group:
        tokens = [t for r in members for t in range(starts[r], starts[r] + query_lens[r])]
        qsl = [0]
        for r in members:
            qsl.append(qsl[-1] + query_lens[r])
        group = RequestGroup(
            requests=to_device(members, device), tokens=to_device(tokens, device),
            query_start_loc=to_device(qsl, device),
            num_tokens=len(tokens), num_reqs=len(members), max_query_len=max(query_lens[r] for r in members),
            max_seq_len=max(seq_lens[r] for r in members),
            from_start=all(seq_lens[r] == query_lens[r] for r in members),
        )
        if capture_host is not None:
            local = {r: i for i, r in enumerate(members)}
            rows = [j for j, r in enumerate(capture_host[0]) if r in local]
            if rows:
                offsets = [capture_host[1][j] for j in rows]
                local_req = [local[capture_host[0][j]] for j in rows]
                group.capture = (to_device(local_req, device), to_device(offsets, device), max(offsets))
                group.capture_rows = to_device(rows, device)
        groups.append(group)
    return groups


def check_group_capture(capture, groups: list[RequestGroup]) -> None:
    """Groups must cover every captured token (built with the step's capture list), or the
    grouped kernels would return unwritten rows. Host shapes only: no device sync."""
    covered = sum(g.capture_rows.shape[0] for g in groups if g.capture_rows is not None)
    if covered != capture[0].shape[0]:
        raise ValueError(
            f"request groups cover {covered} of the step's {capture[0].shape[0]} captured tokens: "
            "build them with the capture list (build_groups(..., capture_host=...))"
        )

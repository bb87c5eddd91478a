"""Moving between the flat varlen layout and a padded per-request layout.

A varlen batch holds the tokens of B requests back to back: `x` is `[T, ...]` and
`query_start_loc` (`[B+1]`, cumulative query lengths, starting at 0) says where each
request starts. Many reference kernels are simpler to write over a padded batch
`[B, L, ...]` in which row b holds request b's tokens first and zeros after them.

Everything here stays on the device: the host ints a helper needs (`max_len`,
`total_tokens`) are passed in, so nothing calls `.item()` or boolean-indexes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["padded_index", "flat_positions", "to_padded", "from_padded", "query_lens", "chunk_indices_host"]


def query_lens(query_start_loc: torch.Tensor) -> torch.Tensor:
    """Per-request token counts `[B]` (long) from the cumulative offsets `[B+1]`."""
    starts = query_start_loc.long()
    return starts[1:] - starts[:-1]


def chunk_indices_host(query_lens: Sequence[int], chunk_size: int) -> np.ndarray:
    """`[NT, 2]` int64 on the host: (request, chunk within the request) of every chunk of
    `chunk_size` query tokens, request by request (a request of n tokens has ceil(n / chunk_size)
    chunks, none when n is 0). The chunked kernels' grid over a varlen batch (fla-core's
    `chunk_indices`), built from the plan's host lengths so that no kernel has to derive it from
    `query_start_loc` on the device (which reads a count back to the host)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lens = np.asarray(query_lens, dtype=np.int64)  # [B]
    if (lens < 0).any():
        raise ValueError(f"query lengths must be >= 0, got {list(query_lens)}")
    chunks = -(-lens // chunk_size)  # [B]
    request = np.repeat(np.arange(lens.shape[0], dtype=np.int64), chunks)  # [NT]
    first = np.repeat(np.cumsum(chunks) - chunks, chunks)  # [NT]: each chunk's request's first chunk
    within = np.arange(request.shape[0], dtype=np.int64) - first  # [NT]
    return np.stack([request, within], axis=1)  # [NT, 2]


def padded_index(query_start_loc: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where every padded position `[b, i]` reads from in the flat batch.

    Args:
        query_start_loc: `[B+1]` int tensor of cumulative query lengths.
        max_len: host int, the padded length L (at least the longest request).

    Returns:
        index: `[B, L]` long, `query_start_loc[b] + i` where valid, 0 elsewhere.
        valid: `[B, L]` bool, True for `i < len_b`.
    """
    starts = query_start_loc.long()
    lens = starts[1:] - starts[:-1]  # [B]
    offsets = torch.arange(max_len, device=starts.device)  # [L]
    valid = offsets[None, :] < lens[:, None]  # [B, L]
    index = (starts[:-1, None] + offsets[None, :]).masked_fill(~valid, 0)  # [B, L]
    return index, valid


def flat_positions(query_start_loc: torch.Tensor, max_len: int, total_tokens: int) -> torch.Tensor:
    """For each flat token t, its row in the flattened padded batch `[B*L]`.

    Token t of request b (offset i inside that request) lives at padded `[b, i]`, i.e. row
    `b * max_len + i` once `[B, L, ...]` is viewed as `[B*L, ...]`.

    Returns:
        `[T]` long tensor, T = `total_tokens`.
    """
    starts = query_start_loc.long()
    tokens = torch.arange(total_tokens, device=starts.device)  # [T]
    # request of each token: number of request ends <= t
    req = torch.searchsorted(starts[1:].contiguous(), tokens, right=True)  # [T]
    req = req.clamp(max=starts.shape[0] - 2)  # only matters for malformed offsets
    offset = tokens - starts[req]  # [T]
    return req * max_len + offset


def to_padded(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Flat `[T, ...]` -> padded `[B, L, ...]`, zeros at invalid positions."""
    bsz, max_len = index.shape
    tail = x.shape[1:]
    if x.shape[0] == 0:  # nothing to gather from (host-side shape check, no sync)
        return x.new_zeros((bsz, max_len, *tail))
    rows = x.index_select(0, index.reshape(-1))  # [B*L, ...]
    rows = rows.reshape(bsz, max_len, *tail)  # [B, L, ...]
    mask = valid.reshape(bsz, max_len, *([1] * len(tail)))  # [B, L, 1, ...]
    return rows.masked_fill(~mask, 0)


def from_padded(y: torch.Tensor, valid: torch.Tensor, flat_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Padded `[B, L, ...]` -> flat `[T, ...]`, valid rows in request order.

    Pass `flat_pos` (from `flat_positions`) to gather without a host sync; without it the
    function falls back to boolean masking, which synchronises on CUDA.
    """
    bsz, max_len = y.shape[:2]
    tail = y.shape[2:]
    if flat_pos is None:
        return y[valid]
    rows = y.reshape(bsz * max_len, *tail)  # [B*L, ...]
    return rows.index_select(0, flat_pos)  # [T, ...]

"""Qwen4-Exp N-gram hashing: which table rows a token's n-grams read.

For a PLE module with index `p` (its position in the sorted `ple_layer_ids`):

- window: token t's last `ngram_size` token ids, newest first (`w[t, s]` = the token s places
  back). Tokens before the request's start are EOS. n-grams never cross an EOS: once a shifted
  token (s >= 1) is EOS, every longer shift is EOS too. The token itself (s = 0) may be EOS.
- multipliers: `ngram_size` odd int64 constants from splitmix64 of `seed + 10007 * p` (bounded so
  that `token * multiplier` cannot overflow int64 for token < vocab).
- heads: for every n-gram order n = 2..ngram_size, `heads_per_ngram` heads; global head g
  (counted over all PLE modules, `p * num_heads + local head`) has a prime vocabulary, the
  (g+1)-th prime >= `ngram_vocab_size_base`. Head offsets are the running sum of the sizes.
- row id of head h of order n: `(xor_{s<n} w[t, s] * m[s]) mod size_h + offset_h`.
"""

from __future__ import annotations

import math

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LAYER_STRIDE = 10007
_INT64_MAX = (1 << 63) - 1


def _splitmix64(value: int) -> int:
    value = (value + _GOLDEN) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return value ^ (value >> 31)


def ngram_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """One odd multiplier per window position, below INT64_MAX // vocab_size."""
    half = max(1, (_INT64_MAX // max(vocab_size, 1)) // 2)
    base = seed + _LAYER_STRIDE * ple_index
    return [2 * (_splitmix64((base + _GOLDEN * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(vocab_base: int, ple_index: int, num_heads: int) -> list[int]:
    """Prime vocabulary of each of this module's heads: global heads p*num_heads .. +num_heads-1
    take the successive primes >= vocab_base."""
    wanted = (ple_index + 1) * num_heads
    primes: list[int] = []
    candidate = vocab_base
    while len(primes) < wanted:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes[ple_index * num_heads :]


def ngram_windows(
    token_ids: torch.Tensor,
    history: torch.Tensor,
    token_request_index: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_size: int,
    eos_token_id: int,
) -> torch.Tensor:
    """Each token's window of `ngram_size` ids, newest first, EOS-cut.

    Args:
        token_ids: `[T]` this step's tokens (all requests back to back);
        history: `[B, H]` (H = ngram_size - 1) the H tokens before each request's chunk, oldest
            first, -1 where the request has none;
        token_request_index: `[T]` request of each token; query_start_loc: `[B+1]`.

    Returns:
        `[T, ngram_size]` long.
    """
    num_tokens = token_ids.shape[0]
    span = ngram_size - 1
    device = token_ids.device
    tokens = torch.arange(num_tokens, device=device)  # [T]
    req = token_request_index.long()  # [T]
    offset = tokens - query_start_loc.long()[req]  # [T] place of the token inside its chunk
    shifts = torch.arange(ngram_size, device=device)  # [n]
    src = offset[:, None] - shifts[None, :]  # [T, n] place of the shifted token in the chunk
    in_chunk = token_ids.long()[(tokens[:, None] - shifts[None, :]).clamp(min=0)]  # [T, n]
    # src < 0 reads history column H + src, which lies in [0, H) because shifts <= H.
    in_history = history.long()[req[:, None], (span + src).clamp(0, max(span - 1, 0))]  # [T, n]
    window = torch.where(src >= 0, in_chunk, in_history)  # [T, n]
    window = window.masked_fill(window < 0, eos_token_id)
    crossed = (window[:, 1:] == eos_token_id).cumsum(dim=1) > 0  # [T, n-1]: an EOS at or before this shift
    return torch.cat([window[:, :1], window[:, 1:].masked_fill(crossed, eos_token_id)], dim=1)  # [T, n]


def ngram_row_ids(
    window: torch.Tensor,
    multipliers: torch.Tensor,
    head_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    heads_per_ngram: int,
) -> torch.Tensor:
    """window `[T, n]` -> table rows `[T, (n-1) * heads_per_ngram]` (orders 2..n, heads in order)."""
    products = window * multipliers[None, :]  # [T, n] int64
    mixed = products[:, 0]  # [T]
    rows = []
    for order in range(2, window.shape[1] + 1):  # over n-gram orders (a config constant), not tokens
        mixed = torch.bitwise_xor(mixed, products[:, order - 1])  # [T]
        heads = slice((order - 2) * heads_per_ngram, (order - 1) * heads_per_ngram)
        rows.append(torch.remainder(mixed[:, None], head_sizes[None, heads]) + head_offsets[None, heads])  # [T, hpn]
    return torch.cat(rows, dim=1)  # [T, heads]

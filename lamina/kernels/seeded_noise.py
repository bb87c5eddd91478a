"""Exponential noise of a seeded request, a pure function of (seed, output index, token id).

A seeded request samples its i-th generated token (i counted from 0) with the exponential race
`argmax_v p(v) / E_i(v)` (lamina.worker.sampler), where `E_i(v) = -log U(seed, i, v)` and U is a
counter-based hash in (0, 1): no generator state advances, so the token a request draws at output
index i depends only on its seed, i and its own probabilities there. Not on how many random
numbers it drew before, hence not on:
- the batch (rows share nothing);
- speculative decoding: a verification row at output index i draws the same `E_i` a plain decode
  step would, and the drafter draws its draft for index i with that `E_i` too, so a draft is
  accepted exactly when it equals the token plain sampling would have drawn there (the coupling
  of lamina.worker.rejection_sampler) — the text is the same for every K, fixed or auto;
- preemption, or a step planned before the previous one's accepted count reached the host: the
  output index can be computed on the device (`positions` is a tensor).

The hash: 32-bit words in int64 tensors (no overflow: products are formed from 16-bit halves);
the seed (any int, reduced to 64 bits) and the index become three round keys, and each token id
goes through three rounds of Wellons' `lowbias32` permutation with a key mixed in before each
(a keyed bijection of the token ids: no two ids of a row share a uniform). The uniform is
`(h + 0.5) / 2**32`.

This module is the reference (torch, any device, ~70 elementwise launches per 16 rows);
lamina.kernels.triton_seeded_noise computes the same hash in one launch on the Triton kernel set
(`fill_seeded_exponential` picks, as chosen once per engine).
"""

from __future__ import annotations

import torch

__all__ = ["fill_seeded_exponential", "seed_key", "seeded_exponential", "seeded_hash"]

MASK32 = 0xFFFF_FFFF
M1, M2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
GOLDEN = 0x9E3779B9
ROUND_SALTS = (0x243F6A88, 0x85A308D3, 0x13198A2E)
INDEX_SALT = 0x03707344
ROWS_PER_PASS = 16


def _lowbias32_int(x: int) -> int:
    x &= MASK32
    x ^= x >> 16
    x = (x * M1) & MASK32
    x ^= x >> 15
    x = (x * M2) & MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The 32-bit key of a request's seed (host side): both halves of the seed's 64 bits mixed in."""
    s = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return _lowbias32_int(_lowbias32_int((s & MASK32) ^ GOLDEN) ^ (s >> 32))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) (int64), from 16-bit halves: no intermediate over 2**48."""
    low = (x & 0xFFFF) * c
    high = ((x >> 16) * c) & 0xFFFF
    return (low + (high << 16)) & MASK32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, M1)
    x = x ^ (x >> 15)
    x = _mul32(x, M2)
    return x ^ (x >> 16)


def _round_keys(keys: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
    """The three round keys `[S, 1]` of S rows' seed keys and output indices."""
    keys = keys.to(torch.int64) & MASK32  # [S]
    index = positions.to(torch.int64) & MASK32  # [S]
    round_keys = []
    # the index is mixed before it meets the key: with `keys ^ index`, two seeds whose keys differ by
    # d would share their noise at indices i and i ^ d
    k = _lowbias32(keys ^ _lowbias32(index ^ INDEX_SALT))  # [S]
    for salt in ROUND_SALTS:
        k = _lowbias32(k ^ salt)  # [S]
        round_keys.append(k[:, None])  # [S, 1]
    return round_keys


def _hash_rows(round_keys: list[torch.Tensor], token_ids: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash (int64 values) of `token_ids` `[1, V]` under rows' round keys `[S, 1]` each."""
    h = token_ids
    for rk in round_keys:
        h = _lowbias32((h ^ rk) & MASK32)  # [S, V]
    return h


def seeded_hash(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The hash `h` `[S, vocab_size]` (int64 in [0, 2**32)) behind the noise, whose uniform is
    `(h + 0.5) / 2**32`: for tests that look at particular uniforms (the smallest, the largest)."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)[None, :]  # [1, V]
    return _hash_rows(_round_keys(keys, positions), token_ids)


def seeded_exponential(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exponential(1) noise `[S, vocab_size]` of S seeded rows, the reference.

    keys: `[S]` int64, each row's `seed_key`; positions: `[S]` int64, the output index of the token
    the row samples (on the device; may have been computed there)."""
    round_keys = _round_keys(keys, positions)
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)[None, :]  # [1, V]
    out = torch.empty(keys.shape[0], vocab_size, dtype=dtype, device=keys.device)  # [S, V]
    # ROWS_PER_PASS rows at a time: the int64 temporaries of a verification step's S = B (K + 1) rows
    # at a 248k vocabulary would otherwise take gigabytes
    for start in range(0, keys.shape[0], ROWS_PER_PASS):
        rows = slice(start, start + ROWS_PER_PASS)
        h = _hash_rows([rk[rows] for rk in round_keys], token_ids)  # [rows, V]
        # float64: in float32, (h + 0.5) / 2**32 rounds to 1.0 for the top 2**8 values of h, whose
        # noise would then be 0 and win the race (a 1.5% chance per row at a 248k vocabulary)
        uniform = (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)  # [rows, V] in (0, 1)
        out[rows] = -torch.log(uniform)
    return out  # [S, V]


def fill_seeded_exponential(noise: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                            kernels: str = "torch") -> torch.Tensor:
    """`noise[rows[s]] = E(keys[s], positions[s])` for S seeded rows, in place (`noise` `[B, V]`;
    `rows`, `keys`, `positions` `[S]` int64 on its device). `kernels`: 'torch' (the reference,
    ~70 launches per 16 rows) or 'triton' (one launch, lamina.kernels.triton_seeded_noise: the same
    hash, its float32 logarithm within a few ulps of the reference's float64 one); the choice is
    made once per engine (`lamina.kernels.selection.sampler_kernels`)."""
    if kernels == "triton":
        from lamina.kernels.triton_seeded_noise import fill_seeded_exponential_triton

        return fill_seeded_exponential_triton(noise, rows, keys, positions)
    if kernels != "torch":
        raise ValueError(f"seeded noise kernels {kernels!r} must be 'torch' or 'triton'")
    return noise.index_copy_(0, rows, seeded_exponential(keys, positions, noise.shape[1], noise.dtype))

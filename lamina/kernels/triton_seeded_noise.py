"""A seeded request's exponential noise in one launch (the function and its torch reference:
lamina.kernels.seeded_noise). The reference builds the hash from ~70 elementwise int64 launches per
16 rows; here one program per (row, block of token ids) hashes in uint32 registers (products wrap
mod 2**32 natively) and writes its block straight into the sampler's noise rows.

The hash is integer work, so it equals the reference's bit for bit. The float tail differs: the
reference takes `-log(u)` in float64, where no float64 log is assumed of the GPU; this kernel stays
in float32 and splits at u = 1/2 so that no result loses its relative precision:
- u <= 1/2 (the hash's top bit clear): `-log(u)`, at least ln 2, so a log good to ~2**-22 in
  absolute terms is good to ~3e-7 relatively;
- u > 1/2: t = 1 - u is formed exactly from the hash's complement, and `-log(1 - t) = 2 atanh(z)`
  with z = t / (2 - t) <= 1/3, summed as its odd series to z**13 (truncation ~1e-8 relatively),
  so the smallest noise values keep their precision and none rounds to 0 (the float32 `1 - t`
  would for t < 2**-25: that token would win the race whatever its probability).
So the kernel's noise is the reference's within a few float32 ulps (tests/test_triton_sampler_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.seeded_noise import INDEX_SALT, M1, M2, ROUND_SALTS

BLOCK_V = 1024


@triton.jit
def _lowbias32(x, M1: tl.constexpr, M2: tl.constexpr):
    """Wellons' lowbias32 on uint32 `x` (shifts are logical, products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * M1
    x = x ^ (x >> 15)
    x = x * M2
    return x ^ (x >> 16)


@triton.jit
def _seeded_noise_kernel(
    noise, rows, keys, positions, vocab_size, noise_stride,
    M1: tl.constexpr, M2: tl.constexpr, INDEX_SALT: tl.constexpr,
    SALT0: tl.constexpr, SALT1: tl.constexpr, SALT2: tl.constexpr, BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    token = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] token ids
    mask = token < vocab_size
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    # the row's key and output index, splat over the block (vector work: the interpreter's scalar
    # integer products would warn on the wrap the hash relies on)
    key = zero + tl.load(keys + s).to(tl.uint32)  # [BLOCK]
    index = zero + tl.load(positions + s).to(tl.uint32)  # [BLOCK]
    k = _lowbias32(key ^ _lowbias32(index ^ INDEX_SALT, M1, M2), M1, M2)
    k0 = _lowbias32(k ^ SALT0, M1, M2)
    k1 = _lowbias32(k0 ^ SALT1, M1, M2)
    k2 = _lowbias32(k1 ^ SALT2, M1, M2)
    h = token.to(tl.uint32)
    h = _lowbias32(h ^ k0, M1, M2)
    h = _lowbias32(h ^ k1, M1, M2)
    h = _lowbias32(h ^ k2, M1, M2)
    # u = (h + 0.5) / 2**32
    low = h < 0x80000000  # u < 1/2
    u = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # [BLOCK]; used where `low`
    t = ((0xFFFFFFFF - h).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # [BLOCK] 1 - u; where not `low`
    z = t / (2.0 - t)
    w = z * z
    series = 1.0 / 11.0 + w * (1.0 / 13.0)
    series = 1.0 / 9.0 + w * series
    series = 1.0 / 7.0 + w * series
    series = 1.0 / 5.0 + w * series
    series = 1.0 / 3.0 + w * series
    series = 1.0 + w * series
    high_noise = 2.0 * z * series
    u_safe = tl.where(low, u, 0.5)  # the log sees no value of the other branch
    value = tl.where(low, -tl.log(u_safe), high_noise)
    row = tl.load(rows + s)
    tl.store(noise + row * noise_stride + token, value, mask=mask)


def fill_seeded_exponential_triton(noise: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                                   positions: torch.Tensor) -> torch.Tensor:
    """`noise[rows[s]] = E(keys[s], positions[s])` for each of S seeded rows, in place; `noise`
    `[B, V]` (float, unit column stride), `rows` / `keys` / `positions` `[S]` int64 on its device."""
    if noise.dim() != 2 or noise.stride(1) != 1:
        raise ValueError(f"noise must be [B, V] with unit column stride, got shape {tuple(noise.shape)} "
                         f"strides {noise.stride()}")
    num, vocab = rows.shape[0], noise.shape[1]
    if keys.shape[0] != num or positions.shape[0] != num:
        raise ValueError(f"rows, keys and positions must have one entry per seeded row: {num}, "
                         f"{keys.shape[0]}, {positions.shape[0]}")
    if num and vocab:
        _seeded_noise_kernel[(num, triton.cdiv(vocab, BLOCK_V))](
            noise, rows.contiguous(), keys.contiguous(), positions.contiguous(), vocab, noise.stride(0),
            M1=M1, M2=M2, INDEX_SALT=INDEX_SALT, SALT0=ROUND_SALTS[0], SALT1=ROUND_SALTS[1],
            SALT2=ROUND_SALTS[2], BLOCK=BLOCK_V, **FP_FUSION,
            sanitize_overflow=False,  # the hash wraps mod 2**32 on purpose
        )
    return noise

"""An FP8 paged KV cache (`kv_cache_dtype` fp8 / fp8_e4m3 / fp8_e5m2, scale 1.0) in the kernels.

Writers clamp to the format's range and round to nearest even (`to_cache_dtype`); every attention
kernel reads the stored values converted to the query's dtype, so each of them equals the
reference run on a float32 cache that holds the same (dequantized) values. On the CPU the Triton
kernels run under Triton's interpreter (float32 queries: its bf16 dots are not the GPU's); on a GPU
the same tests run compiled, bf16 queries too.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

triton = pytest.importorskip("triton")

from lamina.kernels.paged_attention import paged_attention, to_cache_dtype, write_kv_cache  # noqa: E402
from lamina.kernels.triton_decode import paged_decode_attention  # noqa: E402
from lamina.kernels.triton_prefill_attention import PREFILL_BLOCK_M, paged_prefill_attention  # noqa: E402
from lamina.kernels.triton_qk_prep import qk_norm_rope_cache  # noqa: E402
from lamina.kernels.triton_verify import paged_verify_attention  # noqa: E402
from lamina.layers.norm import RMSNorm  # noqa: E402
from lamina.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# query dtypes (bf16 dots under the interpreter: tests/triton_interpreter.py)
QUERY_DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _rand(*shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(DEVICE)


def _caches(reqs, hkv, head_dim, page, fp8, seed):
    """FP8 caches holding every request's keys and values (shuffled blocks), their float32 twins (the
    same values), and the step's metadata, for (cached context, new tokens) per request."""
    max_pages = max(-(-(c + n) // page) for c, n in reqs)
    num_blocks = len(reqs) * max_pages + 2
    k8 = to_cache_dtype(_rand(num_blocks, page, hkv, head_dim, seed=seed, scale=3.0), fp8)
    v8 = to_cache_dtype(_rand(num_blocks, page, hkv, head_dim, seed=seed + 1, scale=3.0), fp8)
    perm = torch.randperm(num_blocks, generator=_gen(seed + 2)).to(DEVICE)
    block_tables = perm[: len(reqs) * max_pages].view(len(reqs), max_pages)
    q_lens = [n for _, n in reqs]
    qsl = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(reqs))], device=DEVICE)
    seq_lens = torch.tensor([c + n for c, n in reqs], device=DEVICE)
    return (k8, v8), (k8.float(), v8.float()), block_tables, seq_lens, qsl, q_lens


def _close(ours, ref, dtype):
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fp8", FP8)
def test_reference_attention_reads_the_stored_values(fp8):
    """The torch reference on an FP8 cache equals itself on a float32 cache of the same values."""
    reqs = [(0, 7), (5, 1), (20, 3)]
    fp8_caches, twins, tables, seq_lens, qsl, q_lens = _caches(reqs, 2, 16, 4, fp8, seed=1)
    q = _rand(sum(q_lens), 4, 16, seed=4)
    args = (tables, seq_lens, qsl, max(q_lens), int(seq_lens.max()), 0.25)
    assert torch.equal(paged_attention(q, *fp8_caches, *args), paged_attention(q, *twins, *args))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
def test_decode_prefill_and_verify_kernels_on_fp8_caches(fp8, dtype):
    """Each attention kernel on FP8 caches against the reference on their float32 twins: the decode
    kernel (keys split over programs), the varlen prefill kernel (fresh prompts, continued chunks,
    decodes) and the verification kernel (3 queries per request), with the output gate."""
    hq, hkv, head_dim, page = 4, 2, 16, 4
    fp8_caches, twins, tables, seq_lens, qsl, q_lens = _caches([(0, 1), (4, 1), (69, 1), (299, 1)], hkv, head_dim,
                                                                page, fp8, seed=1)
    q = _rand(4, hq, head_dim, seed=4).to(dtype)
    scale = head_dim**-0.5
    ref = paged_attention(q.float(), *twins, tables, seq_lens, qsl, 1, int(seq_lens.max()), scale)
    _close(paged_decode_attention(q, *fp8_caches, tables, seq_lens, scale, splits=2), ref, dtype)

    step = [(0, PREFILL_BLOCK_M + 6), (0, 1), (37, 9), (5, 1), (12, 4)]
    fp8_caches, twins, tables, seq_lens, qsl, q_lens = _caches(step, hkv, head_dim, page, fp8, seed=5)
    q = _rand(sum(q_lens), hq, head_dim, seed=8).to(dtype)
    gate = _rand(sum(q_lens), hq, head_dim, seed=9).to(dtype)
    ref = paged_attention(q.float(), *twins, tables, seq_lens, qsl, max(q_lens), int(seq_lens.max()), scale)
    ours = paged_prefill_attention(q, *fp8_caches, tables, seq_lens, qsl, max(q_lens), scale, gate=gate)
    _close(ours, ref * torch.sigmoid(gate.float()), dtype)

    queries = 3
    fp8_caches, twins, tables, seq_lens, qsl, q_lens = _caches([(0, queries), (5, queries), (34, queries)], hkv,
                                                                head_dim, page, fp8, seed=11)
    q = _rand(sum(q_lens), hq, head_dim, seed=12).to(dtype)
    ref = paged_attention(q.float(), *twins, tables, seq_lens, qsl, queries, int(seq_lens.max()), scale)
    _close(paged_verify_attention(q, *fp8_caches, tables, seq_lens, scale, queries), ref, dtype)


@pytest.mark.parametrize("fp8", FP8)
def test_cache_writers_clamp_and_round_alike(fp8):
    """The reference writer and the fused q/k prep kernel store the same FP8 bytes: values past the
    format's range clamped to it (a key norm weight and values large enough to leave it), the rest
    rounded to nearest even; slot -1 skipped."""
    tokens, heads, kv_heads, dim, rotary_dim = 5, 4, 2, 16, 8
    limit = torch.finfo(fp8).max
    qkv = _rand(tokens, heads * dim + 2 * kv_heads * dim, seed=1)
    query, key, value = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    query, key = query.reshape(tokens, heads, dim), key.reshape(tokens, kv_heads, dim)
    value = (value * limit / 2).reshape(tokens, kv_heads, dim)  # about a third past the range
    q_norm, k_norm = RMSNorm(dim, 1e-6, zero_centred=False), RMSNorm(dim, 1e-6, zero_centred=False)
    q_norm.weight.data.copy_(torch.randn(dim, generator=_gen(10)) * 0.3)
    k_norm.weight.data.copy_(torch.randn(dim, generator=_gen(11)) * limit / 3)
    for norm in (q_norm, k_norm):
        norm.kernels = "reference"
    rotary = RotaryEmbedding(dim, rotary_dim, 10000.0, 64)
    cos, sin = rotary.cos_sin(torch.tensor([0, 3, 7, 8, 30]))
    slots = torch.tensor([5, -1, 0, 12, 7], device=DEVICE)
    ref_k = rotary.apply(k_norm(key.cpu()), cos, sin).to(DEVICE)
    assert ref_k.abs().max() > limit and value.abs().max() > limit  # the clamp is exercised
    expected = [torch.zeros(4, 4, kv_heads, dim, dtype=fp8, device=DEVICE) for _ in range(2)]
    write_kv_cache(ref_k, value, expected[0], expected[1], slots)
    ours = [torch.zeros_like(c) for c in expected]
    qk_norm_rope_cache(query, key, value, q_norm.weight.to(DEVICE), k_norm.weight.to(DEVICE), 1e-6, False,
                       cos.to(DEVICE), sin.to(DEVICE), slots, ours[0], ours[1])
    for got, want in zip(ours, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    flat_v = expected[1].view(-1, kv_heads, dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:  # clamped, then the format's own rounding
            assert torch.equal(flat_v[slot].float(), value[t].clamp(-limit, limit).to(fp8).float())
    assert flat_v.float().abs().max() == limit

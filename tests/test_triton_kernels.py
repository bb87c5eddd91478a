"""lamina's own Triton kernels against their torch references.

On a machine without CUDA (CI) they run under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set
here before the kernels are imported) at tiny shapes; on a GPU machine the same tests run the
compiled kernels on CUDA, at those shapes and (marked gpu) at the Qwen3.5-35B-A3B widths.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

triton = pytest.importorskip("triton")

from lamina.kernels.causal_conv1d import causal_conv1d_varlen  # noqa: E402
from lamina.kernels.gated_delta_rule import recurrent_gated_delta_rule_step  # noqa: E402
from lamina.kernels.moe import grouped_experts  # noqa: E402
from lamina.kernels.paged_attention import paged_attention  # noqa: E402
from lamina.kernels.triton_decode import (  # noqa: E402
    causal_conv1d_decode,
    gated_delta_rule_decode,
    paged_decode_attention,
)
from lamina.kernels.triton_align import _align_one_program, _align_torch, align_pairs  # noqa: E402
from lamina.kernels.triton_moe import fused_moe, route_softmax_topk  # noqa: E402
from lamina.kernels.triton_moe_gemv import fused_moe_gemv  # noqa: E402
from lamina.kernels.triton_prefill_attention import PREFILL_BLOCK_M, paged_prefill_attention  # noqa: E402
from lamina.kernels.triton_norm import add_rms_norm, gated_rms_norm, rms_norm  # noqa: E402
from lamina.kernels.triton_qk_prep import qk_norm_rope_cache  # noqa: E402
from lamina.kernels.paged_attention import write_kv_cache  # noqa: E402
from lamina.layers.rotary import RotaryEmbedding  # noqa: E402
from lamina.layers.norm import GatedRMSNorm, RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _rand(*shape, seed, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(DEVICE, dtype)


# ---- paged attention -------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv,head_dim,page,splits", [(4, 2, 16, 4, 4), (8, 1, 32, 16, 2), (2, 2, 24, 8, 1)])
def test_paged_decode_attention_matches_reference(hq, hkv, head_dim, page, splits):
    """Against the reference, with the key blocks split over `splits` programs (a split with
    several blocks at 300 positions and splits=2; empty splits at one position); the same result
    twice (the tickets are left zero) and for each request alone (batch invariance)."""
    seq_lens = torch.tensor([1, 5, 70, 300], device=DEVICE)
    bsz = seq_lens.shape[0]
    max_pages = -(-300 // page)
    num_blocks = bsz * max_pages + 3
    k_cache = _rand(num_blocks, page, hkv, head_dim, seed=1)
    v_cache = _rand(num_blocks, page, hkv, head_dim, seed=2)
    perm = torch.randperm(num_blocks, generator=_gen(3)).to(DEVICE)
    block_tables = perm[: bsz * max_pages].view(bsz, max_pages)  # distinct, shuffled blocks
    q = _rand(bsz, hq, head_dim, seed=4)
    ours = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5, splits=splits)
    ref = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, torch.arange(bsz + 1, device=DEVICE), 1,
                          int(seq_lens.max()), head_dim**-0.5)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(ours, paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5,
                                                    splits=splits))
    b = 3
    alone = paged_decode_attention(q[b : b + 1], k_cache, v_cache, block_tables[b : b + 1], seq_lens[b : b + 1],
                                   head_dim**-0.5, splits=splits)
    assert torch.equal(alone, ours[b : b + 1])


def test_paged_decode_attention_with_the_output_gate():
    seq_lens = torch.tensor([3, 20], device=DEVICE)
    k_cache, v_cache = _rand(8, 4, 2, 16, seed=1), _rand(8, 4, 2, 16, seed=2)
    block_tables = torch.tensor([[0, 2, 4, 6, 7], [1, 3, 5, 7, 6]], device=DEVICE)
    q, gate = _rand(2, 4, 16, seed=3), _rand(2, 4, 16, seed=4)
    ungated = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.25)
    ours = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.25, gate=gate)
    torch.testing.assert_close(ours, ungated * torch.sigmoid(gate), atol=1e-6, rtol=1e-5)


def _paged_step(reqs, hkv, head_dim, page, seed):
    """Caches holding every request's keys (cached context and this step's, in shuffled blocks) and the
    step's metadata, for (cached context, new tokens) per request."""
    max_pages = max(-(-(c + n) // page) for c, n in reqs)
    num_blocks = len(reqs) * max_pages + 2
    k_cache = _rand(num_blocks, page, hkv, head_dim, seed=seed)
    v_cache = _rand(num_blocks, page, hkv, head_dim, seed=seed + 1)
    perm = torch.randperm(num_blocks, generator=_gen(seed + 2)).to(DEVICE)
    block_tables = perm[: len(reqs) * max_pages].view(len(reqs), max_pages)
    q_lens = [n for _, n in reqs]
    qsl = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(reqs))], device=DEVICE)
    seq_lens = torch.tensor([c + n for c, n in reqs], device=DEVICE)
    return k_cache, v_cache, block_tables, seq_lens, qsl, q_lens


# (cached context, new tokens): fresh prompts (one longer than a query block), a prompt continued
# over cached context, decodes (one at position 0's neighbour), a verification-sized chunk
PREFILL_STEP = [(0, PREFILL_BLOCK_M + 6), (0, 1), (37, 9), (5, 1), (90, 1), (12, 4), (0, 16), (130, PREFILL_BLOCK_M)]


@pytest.mark.parametrize("hq,hkv,head_dim,page", [(4, 2, 16, 4), (6, 1, 24, 16), (2, 2, 32, 8), (2, 1, 256, 16)])
def test_paged_prefill_attention_matches_reference(hq, hkv, head_dim, page):
    """The flat varlen step in one launch against the padded reference: fresh prompts, continued
    chunks, decodes, several query blocks; with the output gate; each request alone gives its rows
    of the step (batch invariance). Head dim 256 takes the wide-head tile (128 x 64, 3 stages)."""
    k_cache, v_cache, block_tables, seq_lens, qsl, q_lens = _paged_step(PREFILL_STEP, hkv, head_dim, page, seed=5)
    q = _rand(sum(q_lens), hq, head_dim, seed=8)
    gate = _rand(sum(q_lens), hq, head_dim, seed=9)
    scale = head_dim**-0.5
    ref = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), int(seq_lens.max()), scale)
    ours = paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), scale)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5)
    gated = paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), scale, gate=gate)
    torch.testing.assert_close(gated, ref * torch.sigmoid(gate), atol=2e-5, rtol=2e-5)
    b = 7  # the continued chunk of a query block, alone
    rows = slice(int(qsl[b]), int(qsl[b + 1]))
    alone = paged_prefill_attention(q[rows], k_cache, v_cache, block_tables[b : b + 1], seq_lens[b : b + 1],
                                    torch.tensor([0, q_lens[b]], device=DEVICE), q_lens[b], scale)
    assert torch.equal(alone, ours[rows])
    # another tile (the benchmark's sweep): several query blocks per request, keys past a page
    other = paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), scale,
                                    tile=(16, 16, 4, 2))
    torch.testing.assert_close(other, ref, atol=2e-5, rtol=2e-5)
    # the launch order (longest query block first, or each head's blocks from the first) moves no sum:
    # the same tile gives bitwise the same rows, every request's blocks covered either way
    for tile in ((16, 16, 4, 2), None):
        longest = paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), scale,
                                          gate=gate, tile=tile)
        first = paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), scale,
                                        gate=gate, tile=tile, longest_first=False)
        assert torch.equal(longest, first)
        torch.testing.assert_close(first, ref * torch.sigmoid(gate), atol=2e-5, rtol=2e-5)


def test_paged_prefill_attention_falls_back_to_a_tile_that_fits(monkeypatch):
    """A tile that does not fit the device's shared memory (Triton raises OutOfResources before
    launching) gives way to the next of `prefill_tiles`, and the device keeps that one."""
    from triton.runtime.errors import OutOfResources

    from lamina.kernels import triton_prefill_attention as tpa

    assert tpa.prefill_tiles(256)[0] == (128, 64, 8, 3) and tpa.prefill_tiles(128)[0][0] == PREFILL_BLOCK_M
    monkeypatch.setattr(tpa, "_CHOSEN_TILE", {})
    monkeypatch.setattr(tpa, "_TILES", ((16, 999, 4, None), (16, 16, 4, 2)))
    real, tried = tpa._paged_prefill_attention_kernel, []

    class TooBig:  # the kernel, except that a 999-key tile is out of shared memory
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                tried.append(kwargs["BLOCK_N"])
                if kwargs["BLOCK_N"] == 999:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return real[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(tpa, "_paged_prefill_attention_kernel", TooBig())
    k_cache, v_cache, block_tables, seq_lens, qsl, q_lens = _paged_step(PREFILL_STEP[:4], 2, 16, 4, seed=11)
    q = _rand(sum(q_lens), 4, 16, seed=12)
    ref = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), int(seq_lens.max()), 0.25)
    for _ in range(2):
        ours = tpa.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), 0.25)
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5)
    assert tried == [999, 16, 16] and list(tpa._CHOSEN_TILE.values()) == [(16, 16, 4, 2)]
    monkeypatch.setattr(tpa, "_CHOSEN_TILE", {})
    monkeypatch.setattr(tpa, "_TILES", ((16, 999, 4, None),))
    with pytest.raises(OutOfResources):  # nothing fits: the error, not a silent skip
        tpa.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), 0.25)


def test_paged_prefill_attention_bf16_and_empty_step():
    k_cache, v_cache, block_tables, seq_lens, qsl, q_lens = _paged_step(PREFILL_STEP[:4], 2, 16, 4, seed=11)
    q = _rand(sum(q_lens), 4, 16, seed=12)
    # bf16 tiles (on the CPU through tests/triton_interpreter.py's dots: the interpreter's own multiply bf16 bits)
    k16, v16, q16 = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16), q.to(torch.bfloat16)
    ref = paged_attention(q16.float(), k16.float(), v16.float(), block_tables, seq_lens, qsl, max(q_lens),
                          int(seq_lens.max()), 0.25)
    ours = paged_prefill_attention(q16, k16, v16, block_tables, seq_lens, qsl, max(q_lens), 0.25)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref, atol=3e-2, rtol=3e-2)
    empty = paged_prefill_attention(q[:0], k_cache, v_cache, block_tables[:0], seq_lens[:0],
                                    torch.zeros(1, dtype=torch.long, device=DEVICE), 0, 0.25)
    assert empty.shape == (0, 4, 16)
    with pytest.raises(ValueError, match="not a multiple of Hkv"):
        paged_prefill_attention(q[:, :3], k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_paged_prefill_attention_at_real_width():
    """bf16 at the Qwen3.5-35B-A3B attention shape (16 query heads, 2 KV heads, dim 256, 16-token
    pages): a mixed step of long chunks with and without cached context and decodes."""
    reqs = [(0, 1000), (2048, 512), (300, 1), (4000, 1), (0, 17)]
    k_cache, v_cache, block_tables, seq_lens, qsl, q_lens = _paged_step(reqs, 2, 256, 16, seed=21)
    k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    q = _rand(sum(q_lens), 16, 256, seed=22).to(torch.bfloat16)
    ref = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), int(seq_lens.max()), 1 / 16)
    ours = paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), 1 / 16)
    torch.testing.assert_close(ours.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rotary_dim,zero_centred", [(16, True), (4, True), (8, False)])
def test_qk_norm_rope_cache_matches_the_layer_ops(rotary_dim, zero_centred):
    """q/k RMSNorm, partial rotary and the K/V cache write (slot -1 skipped) in one launch."""
    tokens, heads, kv_heads, dim = 5, 4, 2, 16
    qkv = _rand(tokens, heads * dim + 2 * kv_heads * dim, seed=1)
    query, key, value = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    query, key, value = query.view(tokens, heads, dim), key.view(tokens, kv_heads, dim), value.view(tokens, kv_heads, dim)
    q_norm, k_norm = RMSNorm(dim, 1e-6, zero_centred=zero_centred), RMSNorm(dim, 1e-6, zero_centred=zero_centred)
    for i, norm in enumerate((q_norm, k_norm)):
        norm.weight.data.copy_(torch.randn(dim, generator=_gen(10 + i)) * 0.3)
        norm.kernels = "reference"
    rotary = RotaryEmbedding(dim, rotary_dim, 10000.0, 64)
    positions = torch.tensor([0, 3, 7, 8, 30])
    cos, sin = rotary.cos_sin(positions)
    slots = torch.tensor([5, -1, 0, 12, 7], device=DEVICE)
    caches = [_rand(4, 4, kv_heads, dim, seed=20 + i) for i in range(2)]
    expected = [c.clone() for c in caches]
    ref_q = rotary.apply(q_norm(query.cpu()), cos, sin)
    ref_k = rotary.apply(k_norm(key.cpu()), cos, sin)
    write_kv_cache(ref_k.to(DEVICE), value, expected[0], expected[1], slots)
    ours = qk_norm_rope_cache(
        query, key, value, q_norm.weight.to(DEVICE), k_norm.weight.to(DEVICE), 1e-6, zero_centred,
        cos.to(DEVICE), sin.to(DEVICE), slots, caches[0], caches[1],
    )
    torch.testing.assert_close(ours, ref_q.to(DEVICE), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1], expected[1])


# ---- gated delta rule ------------------------------------------------------------------------


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 16), (1, 2, 32, 48)])
def test_gated_delta_rule_decode_updates_the_pool_in_place(hk, hv, dk, dv):
    bsz, num_slots = 3, 6
    q, k = _rand(bsz, hk, dk, seed=1), _rand(bsz, hk, dk, seed=2)
    v = _rand(bsz, hv, dv, seed=3)
    g = -torch.rand(bsz, hv, generator=_gen(4)).to(DEVICE)
    beta = torch.rand(bsz, hv, generator=_gen(5)).to(DEVICE)
    pool = _rand(num_slots, hv, dk, dv, seed=6, scale=0.3)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    keep = torch.tensor([True, False, True], device=DEVICE)
    state_in = torch.where(keep[:, None, None, None], pool[slots], 0.0)
    ref_out, ref_state = recurrent_gated_delta_rule_step(q, k, v, g, beta, state_in)
    expected_pool = pool.clone()
    expected_pool[slots] = ref_state
    fused_pool = pool.clone()
    out = gated_delta_rule_decode(q, k, v, g, beta, pool, slots, keep)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected_pool, atol=1e-5, rtol=1e-5)  # other slots untouched
    # The gate math fused: g and beta from the raw projections a, b as GatedDeltaNet computes them.
    a, b = _rand(bsz, hv, seed=7), _rand(bsz, hv, seed=8)
    a_log, dt_bias = _rand(hv, seed=9, scale=0.5), _rand(hv, seed=10, scale=0.5)
    g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    beta = torch.sigmoid(b)
    ref_out, ref_state = recurrent_gated_delta_rule_step(q, k, v, g, beta, state_in)
    out = gated_delta_rule_decode(q, k, v, a, b, fused_pool, slots, keep, a_log=a_log, dt_bias=dt_bias)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_pool[slots], ref_state, atol=1e-5, rtol=1e-5)


# ---- causal conv1d ---------------------------------------------------------------------------


@pytest.mark.parametrize("channels,kernel", [(40, 4), (300, 3)])
def test_causal_conv1d_decode_updates_the_pool_in_place(channels, kernel):
    bsz, num_slots = 3, 5
    x = _rand(bsz, channels, seed=1)
    weight = _rand(channels, kernel, seed=2)
    pool = _rand(num_slots, channels, kernel - 1, seed=3)
    slots = torch.tensor([1, 4, 0], device=DEVICE)
    keep = torch.tensor([True, True, False], device=DEVICE)
    state_in = torch.where(keep[:, None, None], pool[slots], 0.0)
    ref_out, ref_state = causal_conv1d_varlen(x, weight, state_in, torch.arange(bsz + 1, device=DEVICE), 1)
    expected_pool = pool.clone()
    expected_pool[slots] = ref_state
    out = causal_conv1d_decode(x, weight, pool, slots, keep)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected_pool)


# ---- MoE ---------------------------------------------------------------------------------------


def test_align_pairs_gives_each_block_one_expert():
    topk_ids = torch.tensor([[3, 1], [1, 5], [7, 3], [0, 1]], device=DEVICE)  # expert 7, 0 off this rank
    sorted_pairs, block_expert = align_pairs(topk_ids, num_local_experts=6, expert_start=1, block_m=4)
    pairs = sorted_pairs.view(-1, 4).cpu()
    experts = block_expert.cpu().tolist()
    flat = topk_ids.reshape(-1).cpu()
    seen = []
    for block, expert in enumerate(experts):
        real = [int(p) for p in pairs[block] if p < 8]
        if expert < 0:
            assert not real
            continue
        assert real and all(int(flat[p]) - 1 == expert for p in real)
        seen += real
    assert sorted(seen) == [0, 1, 2, 3, 5, 7]  # every local pair exactly once (4: expert 7, 6: expert 0)


def _assert_same_alignment(ours, ref):
    assert torch.equal(ours[0], ref[0]), "sorted_pairs differ"
    assert torch.equal(ours[1], ref[1]), "block_expert differ"


# (pairs, local experts, expert_start, block_m): 1 to 4096 pairs (decode batch 64 at top-8 = 512);
# 8, 256, 1000 local experts and 1024 (the largest one program takes: there E_PAD = E, so the
# non-local pairs' key expert E is past every histogram bin); BLOCK_M 4 to 64. Ids are drawn from
# [0, expert_start + E + 8): with expert_start > 0 some are below the local range, always some
# above it (other ranks' experts: no row).
ALIGN_CASES = [
    (1, 8, 0, 16), (1, 1000, 500, 64),
    (7, 8, 3, 32), (7, 256, 0, 16), (7, 1000, 0, 64),
    (64, 8, 0, 64), (64, 256, 128, 16), (64, 1000, 0, 32),
    (130, 64, 30, 4), (200, 6, 2, 16),
    (512, 256, 0, 16), (512, 8, 4, 32), (512, 1000, 24, 64), (512, 1024, 0, 16),
    (4096, 256, 0, 16), (4096, 1000, 500, 64), (4096, 8, 2, 32),
]


@pytest.mark.parametrize("num_pairs,num_local,expert_start,block_m", ALIGN_CASES)
def test_one_program_alignment_equals_the_torch_one(num_pairs, num_local, expert_start, block_m):
    """Bitwise: the same rows in the same order (pair order inside an expert), the same padding
    (num_pairs) and the same -1 blocks; int64 ids as the router gives them, [T, k] when P is a
    multiple of 8."""
    gen = _gen(num_pairs * 7919 + num_local)
    shape = (num_pairs // 8, 8) if num_pairs % 8 == 0 else (num_pairs, 1)
    ids = torch.randint(0, expert_start + num_local + 8, shape, generator=gen).to(DEVICE)
    ref = _align_torch(ids, num_local, expert_start, block_m)
    _assert_same_alignment(_align_one_program(ids, num_local, expert_start, block_m), ref)
    _assert_same_alignment(align_pairs(ids, num_local, expert_start, block_m), ref)


def test_one_program_alignment_at_every_warp_count():
    """The sort's register / lane / warp split of the key bits follows num_warps (`REG_BITS`):
    every split must sort (int32 ids too)."""
    ids = torch.randint(0, 300, (512,), generator=_gen(3)).to(DEVICE, torch.int32)
    ref = _align_torch(ids, 256, 20, 16)
    for num_warps in (1, 2, 4, 8):
        _assert_same_alignment(_align_one_program(ids, 256, 20, 16, num_warps=num_warps), ref)


def _skewed_ids(kind: str) -> torch.Tensor:
    if kind == "one_expert":  # 4096 pairs on expert 3: one 4096-row run, 64 full blocks
        return torch.full((4096,), 3)
    if kind == "none_local":  # every id on another rank: all rows padding, every block -1
        return torch.full((512,), 300)
    if kind == "each_once":  # 256 distinct experts: 256 one-pair blocks
        return torch.randperm(256, generator=_gen(1))
    ids = torch.randint(0, 256, (2048,), generator=_gen(2))  # half the pairs on expert 0, the rest spread
    ids[::2] = 0
    return ids


@pytest.mark.parametrize("kind", ["one_expert", "none_local", "each_once", "half_on_one"])
def test_one_program_alignment_of_skewed_routings(kind):
    ids = _skewed_ids(kind).to(DEVICE)
    num_local, block_m = (8, 64) if kind == "one_expert" else (256, 16)
    ours = _align_one_program(ids, num_local, 0, block_m)
    _assert_same_alignment(ours, _align_torch(ids, num_local, 0, block_m))
    sorted_pairs, block_expert = (t.cpu() for t in ours)
    if kind == "one_expert":  # the spec itself, not only the reference: pair order, then padding
        assert torch.equal(sorted_pairs[:4096], torch.arange(4096, dtype=torch.int32))
        assert (sorted_pairs[4096:] == 4096).all()
        assert (block_expert[:64] == 3).all() and (block_expert[64:] == -1).all()
    if kind == "none_local":
        assert (sorted_pairs == 512).all() and (block_expert == -1).all()


# (pairs, local experts, expert_start, block_m, id dtype) for the blocked alignment: a ragged last
# block, an exact multiple of BLOCK_P, E_PAD > E and E_PAD = E (1024), EP ranks (ids below and
# above the local range), int32 ids.
BLOCKED_ALIGN_CASES = [
    (4104, 256, 0, 64, torch.int64), (1536, 64, 64, 16, torch.int32), (700, 1024, 0, 128, torch.int64),
    (1200, 6, 1, 4, torch.int64), (600, 1, 3, 16, torch.int64),  # one local expert (E_PAD = 1)
]


@pytest.mark.parametrize("num_pairs,num_local,expert_start,block_m,dtype", BLOCKED_ALIGN_CASES)
def test_blocked_alignment_equals_the_torch_one(num_pairs, num_local, expert_start, block_m, dtype):
    """The three-launch alignment of prefill chunks (`triton_align`), bitwise against `_align_torch`
    (and what `align_pairs` returns above 4,096 pairs)."""
    from lamina.kernels.triton_align import align_pairs_blocked
    from lamina.kernels.triton_align import _max_rows

    gen = _gen(num_pairs * 31 + num_local)
    ids = torch.randint(0, expert_start + num_local + 8, (num_pairs,), generator=gen).to(DEVICE, dtype)
    ref = _align_torch(ids, num_local, expert_start, block_m)
    max_rows = _max_rows(num_pairs, num_local, block_m)
    _assert_same_alignment(align_pairs_blocked(ids, num_local, expert_start, block_m, max_rows), ref)
    if num_pairs < 2000:  # smaller blocks of pairs: more programs, a longer offsets scan
        _assert_same_alignment(align_pairs_blocked(ids, num_local, expert_start, block_m, max_rows, block_p=64), ref)
    if num_pairs > 4096:
        _assert_same_alignment(align_pairs(ids, num_local, expert_start, block_m), ref)


@pytest.mark.parametrize("kind", ["one_expert", "none_local", "half_on_one"])
def test_blocked_alignment_of_skewed_routings(kind):
    from lamina.kernels.triton_align import align_pairs_blocked
    from lamina.kernels.triton_align import _max_rows

    ids = _skewed_ids(kind)[:1100].to(DEVICE)  # over several blocks of pairs (none_local: 512 pairs, two)
    num_local, block_m = (8, 64) if kind == "one_expert" else (256, 16)
    ref = _align_torch(ids, num_local, 0, block_m)
    _assert_same_alignment(align_pairs_blocked(ids, num_local, 0, block_m, _max_rows(ids.numel(), num_local, block_m)), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,block_m", [(2048, 64), (8192, 128)])
def test_blocked_alignment_at_prefill_sizes(num_tokens, block_m):
    """A 2k and an 8k prompt chunk of the Qwen3.5-35B-A3B shape (top-8 of 256 experts, the
    prefill tiles' row blocks) through `align_pairs`, bitwise against the torch form."""
    from lamina.kernels.triton_align import align_pairs_blocked
    from lamina.kernels.triton_align import _max_rows

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    ids = torch.rand(num_tokens, 256, device="cuda", generator=gen).topk(8, dim=-1).indices  # [T, 8]
    ref = _align_torch(ids, 256, 0, block_m)
    _assert_same_alignment(align_pairs_blocked(ids, 256, 0, block_m, _max_rows(ids.numel(), 256, block_m)), ref)
    _assert_same_alignment(align_pairs(ids, 256, 0, block_m), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,num_global,num_local,expert_start", [
    (2047, 128, 32, 32),  # an EP rank's 32 of 128 experts (E_PAD 32), a ragged last block of pairs
    (513, 8, 8, 0),  # E_PAD 8 (under the histogram's 32 lanes), 4,104 pairs
    (640, 1024, 1024, 0),  # E_PAD = E = 1024 (the largest), 5,120 pairs
])
def test_blocked_alignment_of_ep_ranks_on_gpu(num_tokens, num_global, num_local, expert_start):
    """The compiled kernels (with PDL on sm90+) where the interpreter tests are: ids of other EP
    ranks, few and many local experts, a pair count that is not a multiple of the blocks."""
    from lamina.kernels.triton_align import align_pairs_blocked
    from lamina.kernels.triton_align import _max_rows

    gen = torch.Generator(device="cuda").manual_seed(num_local)
    ids = torch.rand(num_tokens, num_global, device="cuda", generator=gen).topk(8, dim=-1).indices  # [T, 8]
    for block_m in (16, 64):
        ref = _align_torch(ids, num_local, expert_start, block_m)
        max_rows = _max_rows(ids.numel(), num_local, block_m)
        _assert_same_alignment(align_pairs_blocked(ids, num_local, expert_start, block_m, max_rows), ref)


def test_moe_align_switch(monkeypatch):
    from lamina.kernels import selection

    for value, blocked in (("torch", False), ("triton", True)):
        monkeypatch.setenv("LAMINA_MOE_ALIGN", value)
        selection.moe_align_blocked.cache_clear()
        assert selection.moe_align_blocked() is blocked
    monkeypatch.setenv("LAMINA_MOE_ALIGN", "cub")
    selection.moe_align_blocked.cache_clear()
    with pytest.raises(ValueError, match="LAMINA_MOE_ALIGN = 'cub'"):
        selection.moe_align_blocked()
    monkeypatch.delenv("LAMINA_MOE_ALIGN")
    selection.moe_align_blocked.cache_clear()


@pytest.fixture
def moe_prefill_env(monkeypatch):
    """Sets LAMINA_MOE_PREFILL for a test (None: unset); the cached choice is cleared before and after."""
    from lamina.kernels import selection

    def set_to(value):
        if value is None:
            monkeypatch.delenv("LAMINA_MOE_PREFILL", raising=False)
        else:
            monkeypatch.setenv("LAMINA_MOE_PREFILL", value)
        selection.moe_prefill_grouped_mm.cache_clear()

    yield set_to
    monkeypatch.delenv("LAMINA_MOE_PREFILL", raising=False)
    selection.moe_prefill_grouped_mm.cache_clear()


def test_moe_prefill_switch(moe_prefill_env):
    """`LAMINA_MOE_PREFILL` picks the prefill MoE; on the CPU (the interpreter) the Triton kernels
    run whatever it says, since `torch._grouped_mm`'s fast path is a GPU's."""
    from lamina.kernels import selection, triton_moe

    for value, on in (("grouped_mm", True), ("triton", False), (None, False)):
        moe_prefill_env(value)
        assert selection.moe_prefill_grouped_mm() is on
    moe_prefill_env("grouped_mm")
    x, w13, w2, weights, ids, shared, ref = _moe_case(200, 0, 8, True)  # 600 pairs: beyond DECODE_MAX_PAIRS
    assert ids.numel() > triton_moe.DECODE_MAX_PAIRS
    assert triton_moe._prefill_on_grouped_mm(x, w13, w2) is False  # float32 (and no GPU in CI): never
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, 0, shared), ref, atol=1e-5, rtol=1e-5)
    moe_prefill_env("cutlass")
    with pytest.raises(ValueError, match="LAMINA_MOE_PREFILL = 'cutlass'"):
        selection.moe_prefill_grouped_mm()


@pytest.mark.gpu
def test_alignment_replays_in_a_cuda_graph():
    """Capturable: no host sync, shapes from host ints; a replay on new ids gives their alignment."""
    ids = torch.randint(0, 256, (64, 8), device="cuda")
    align_pairs(ids, 256, 0, 16)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = align_pairs(ids, 256, 0, 16)
    for seed in range(3):
        ids.copy_(torch.randint(0, 256, (64, 8), generator=_gen(seed)).cuda())
        graph.replay()
        _assert_same_alignment(out, _align_torch(ids, 256, 0, 16))


@pytest.mark.parametrize("renormalize,top_k", [(True, 4), (False, 4), (True, 10)])
def test_routing_kernel_matches_the_router(renormalize, top_k):
    """top_k 10 (Qwen4-Exp) is not a power of two: the kernel pads its slots."""
    logits = _rand(7, 40, seed=5)
    weights, ids = route_softmax_topk(logits, top_k, renormalize, torch.float32)
    probs = torch.softmax(logits, dim=-1)
    ref_w, ref_i = probs.topk(top_k, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


def test_routing_kernel_ties_go_to_the_lower_expert_id():
    """Equal probabilities are taken lowest expert id first, whatever their positions, and a tie
    across the k-th slot keeps the lower id."""
    logits = torch.zeros(3, 40)
    logits[0, [31, 4, 17, 22]] = 2.0  # four equal largest: ids 4, 17, 22 (31 left out)
    logits[1, [39, 0]] = 3.0
    logits[1, [12, 5]] = 1.0  # the second pair ties for slot 3 of 3: id 5 wins
    logits[2] = 0.5  # all equal: ids 0, 1, 2
    weights, ids = route_softmax_topk(logits.to(DEVICE), 3, False, torch.float32)
    assert ids.tolist() == [[4, 17, 22], [0, 39, 5], [0, 1, 2]]
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights.cpu(), probs.gather(1, ids.cpu()), atol=1e-7, rtol=1e-6)


def test_norm_kernels_match_the_modules():
    x, gate = _rand(5, 3, 48, seed=1), _rand(5, 3, 48, seed=2)
    for zero_centred in (True, False):
        ref = RMSNorm(48, 1e-6, zero_centred=zero_centred, device="cpu")
        ref.weight.data.copy_(torch.randn(48, generator=_gen(3)))
        ref.kernels = "reference"
        weight = ref.weight.to(DEVICE)
        torch.testing.assert_close(rms_norm(x, weight, 1e-6, zero_centred), ref(x.cpu()).to(DEVICE), atol=1e-5, rtol=1e-5)
        residual = _rand(5, 48, seed=7)
        total, normed = add_rms_norm(x[:, 0], residual, weight, 1e-6, zero_centred)
        ref_total, ref_normed = ref.add_and_norm(residual.cpu(), x[:, 0].cpu())
        torch.testing.assert_close(total, ref_total.to(DEVICE), atol=0, rtol=0)
        torch.testing.assert_close(normed, ref_normed.to(DEVICE), atol=1e-5, rtol=1e-5)
    for activation in ("silu", "sigmoid"):
        ref = GatedRMSNorm(48, 1e-6, activation=activation, device="cpu")
        ref.weight.data.copy_(torch.randn(48, generator=_gen(4)))
        ref.kernels = "reference"
        ours = gated_rms_norm(x, gate, ref.weight.to(DEVICE), 1e-6, activation)
        torch.testing.assert_close(ours, ref(x.cpu(), gate.cpu()).to(DEVICE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_reads_strided_heads_in_row_blocks(dtype):
    """The delta net's z rows are a strided split of its projection `[T, H, D]`: read through their
    strides (several row blocks, a ragged last one), equal to the module on contiguous copies; a row's
    result does not depend on how many rows the call has (fixed rows per program)."""
    tokens, heads, dim = 7, 5, 32  # 35 rows: 3 blocks of 16
    projected = _rand(tokens, 3 * heads * dim, seed=11).to(dtype)  # [T, 3*H*D]
    x = _rand(tokens, heads, dim, seed=12).to(dtype)  # [T, H, D]
    gate = projected[:, heads * dim:2 * heads * dim].reshape(tokens, heads, dim)  # [T, H, D], token stride 3*H*D
    assert gate.stride(0) == 3 * heads * dim and not gate.is_contiguous()
    ref = GatedRMSNorm(dim, 1e-6, activation="silu", dtype=dtype, device="cpu")
    ref.weight.data.copy_(torch.randn(dim, generator=_gen(13)).to(dtype))
    ref.kernels = "reference"
    weight = ref.weight.to(DEVICE)
    ours = gated_rms_norm(x, gate, weight, 1e-6, "silu")
    assert ours.shape == (tokens, heads, dim)
    expected = ref(x.cpu(), gate.contiguous().cpu()).to(DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 5e-2  # bf16: the rsqrt may round one ulp apart, then two roundings
    torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)
    alone = gated_rms_norm(x[3:4], gate[3:4], weight, 1e-6, "silu")  # token 3 by itself
    assert torch.equal(alone[0], ours[3])
    with pytest.raises(ValueError, match="differ in shape"):
        gated_rms_norm(x, gate[:, :2], weight, 1e-6, "silu")


@pytest.mark.parametrize("num_tokens,expert_start,num_local", [(1, 0, 8), (5, 0, 8), (13, 3, 4), (0, 0, 8)])
def test_fused_moe_matches_grouped_experts(num_tokens, expert_start, num_local):
    hidden, inter, top_k, total_experts = 48, 24, 3, 8
    x = _rand(num_tokens, hidden, seed=1)
    w13 = _rand(num_local, 2 * inter, hidden, seed=2, scale=0.2)
    w2 = _rand(num_local, hidden, inter, seed=3, scale=0.2)
    logits = torch.randn(num_tokens, total_experts, generator=_gen(4)).to(DEVICE)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    ours = fused_moe(x, w13, w2, weights, ids, expert_start)
    ref = grouped_experts(x, w13, w2, weights, ids, expert_start)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 6, 21])
def test_fused_moe_with_the_shared_expert(num_tokens):
    """The shared expert's rows ride in the same launches: routed sum + sigmoid(logit) * shared."""
    hidden, inter, top_k, experts = 48, 24, 2, 6
    x = _rand(num_tokens, hidden, seed=1)
    w13, w2 = _rand(experts, 2 * inter, hidden, seed=2, scale=0.2), _rand(experts, hidden, inter, seed=3, scale=0.2)
    shared_w13, shared_w2 = _rand(2 * inter, hidden, seed=4, scale=0.2), _rand(hidden, inter, seed=5, scale=0.2)
    logits = _rand(num_tokens, experts + 1, seed=6)
    weights, ids = torch.softmax(logits[:, :experts], -1).topk(top_k, dim=-1)
    ours = fused_moe(x, w13, w2, weights, ids, shared=(shared_w13, shared_w2, logits[:, experts]))
    gate, up = torch.nn.functional.linear(x, shared_w13).chunk(2, dim=-1)
    shared_out = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, shared_w2)
    ref = grouped_experts(x, w13, w2, weights, ids) + torch.sigmoid(logits[:, experts:]) * shared_out
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_parts_are_unweighted_in_the_activations_dtype(dtype, monkeypatch):
    """The grouped path's down kernel stores each (token, slot) part unweighted, in x's dtype (as the
    torch path's grouped GEMM rounds it), and the slot sum applies the routing weights and the shared
    expert's sigmoid gate: the parts handed to `sum_slots` are each pair's down(act) (a weighted part
    would be off by its weight, 0.1-0.6 here), and the call returns their slot sum."""
    from lamina.kernels import triton_moe

    x, w13, w2, weights, ids, shared, _ = _moe_case(5, 0, 8, True, dtype=dtype)
    seen = {}
    real = triton_moe.sum_slots

    def spy(parts, w, logit=None, local_ids=None):
        seen.update(parts=parts.clone(), weights=w, logit=logit, local_ids=local_ids)
        return real(parts, w, logit, local_ids)

    monkeypatch.setattr(triton_moe, "sum_slots", spy)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids, shared=shared, config=dict(triton_moe.DEFAULT_CONFIG_FP32))
    parts = seen["parts"]  # [T, k + 1, H]
    assert parts.dtype == dtype and parts.shape == (5, 4, 48)
    assert seen["weights"] is weights and seen["logit"] is shared[2] and seen["local_ids"] == (ids, 0, 8)
    f = torch.nn.functional
    for t in range(5):
        for slot in range(4):
            gate_up, down = (shared[0], shared[1]) if slot == 3 else (w13[ids[t, slot]], w2[ids[t, slot]])
            gate, up = f.linear(x[t].float(), gate_up.float()).chunk(2)
            act = (f.silu(gate) * up).to(dtype).float()  # the gate/up kernel stores x's dtype
            want = f.linear(act, down.float())  # [H], unweighted
            torch.testing.assert_close(parts[t, slot].float(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                       rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(out, real(parts, weights, shared[2]))


@pytest.mark.parametrize("tiles", ["DEFAULT_CONFIG_PREFILL", "DEFAULT_CONFIG_LONG_PREFILL"])
def test_fused_moe_prefill_tiles(tiles):
    """The prefill chunks' row blocks of 64 / 128 pairs (tiles larger than the whole tiny problem:
    every mask runs), with experts of another EP rank and the shared expert."""
    from lamina.kernels import triton_moe

    x, w13, w2, weights, ids, shared, ref = _moe_case(13, 0, 8, True)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, 0, shared, config=getattr(triton_moe, tiles)),
                               ref, atol=1e-5, rtol=1e-5)
    x, w13, w2, weights, ids, shared, ref = _moe_case(13, 3, 4, False)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, 3, config=getattr(triton_moe, tiles)),
                               ref, atol=1e-5, rtol=1e-5)


class _GridRecorder:
    """Stands in for a Triton kernel: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def test_fused_moe_launch_order_changes_nothing(monkeypatch):
    """The grouped kernels' launch order (column tiles first, `n_fastest`; row blocks first past
    CUDA's grid-y limit) gives bitwise the sums of the row-first order, with EP-foreign experts
    and the shared expert's blocks; the grids are recorded to check which order ran. (The down
    kernel's own warps / stages are passed too; the interpreter ignores both.)"""
    from lamina.kernels import triton_moe

    gate_up = _GridRecorder(triton_moe._gate_up_kernel)
    down = _GridRecorder(triton_moe._down_kernel)
    monkeypatch.setattr(triton_moe, "_gate_up_kernel", gate_up)
    monkeypatch.setattr(triton_moe, "_down_kernel", down)

    def last_orders():
        (g0, g1), (d0, d1) = gate_up.grids[-1], down.grids[-1]
        return ("rows" if g0 > g1 else "cols"), ("rows" if d0 > d1 else "cols")

    tiles = dict(triton_moe.DEFAULT_CONFIG_PREFILL, block_m=16, up_n=16, down_n=16, n_fastest=False)  # several tiles each way
    for start, num_local, with_shared in ((0, 8, True), (3, 4, False)):
        x, w13, w2, weights, ids, shared, ref = _moe_case(13, start, num_local, with_shared)
        base = fused_moe(x, w13, w2, weights, ids, start, shared, config=tiles)
        assert last_orders() == ("rows", "rows")
        torch.testing.assert_close(base, ref, atol=1e-5, rtol=1e-5)
        flipped = dict(tiles, n_fastest=True, down_warps=8, down_stages=2)
        assert torch.equal(fused_moe(x, w13, w2, weights, ids, start, shared, config=flipped), base)
        assert last_orders() == ("cols", "cols")
        with monkeypatch.context() as m:  # more row blocks than a grid's second dimension holds
            m.setattr(triton_moe, "MAX_GRID_Y", 1)
            assert torch.equal(fused_moe(x, w13, w2, weights, ids, start, shared, config=flipped), base)
            assert last_orders() == ("rows", "rows")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_moe_matches_the_reference(dtype):
    """The grouped-GEMM prefill MoE (`LAMINA_MOE_PREFILL=grouped_mm`): routed experts with experts of
    another EP rank (their rows masked) and with the shared expert, against the float32 reference."""
    from lamina.kernels.grouped_mm_moe import grouped_mm_moe

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for start, num_local, with_shared in ((0, 8, True), (3, 4, False), (0, 8, False)):
        x, w13, w2, weights, ids, shared, ref = _moe_case(13, start, num_local, with_shared, dtype=dtype)
        ours = grouped_mm_moe(x, w13, w2, weights, ids, start, shared)
        assert ours.dtype == dtype and ours.shape == ref.shape
        torch.testing.assert_close(ours.float(), ref, **tol)


def test_combine_pairs_skips_rows_of_other_ranks():
    """A pair whose expert lives on another rank (row -1) is never read, so the undefined rows the
    grouped GEMM leaves past its last offset (here NaN) cannot reach the sum; slot order, float32."""
    from lamina.kernels.grouped_mm_moe import combine_pairs

    rows = _rand(5, 40, seed=1)
    rows[0] = float("nan")  # no pair's row (and where a skipped pair's address would point)
    row_of_pair = torch.tensor([2, -1, 4, 3, -1, 1], dtype=torch.int32, device=DEVICE)  # 3 tokens x top-2
    weights = _rand(3, 2, seed=2)
    out = combine_pairs(rows, row_of_pair, weights)
    ref = torch.stack([weights[0, 0] * rows[2], weights[1, 0] * rows[4] + weights[1, 1] * rows[3], weights[2, 1] * rows[1]])
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_mm_moe_on_the_gpu_matches_the_triton_prefill_kernels(moe_prefill_env):
    """At the Qwen3.5-35B-A3B expert shape, 2,048 tokens in bf16: the grouped-GEMM path against
    the Triton grouped kernels (both against the float32 reference's tolerance); in a CUDA graph's
    capture the switch keeps the Triton kernels."""
    from lamina.kernels import triton_moe
    from lamina.kernels.grouped_mm_moe import grouped_mm_moe

    moe_prefill_env("triton")  # fused_moe below must be the Triton kernels, whatever the environment says

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm's bf16 path needs sm90")
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, inter, experts, top_k = 2048, 2048, 512, 256, 8
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    sw13 = torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    sw2 = torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    logits = torch.randn(tokens, experts + 1, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits[:, :experts], -1).topk(top_k, dim=-1)
    shared = (sw13, sw2, logits[:, experts])
    ours = grouped_mm_moe(x, w13, w2, weights.to(torch.bfloat16), ids, 0, shared)
    triton_out = fused_moe(x, w13, w2, weights.to(torch.bfloat16), ids, 0, shared)
    g, u = (x.float() @ sw13.float().t()).chunk(2, dim=-1)
    ref = grouped_experts(x.float(), w13.float(), w2.float(), weights, ids) \
        + torch.sigmoid(logits[:, experts:]) * ((torch.nn.functional.silu(g) * u) @ sw2.float().t())
    scale = ref.abs().max().item()
    assert (ours.float() - ref).abs().max().item() < 2e-2 * scale
    assert (triton_out.float() - ref).abs().max().item() < 2e-2 * scale
    moe_prefill_env("grouped_mm")
    assert triton_moe._prefill_on_grouped_mm(x, w13, w2)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert not triton_moe._prefill_on_grouped_mm(x, w13, w2)
    ep = grouped_mm_moe(x, w13[64:128], w2[64:128], weights.to(torch.bfloat16), ids, 64)  # EP: 1 of 4 ranks
    ep_ref = grouped_experts(x.float(), w13[64:128].float(), w2[64:128].float(), weights, ids, 64)
    assert torch.isfinite(ep).all() and (ep.float() - ep_ref).abs().max().item() < 2e-2 * ep_ref.abs().max().item()


def _moe_case(num_tokens, expert_start, num_local, with_shared, dtype=torch.float32, hidden=48, inter=24):
    """Inputs of a tiny MoE (top-3 of 8 experts; weights rounded to `dtype`) and its float32
    reference computed from those rounded values: (x, w13, w2, weights, ids, shared, ref)."""
    top_k, total_experts = 3, 8
    x = _rand(num_tokens, hidden, seed=1, dtype=dtype)
    w13 = _rand(num_local, 2 * inter, hidden, seed=2, scale=0.2, dtype=dtype)
    w2 = _rand(num_local, hidden, inter, seed=3, scale=0.2, dtype=dtype)
    logits = torch.randn(num_tokens, total_experts + 1, generator=_gen(4)).to(DEVICE)
    weights, ids = torch.softmax(logits[:, :total_experts], -1).topk(top_k, dim=-1)
    weights = weights.to(dtype)
    ref = grouped_experts(x.float(), w13.float(), w2.float(), weights.float(), ids, expert_start)
    shared = None
    if with_shared:
        # row strides of their own (a kernel that takes the experts' stride for the shared expert fails)
        shared_w13 = _rand(2 * inter, hidden + 8, seed=5, scale=0.2, dtype=dtype)[:, :hidden]
        shared_w2 = _rand(hidden, inter + 8, seed=6, scale=0.2, dtype=dtype)[:, :inter]
        shared = (shared_w13, shared_w2, logits[:, total_experts])
        gate, up = torch.nn.functional.linear(x.float(), shared_w13.float()).chunk(2, dim=-1)
        ref = ref + torch.sigmoid(logits[:, total_experts:]) * torch.nn.functional.linear(
            torch.nn.functional.silu(gate) * up, shared_w2.float())
    return x, w13, w2, weights, ids, shared, ref


@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("expert_start,num_local,with_shared", [(0, 8, True), (0, 8, False), (3, 4, False), (3, 4, True)])
def test_gemv_moe_matches_grouped_experts(num_tokens, expert_start, num_local, with_shared):
    """The decode path (two GEMV launches) against the reference, with experts of other EP ranks
    (ids outside [expert_start, expert_start + num_local)) and the shared expert; tiles narrower
    than the weights so the masks run; one program per slot (partials summed by ticket) and one
    program for every slot (the sum in registers)."""
    x, w13, w2, weights, ids, shared, ref = _moe_case(num_tokens, expert_start, num_local, with_shared)
    for down_slots in (1, 9):
        tiles = dict(up_n=16, up_k=32, down_n=32, down_k=32, down_slots=down_slots)
        ours = fused_moe_gemv(x, w13, w2, weights, ids, expert_start, shared, config=tiles)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        again = fused_moe_gemv(x, w13, w2, weights, ids, expert_start, shared, config=tiles)
        assert torch.equal(ours, again)  # the tickets were reset: same sum, same bits
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, expert_start, shared), ref, atol=1e-5, rtol=1e-5)
    # the grouped path on the same case: experts of other ranks beside the shared expert's rows
    grouped = fused_moe(x, w13, w2, weights, ids, expert_start, shared, gemv_max_tokens=0)
    torch.testing.assert_close(grouped, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens,expert_start,num_local,with_shared,dtype,tiles", [
    (1, 0, 8, True, torch.float32, dict(down_slots=1, up_n=16, up_k=32, up_split=2)),  # tickets sum 4 slots
    (2, 0, 8, True, torch.bfloat16, dict(down_slots=8)),  # every slot in one program: no tickets
    (3, 3, 4, True, torch.float32, dict(down_slots=2)),  # experts of other EP ranks
    (4, 3, 4, False, torch.bfloat16, dict(down_slots=2)),  # 3 slots in groups of 2 and 1
])
def test_gemv_moe_pipelined_down(num_tokens, expert_start, num_local, with_shared, dtype, tiles):
    """The pipelined down kernel (a group's slots stepped through down_k intermediate columns at a
    time, groups' float32 partials summed in group order) and the gate/up split over the hidden
    dim (48 columns: parts of 32 and 16) against the reference: intermediate 24 in 16-column steps
    (a partial last step), 48 output rows in tiles of 32, experts of other EP ranks, bf16 and
    float32; a second run gives the same bits (tickets reset, order fixed), and so does the first
    token run alone."""
    cfg = dict(up_n=32, up_k=64, down_n=32, down_k=16, down_stages=2) | tiles
    _assert_moe_gemv(num_tokens, expert_start, num_local, with_shared, dtype, cfg)


def _assert_moe_gemv(num_tokens, expert_start, num_local, with_shared, dtype, cfg):
    """`fused_moe_gemv` with `cfg` against the reference; the same bits again, and for the first
    token run alone (one config for every batch size: a token's bits do not depend on the others)."""
    x, w13, w2, weights, ids, shared, ref = _moe_case(num_tokens, expert_start, num_local, with_shared, dtype)
    ours = fused_moe_gemv(x, w13, w2, weights, ids, expert_start, shared, config=cfg)
    assert ours.dtype == dtype and ours.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    else:  # the activation and the output are rounded to bf16
        assert ((ours.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(ours, fused_moe_gemv(x, w13, w2, weights, ids, expert_start, shared, config=cfg))
    if num_tokens > 1:
        alone = shared and (shared[0], shared[1], shared[2][:1])
        first = fused_moe_gemv(x[:1], w13, w2, weights[:1], ids[:1], expert_start, alone, config=cfg)
        assert torch.equal(first, ours[:1])


@pytest.mark.parametrize("num_tokens,expert_start,num_local,with_shared,dtype", [
    (1, 0, 8, True, torch.float32),
    (3, 3, 4, True, torch.float32),  # experts of other EP ranks
    (2, 0, 8, False, torch.bfloat16),
    (4, 3, 4, True, torch.bfloat16),
])
def test_gemv_moe_fma_kernels(num_tokens, expert_start, num_local, with_shared, dtype):
    """The MoE GEMV kernels without tl.dot (`fma` configs) against the reference: hidden 48 in
    16-column steps and intermediate 24 in 16-column steps (partial last steps), output and
    intermediate rows in tiles that do not divide them, experts of other EP ranks, bf16 and float32;
    the same bits again, and for the first token run alone (one config at every T)."""
    cfg = dict(fma=1, up_n=4, up_k=16, down_n=8, down_k=16, up_warps=2, down_warps=2)
    _assert_moe_gemv(num_tokens, expert_start, num_local, with_shared, dtype, cfg)


def test_moe_gemv_fma_switch(monkeypatch):
    """By default (and with LAMINA_MOE_GEMV_FMA=1) every token count takes the FMA kernels (the
    same bits as their config given explicitly), with 0 none; a given config without fma keeps the
    tl.dot kernels; bad values are refused."""
    from lamina.kernels import selection, triton_moe_gemv

    x, w13, w2, weights, ids, shared, ref = _moe_case(2, 0, 8, True)
    fma_calls = []
    fma_kernels = triton_moe_gemv._fused_moe_fma
    monkeypatch.setattr(triton_moe_gemv, "_fused_moe_fma", lambda *a: fma_calls.append(a[0].shape[0]) or fma_kernels(*a))
    one = (x[:1], w13, w2, weights[:1], ids[:1], 0, (shared[0], shared[1], shared[2][:1]))
    try:
        for value, fma_token_counts in ((None, [1, 2]), ("0", []), ("1", [1, 2])):
            if value is None:
                monkeypatch.delenv("LAMINA_MOE_GEMV_FMA", raising=False)
            else:
                monkeypatch.setenv("LAMINA_MOE_GEMV_FMA", value)
            selection.moe_gemv_fma_max_tokens.cache_clear()
            fma_calls.clear()
            torch.testing.assert_close(fused_moe_gemv(*one), ref[:1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(fused_moe_gemv(x, w13, w2, weights, ids, 0, shared), ref, atol=1e-5, rtol=1e-5)
            assert fma_calls == fma_token_counts, value
            if value is None:  # one program per token: each token's sums whatever the other tokens
                both = fused_moe_gemv(x, w13, w2, weights, ids, 0, shared)
                for r in range(2):
                    alone = (x[r : r + 1], w13, w2, weights[r : r + 1], ids[r : r + 1], 0,
                             (shared[0], shared[1], shared[2][r : r + 1]))
                    assert torch.equal(fused_moe_gemv(*alone), both[r : r + 1]), r
        monkeypatch.setenv("LAMINA_MOE_GEMV_FMA", "1")
        selection.moe_gemv_fma_max_tokens.cache_clear()
        ours = fused_moe_gemv(x, w13, w2, weights, ids, 0, shared)
        assert torch.equal(ours, fused_moe_gemv(x, w13, w2, weights, ids, 0, shared, config=triton_moe_gemv.GEMV_CONFIG_FMA))
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        tiles = dict(up_n=16, up_k=32, down_n=32, down_k=32)
        with_dot = fused_moe_gemv(x, w13, w2, weights, ids, 0, shared, config=tiles)
        monkeypatch.setenv("LAMINA_MOE_GEMV_FMA", "0")
        selection.moe_gemv_fma_max_tokens.cache_clear()
        assert torch.equal(with_dot, fused_moe_gemv(x, w13, w2, weights, ids, 0, shared, config=tiles))
        monkeypatch.setenv("LAMINA_MOE_GEMV_FMA", "yes")
        selection.moe_gemv_fma_max_tokens.cache_clear()
        with pytest.raises(ValueError, match="LAMINA_MOE_GEMV_FMA = 'yes'"):
            fused_moe_gemv(x, w13, w2, weights, ids, 0, shared)
    finally:
        monkeypatch.delenv("LAMINA_MOE_GEMV_FMA", raising=False)
        selection.moe_gemv_fma_max_tokens.cache_clear()


def test_gemv_moe_config_errors():
    x, w13, w2, weights, ids, shared, _ = _moe_case(1, 0, 8, False)
    with pytest.raises(ValueError, match="unknown config keys \\['down_split'\\]"):
        fused_moe_gemv(x, w13, w2, weights, ids, config=dict(down_split=True))
    with pytest.raises(ValueError, match="unknown config keys \\['down_kernel'\\]"):
        fused_moe_gemv(x, w13, w2, weights, ids, config=dict(down_kernel="split"))  # the removed kernels
    with pytest.raises(ValueError, match="down_k = 24 must be a power of two"):
        fused_moe_gemv(x, w13, w2, weights, ids, config=dict(down_k=24))
    with pytest.raises(ValueError, match="down_slots = 0 must be >= 1"):
        fused_moe_gemv(x, w13, w2, weights, ids, config=dict(down_slots=0))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_slots_adds_in_slot_order(dtype, shared):
    """The fused MoE's slot sum: each part (in the parts' dtype) times its routing weight, the shared
    expert's part times the sigmoid of its logit, added in float32 in slot order and rounded once."""
    from lamina.kernels.triton_moe import sum_slots

    top_k = 4
    parts = _rand(3, top_k + shared, 40, seed=1).to(dtype)  # [T, S, H]
    weights = _rand(3, top_k, seed=2).to(dtype)
    logit = _rand(3, seed=3).to(dtype) if shared else None
    factors = [weights[:, s].float() for s in range(top_k)] + ([torch.sigmoid(logit.float())] if shared else [])
    ref = factors[0][:, None] * parts[:, 0].float()
    for slot in range(1, top_k + shared):
        ref += factors[slot][:, None] * parts[:, slot].float()
    got = sum_slots(parts, weights, logit)
    assert got.dtype == dtype
    if dtype == torch.float32:  # a GPU fuses each weight x part into the add (FMA); the sigmoid's exp
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=4 * torch.finfo(dtype).eps)
        if DEVICE == "cpu" and not shared:  # the interpreter: a product, then the add, as the reference
            assert torch.equal(got, ref)
    else:  # the interpreter rounds float32 -> bfloat16 toward zero, the GPU to nearest: one step apart
        torch.testing.assert_close(got, ref.to(dtype), atol=0, rtol=2 * torch.finfo(dtype).eps)
    # weights with a last stride of 2 (copied) and with a row stride of their own (read in place)
    wide = torch.stack([weights, -weights], dim=2).reshape(3, 2 * top_k)[:, ::2]  # [T, k], stride 2
    assert wide.stride(-1) == 2 and torch.equal(wide, weights)
    assert torch.equal(sum_slots(parts, wide, logit), got)
    rows = torch.cat([weights, -weights], dim=1)[:, :top_k]  # [T, k], row stride 2k
    assert rows.stride() == (2 * top_k, 1) and torch.equal(rows, weights)
    assert torch.equal(sum_slots(parts, rows, logit), got)
    assert sum_slots(parts[:0], weights[:0], None if logit is None else logit[:0]).shape == (0, 40)
    with pytest.raises(ValueError, match="parts hold 5 slots, weights 4, shared expert False"):
        sum_slots(_rand(3, 5, 40, seed=1), weights)


@pytest.mark.parametrize("shared", [False, True])
def test_sum_slots_skips_the_slots_of_other_ranks_experts(shared):
    """With the routed ids given, slots whose expert lies outside this rank's range are neither read
    nor added: their parts may hold anything (here NaN), the sum equals zero parts there."""
    from lamina.kernels.triton_moe import sum_slots

    top_k, expert_start, num_local = 3, 4, 2
    ids = torch.tensor([[4, 0, 5], [7, 3, 8], [5, 4, 6]], device=DEVICE)  # [T, k]; local: 4 and 5
    local = (ids >= expert_start) & (ids < expert_start + num_local)
    parts = _rand(3, top_k + shared, 40, seed=1)  # [T, S, H]
    zeroed = parts.clone()
    zeroed[:, :top_k][~local] = 0.0
    parts[:, :top_k][~local] = float("nan")
    weights = _rand(3, top_k, seed=2)
    logit = _rand(3, seed=3) if shared else None
    got = sum_slots(parts, weights, logit, local_ids=(ids, expert_start, num_local))
    assert torch.isfinite(got).all()
    assert torch.equal(got, sum_slots(zeroed, weights, logit))
    with pytest.raises(ValueError, match=r"topk_ids \(3, 2\) do not match the weights \(3, 3\)"):
        sum_slots(parts, weights, logit, local_ids=(ids[:, :2], expert_start, num_local))


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4])
def test_gemv_matches_linear(rows):
    """The decode GEMVs against F.linear, with a weight whose sizes are not multiples of the tiles
    and a strided input: the split-K kernel (partials summed by each tile's last program) for one
    program per tile and for 2 and 3 splits, twice (the tickets are left zero), and the FMA kernel
    at five tiles (two of them preloading); each row alone equals its row in the batch (a row's sum never depends on the
    others)."""
    from lamina.kernels.triton_gemv import gemv, linear

    weight = _rand(37, 300, seed=1, scale=0.1)
    x = _rand(rows, 600, seed=2)[:, ::2]  # [rows, 300], row stride 600
    ref = torch.nn.functional.linear(x, weight)
    for split in (1, 2, 3):
        cfg = dict(block_n=16, block_k=64, split=split)
        ours = gemv(x, weight, cfg)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(ours, gemv(x, weight, cfg))
    for r in range(rows):
        assert torch.equal(gemv(x[r : r + 1], weight, cfg), ours[r : r + 1])
    # the kernel without tl.dot (partial tiles, 5 / 3 / 1 / 3 / 1 K steps, the last two with the first step
    # read before the PDL wait)
    for block_n, block_k, preload in ((1, 64, 0), (4, 128, 0), (8, 512, 0), (2, 64, 128), (1, 64, 512)):
        fma = dict(fma=1, block_n=block_n, block_k=block_k, warps=2, preload=preload)
        ours = gemv(x, weight, fma)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        for r in range(rows):
            assert torch.equal(gemv(x[r : r + 1], weight, fma), ours[r : r + 1])
    from lamina.kernels.selection import gemv_fma
    from lamina.kernels.triton_gemv import gemv_config

    if gemv_fma():  # the default (no config) launches the kernel and tiles of this shape and row count
        assert torch.equal(gemv(x, weight), gemv(x, weight, gemv_config(*weight.shape, rows)))
    torch.testing.assert_close(linear(x, weight), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv(_rand(5, 300, seed=3), weight)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, _rand(300, 37, seed=4).t())


@pytest.mark.parametrize("rows,top_k,renormalize", [(1, 4, True), (3, 10, False), (4, 4, False)])
def test_gemv_route_equals_the_gemv_then_the_routing(rows, top_k, renormalize):
    """The router GEMV with the routing in its last tile's program: the logits are `gemv`'s and
    the weights / ids `route_softmax_topk`'s of those logits' expert columns (extra gate rows after
    the experts' are returned, not routed), with one program per tile and with split partials;
    twice (both tickets are left zero), and a row alone gets its row of the batch. The weights are
    bitwise the routing kernel's under the interpreter; on a GPU its one warp and the GEMV's four
    may group the softmax sums differently (float32 rounding)."""
    from lamina.kernels.triton_gemv import gemv, gemv_route

    num_experts = 40
    weight = _rand(48, 200, seed=1, scale=0.1)  # 40 expert rows, a gate row, 7 zero-like rows
    x = _rand(rows, 200, seed=2)
    for split in (1, 3):
        cfg = dict(block_n=16, block_k=32, split=split)  # 3 tiles: the route waits for all of them
        logits, weights, ids = gemv_route(x, weight, num_experts, top_k, renormalize, cfg)
        assert torch.equal(logits, gemv(x, weight, cfg))
        ref_w, ref_i = route_softmax_topk(logits[:, :num_experts], top_k, renormalize, x.dtype)
        assert torch.equal(ids, ref_i)
        exact = dict(atol=0, rtol=0) if DEVICE == "cpu" else dict(atol=0, rtol=2e-6)
        torch.testing.assert_close(weights, ref_w, **exact)
        again = gemv_route(x, weight, num_experts, top_k, renormalize, cfg)
        assert all(torch.equal(a, b) for a, b in zip(again, (logits, weights, ids)))
        for r in range(rows):
            one = gemv_route(x[r : r + 1], weight, num_experts, top_k, renormalize, cfg)
            assert all(torch.equal(a, b[r : r + 1]) for a, b in zip(one, (logits, weights, ids)))
    with pytest.raises(ValueError, match="top_k 41 of num_experts 40"):
        gemv_route(x, weight, num_experts, 41, renormalize)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 64, 1024, 2560])
def test_fused_moe_bf16_at_real_width(num_tokens):
    """Qwen3.5-35B-A3B: 256 experts of 512 x 2048, top-8, bf16 (decode sizes, and prefill chunks on
    the prefill and long-prefill tiles)."""
    hidden, inter, top_k, experts = 2048, 512, 8, 256
    x = _rand(num_tokens, hidden, seed=1, dtype=torch.bfloat16)
    w13 = _rand(experts, 2 * inter, hidden, seed=2, scale=0.02, dtype=torch.bfloat16)
    w2 = _rand(experts, hidden, inter, seed=3, scale=0.02, dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(num_tokens, experts, device=DEVICE), -1).topk(top_k, dim=-1)
    weights = weights.to(torch.bfloat16)
    shared_w13 = _rand(2 * inter, hidden, seed=4, scale=0.02, dtype=torch.bfloat16)
    shared_w2 = _rand(hidden, inter, seed=5, scale=0.02, dtype=torch.bfloat16)
    shared_logit = torch.randn(num_tokens, device=DEVICE)
    ours = fused_moe(x, w13, w2, weights, ids, shared=(shared_w13, shared_w2, shared_logit)).float()
    gate, up = torch.nn.functional.linear(x.float(), shared_w13.float()).chunk(2, dim=-1)
    shared_out = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, shared_w2.float())
    ref = grouped_experts(x.float(), w13.float(), w2.float(), weights.float(), ids)
    ref = ref + torch.sigmoid(shared_logit)[:, None] * shared_out
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-2


# ---- the engine on the Triton kernels (and the decode graphs' static buffers) ------------------


def _greedy(path, prompts, *, graphs: bool, kernels: str, monkeypatch, **kwargs):
    from lamina import LLM, SamplingParams

    monkeypatch.setenv("LAMINA_KERNELS", kernels)
    if DEVICE == "cuda":  # fla-core's prefill multiplies float32 in tf32: tests/test_gdn_prefill.py checks it
        monkeypatch.setenv("LAMINA_GDN_PREFILL", "reference")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    with LLM(str(path), device=DEVICE, dtype="float32", show_progress=False, enforce_eager=not graphs, **kwargs) as llm:
        runner = llm.engine.executor.runner
        if graphs and DEVICE == "cpu":
            assert runner.capture_decode_graphs(llm.engine.max_num_seqs, llm.engine.max_model_len, static_off_cuda=True)
        assert (runner.decode_graphs is not None) == graphs
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [float(next(iter(d.values()))) for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("graphs", [True], ids=["graphs"])  # eager: tests/test_gdn_prefill.py's engine test
def test_engine_on_triton_kernels_matches_reference(qwen3_5_moe_short_dir, graphs, monkeypatch):
    """Greedy tokens and logprobs on the Triton kernel set (eager, or through the decode graphs'
    static buffers with padded batch sizes: 3 requests run as 4), with asynchronous scheduling,
    equal the reference kernels' (synchronous). The three-layer checkpoint: every kind of layer,
    at 3/5 of the interpreter's launches."""
    path = qwen3_5_moe_short_dir
    prompts = [[5, 17, 300], [9] * 11, list(range(40, 57))]
    ref = _greedy(path, prompts, graphs=False, kernels="reference", monkeypatch=monkeypatch, max_num_seqs=5)
    # overlapped (asynchronous scheduling): pending tokens are filled in on the device, in the
    # graphs' static input buffer or the eager step's token ids
    ours = _greedy(path, prompts, graphs=graphs, kernels="triton", monkeypatch=monkeypatch, max_num_seqs=5,
                   async_scheduling=True)
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, ours):
        assert ids == ref_ids
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)


def test_engine_with_triton_prefill_attention_matches_reference(qwen3_5_moe_short_dir, monkeypatch):
    """`LAMINA_PREFILL_ATTENTION=triton` (the default: fresh prompts and continued chunks on the varlen
    kernel; with `LAMINA_FRESH_PROMPT_ATTENTION=sdpa` fresh prompts on SDPA's causal rule) and `=sdpa`:
    prompts chunked over several steps (an 8-token budget), so steps mix continued chunks, fresh
    prompts and decodes, give the reference kernels' tokens."""
    from lamina.kernels import triton_prefill_attention

    calls = []
    real = triton_prefill_attention.paged_prefill_attention
    monkeypatch.setattr(triton_prefill_attention, "paged_prefill_attention",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    path = qwen3_5_moe_short_dir
    prompts = [[5, 17, 300], list(range(40, 53))]  # steps: 3 + 5 prompt tokens; a decode + 7 more; a decode + the last
    options = dict(max_num_seqs=4, max_num_batched_tokens=8)
    ref = _greedy(path, prompts, graphs=False, kernels="reference", monkeypatch=monkeypatch, **options)
    monkeypatch.setenv("LAMINA_PREFILL_ATTENTION", "triton")
    monkeypatch.delenv("LAMINA_FRESH_PROMPT_ATTENTION", raising=False)
    ours = _greedy(path, prompts, graphs=False, kernels="triton", monkeypatch=monkeypatch, **options)
    assert calls and calls[0] == 8  # the varlen kernel ran, the first step's fresh prompts (3 + 5 tokens) too
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, ours):
        assert ids == ref_ids
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
    with_fresh = list(calls)
    calls.clear()
    monkeypatch.setenv("LAMINA_FRESH_PROMPT_ATTENTION", "sdpa")  # fresh prompts on SDPA's causal rule
    causal = _greedy(path, prompts, graphs=False, kernels="triton", monkeypatch=monkeypatch, **options)
    assert calls and len(calls) < len(with_fresh) and 8 not in calls  # continued chunks only
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, causal):
        assert ids == ref_ids
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
    monkeypatch.delenv("LAMINA_FRESH_PROMPT_ATTENTION")
    calls.clear()
    monkeypatch.setenv("LAMINA_PREFILL_ATTENTION", "sdpa")  # continued chunks on SDPA's masked call
    masked = _greedy(path, prompts, graphs=False, kernels="triton", monkeypatch=monkeypatch, **options)
    assert not calls
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, masked):
        assert ids == ref_ids
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
    monkeypatch.setenv("LAMINA_PREFILL_ATTENTION", "flash")
    from lamina.kernels.selection import triton_prefill_attention_enabled

    with pytest.raises(ValueError, match="must be 'sdpa' or 'triton'"):
        triton_prefill_attention_enabled("triton")


def test_moe_gemv_switch(monkeypatch):
    from lamina.kernels.selection import moe_gemv_max_tokens
    from lamina.kernels.triton_moe_gemv import GEMV_MAX_TOKENS

    monkeypatch.delenv("LAMINA_MOE_GEMV", raising=False)
    assert moe_gemv_max_tokens() == GEMV_MAX_TOKENS
    monkeypatch.setenv("LAMINA_MOE_GEMV", "0")
    assert moe_gemv_max_tokens() == 0
    monkeypatch.setenv("LAMINA_MOE_GEMV", "yes")
    with pytest.raises(ValueError, match="LAMINA_MOE_GEMV"):
        moe_gemv_max_tokens()


def test_gemv_fma_switch_and_tiles(monkeypatch):
    """LAMINA_GEMV_FMA picks the decode GEMV (read once per process: the cache is cleared here):
    by default the FMA kernel for small outputs (the router) at every row count with one tile, and
    for the others at one row (1 feature a program below 4,096 rows, 4 from there, the first 512
    features read before the PDL wait) and two (the first 2,048), the split-K kernel for
    three and four rows, for inputs the FMA kernel would unroll too far, and when switched off;
    bad values are refused."""
    from lamina.kernels import selection, triton_gemv

    def config(out_features, in_features, value, rows=1):
        selection.gemv_fma.cache_clear()
        if value is None:
            monkeypatch.delenv("LAMINA_GEMV_FMA", raising=False)
        else:
            monkeypatch.setenv("LAMINA_GEMV_FMA", value)
        return triton_gemv.gemv_config(out_features, in_features, rows)

    try:
        assert config(2048, 4096, None) == triton_gemv.GEMV_CONFIG_FMA == dict(fma=1, block_n=1, block_k=512, warps=4,
                                                                              preload=512)
        assert config(2048, 4096, None, rows=2) == dict(triton_gemv.GEMV_CONFIG_FMA, preload=2048)
        assert config(2048, 4096, None, rows=3) == config(2048, 4096, None, rows=4) == triton_gemv.GEMV_CONFIG
        assert config(12352, 2048, "1") == triton_gemv.GEMV_CONFIG_FMA_WIDE and triton_gemv.GEMV_CONFIG_FMA_WIDE["preload"] == 512
        assert config(12352, 2048, "1", rows=2) == dict(triton_gemv.GEMV_CONFIG_FMA_WIDE, preload=2048)
        assert config(12352, 2048, "1", rows=4) == triton_gemv.GEMV_CONFIG_WIDE
        for rows in (1, 2, 3, 4):  # the router (256 experts + the shared-expert gate, padded): one tile
            assert config(264, 2048, None, rows=rows) == config(1024, 2048, None, rows=rows) == triton_gemv.GEMV_CONFIG_FMA_SMALL
        assert triton_gemv.GEMV_CONFIG_FMA_SMALL == dict(fma=1, block_n=1, block_k=512, warps=8, preload=2048)
        assert config(1032, 2048, None, rows=3) == triton_gemv.GEMV_CONFIG
        assert config(2048, triton_gemv.FMA_MAX_IN_FEATURES + 1, "1") == triton_gemv.GEMV_CONFIG
        assert config(264, triton_gemv.FMA_MAX_IN_FEATURES + 1, "1") == triton_gemv.GEMV_CONFIG_SMALL
        assert config(2048, 4096, "0") == triton_gemv.GEMV_CONFIG and config(264, 2048, "0") == triton_gemv.GEMV_CONFIG_SMALL
        assert config(2048, 4096, "0", rows=2) == triton_gemv.GEMV_CONFIG
        with pytest.raises(ValueError, match="LAMINA_GEMV_FMA = 'yes'"):
            config(2048, 4096, "yes")
    finally:
        monkeypatch.delenv("LAMINA_GEMV_FMA", raising=False)
        selection.gemv_fma.cache_clear()


def test_gemv_tiles_fit_shared_memory():
    """The one-token gate/up tile asked for 288 KiB of shared memory in float32 on an H200 (limit
    227 KiB); the tiles narrow to fit, keeping the tuned bf16 tiles as they are."""
    from lamina.kernels.triton_moe_gemv import GEMV_CONFIG, GEMV_CONFIG_ONE_TOKEN, _fit_shared_memory, _shared_memory

    def needed(cfg, element_size):
        return (cfg["up_stages"] - 1) * (2 * cfg["up_n"] + 16) * cfg["up_k"] * element_size

    assert needed(dict(GEMV_CONFIG, up_n=64, up_stages=3), 4) == 294912  # what Triton reported on the H200
    for base in (GEMV_CONFIG, GEMV_CONFIG_ONE_TOKEN):
        bf16 = dict(base)
        _fit_shared_memory(bf16, 2)
        assert bf16 == base
        fp32 = dict(base)
        _fit_shared_memory(fp32, 4)
        assert needed(fp32, 4) <= 227 * 1024 and fp32["up_n"] >= 16
    # The pipelined down tile: (stages - 1) x ([down_k, down_n] + [16, down_k]), as sm_90 compiles
    # of the kernel asked for (221184 bytes at 128 x 128, 4 stages, float32).
    pipelined = dict(GEMV_CONFIG, down_n=256, down_k=128, down_stages=4)
    bf16 = dict(pipelined)
    _fit_shared_memory(bf16, 2)
    assert bf16 == pipelined  # 208896 bytes
    _fit_shared_memory(pipelined, 4)
    assert (pipelined["down_n"], pipelined["down_stages"]) == (128, 4)
    assert _shared_memory(pipelined, 4) == (needed(pipelined, 4), 221184)

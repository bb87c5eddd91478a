"""The Q-tokens-per-request Triton kernels (MTP verification) against the torch references.

Under Triton's CPU interpreter where there is no GPU (tests/conftest.py turns it on), at tiny
shapes: ragged contexts, Q = 1..4, state captures equal to stepping the reference one token at a
time, padding rows (negative state slot) writing nothing.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

triton = pytest.importorskip("triton")

from lamina.kernels.causal_conv1d import causal_conv1d_varlen  # noqa: E402
from lamina.kernels.gated_delta_rule import recurrent_gated_delta_rule_step  # noqa: E402
from lamina.kernels.paged_attention import paged_attention  # noqa: E402
from lamina.kernels.triton_verify import (  # noqa: E402
    causal_conv1d_verify,
    gated_delta_rule_verify,
    paged_verify_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QS = [1, 2, 3, 4]


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _rand(*shape, seed, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(DEVICE, dtype)


# ---- attention ------------------------------------------------------------------------------------


@pytest.mark.parametrize("queries", QS)
@pytest.mark.parametrize("hq,hkv,head_dim,page", [(4, 2, 16, 4), (6, 2, 24, 8)])
def test_paged_verify_attention_matches_reference(queries, hq, hkv, head_dim, page):
    seq_lens = torch.tensor([queries, 5 + queries, 37, 70], device=DEVICE)  # ragged contexts
    bsz = seq_lens.shape[0]
    max_pages = -(-70 // page)
    num_blocks = bsz * max_pages + 3
    k_cache = _rand(num_blocks, page, hkv, head_dim, seed=1)
    v_cache = _rand(num_blocks, page, hkv, head_dim, seed=2)
    perm = torch.randperm(num_blocks, generator=_gen(3)).to(DEVICE)
    block_tables = perm[: bsz * max_pages].view(bsz, max_pages)  # [B, pages]: distinct, shuffled blocks
    q = _rand(bsz * queries, hq, head_dim, seed=4)
    gate = _rand(bsz * queries, hq, head_dim, seed=5)
    qsl = torch.arange(bsz + 1, device=DEVICE) * queries  # [B+1]
    ref = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, queries, int(seq_lens.max()), head_dim**-0.5)
    ours = paged_verify_attention(q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5, queries)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5)
    gated = paged_verify_attention(q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5, queries, gate=gate)
    torch.testing.assert_close(gated, ref * torch.sigmoid(gate), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("queries", [2, 4])
def test_verify_rows_equal_the_one_token_kernel_at_their_positions(queries):
    """Query i of a request is computed as the decode kernel computes one query at position
    seq_len - Q + i: the same key blocks in the same programs, the keys past it adding exactly
    zero, so MTP verification gives plain decode's attention bit for bit. The contexts put a row's
    last key just before a block edge (a split whose keys all lie past that row) and cross several
    blocks per split."""
    from lamina.kernels.triton_decode import paged_decode_attention

    hq, hkv, head_dim, page = 4, 2, 16, 8
    seq_lens = torch.tensor([queries, 63 + queries, 64 + queries - 1, 66, 129, 300], device=DEVICE)
    bsz = seq_lens.shape[0]
    max_pages = -(-300 // page)
    num_blocks = bsz * max_pages + 1
    k_cache = _rand(num_blocks, page, hkv, head_dim, seed=11)
    v_cache = _rand(num_blocks, page, hkv, head_dim, seed=12)
    block_tables = torch.randperm(num_blocks, generator=_gen(13)).to(DEVICE)[: bsz * max_pages].view(bsz, max_pages)
    q = _rand(bsz * queries, hq, head_dim, seed=14)
    gate = _rand(bsz * queries, hq, head_dim, seed=15)
    verify = paged_verify_attention(q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5, queries, gate=gate)
    assert torch.isfinite(verify).all()
    for i in range(queries):
        rows = torch.arange(bsz, device=DEVICE) * queries + i  # token i of every request
        one = paged_decode_attention(q[rows], k_cache, v_cache, block_tables, seq_lens - queries + i + 1,
                                     head_dim**-0.5, gate=gate[rows])
        assert torch.equal(verify[rows], one), f"query {i}"
    qsl = torch.arange(bsz + 1, device=DEVICE) * queries  # [B+1]
    ref = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, queries, 300, head_dim**-0.5)
    torch.testing.assert_close(verify, ref * torch.sigmoid(gate), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("hq,hkv,queries", [(16, 1, 3), (32, 2, 4), (8, 1, 5), (10, 2, 8), (48, 1, 2)])
def test_verify_rows_past_one_row_tile_equal_the_one_token_kernel(hq, hkv, queries):
    """Q x GROUP above ROW_TILE (32) rows: the query tokens of a (request, KV head) are split into
    row tiles (GROUP 16: 2 tokens a tile; GROUP 8: 4; GROUP 5: 6 tokens, 30 of 32 rows; GROUP 48: one
    token, 64 rows), each a program per split with its own partials and ticket. Every row, those of
    the second and later tiles and of a partly filled last tile too, equals the one-token kernel at
    its position exactly (float32 under the interpreter), and the reference within rounding."""
    from lamina.kernels.triton_decode import ROW_TILE, paged_decode_attention

    assert queries * (hq // hkv) > ROW_TILE  # more than one row tile
    head_dim, page = 16, 8
    seq_lens = torch.tensor([queries, 64 + queries - 2, 130], device=DEVICE)  # a row whose split holds no key
    bsz = seq_lens.shape[0]
    max_pages = -(-130 // page)
    num_blocks = bsz * max_pages + 1
    k_cache = _rand(num_blocks, page, hkv, head_dim, seed=31)
    v_cache = _rand(num_blocks, page, hkv, head_dim, seed=32)
    block_tables = torch.randperm(num_blocks, generator=_gen(33)).to(DEVICE)[: bsz * max_pages].view(bsz, max_pages)
    q = _rand(bsz * queries, hq, head_dim, seed=34)
    gate = _rand(bsz * queries, hq, head_dim, seed=35)
    verify = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5, gate=gate,
                                    queries=queries)
    assert torch.isfinite(verify).all()
    for i in range(queries):
        rows = torch.arange(bsz, device=DEVICE) * queries + i  # token i of every request
        one = paged_decode_attention(q[rows], k_cache, v_cache, block_tables, seq_lens - queries + i + 1,
                                     head_dim**-0.5, gate=gate[rows])
        assert torch.equal(verify[rows], one), f"query {i}: {(verify[rows] - one).abs().max()}"
    qsl = torch.arange(bsz + 1, device=DEVICE) * queries  # [B+1]
    ref = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, queries, 130, head_dim**-0.5)
    torch.testing.assert_close(verify, ref * torch.sigmoid(gate), atol=2e-5, rtol=2e-5)


def test_paged_verify_attention_rejects_ragged_batches():
    q = _rand(5, 2, 16, seed=1)
    cache = _rand(4, 4, 1, 16, seed=2)
    with pytest.raises(ValueError, match="whole number"):
        paged_verify_attention(q, cache, cache, torch.zeros(2, 2, dtype=torch.long), torch.tensor([3, 3]), 0.25, 2)


# ---- gated delta rule -------------------------------------------------------------------------------


def _step_reference(q, k, v, g, beta, state, queries):
    """Stepping the reference one token at a time: outputs [B*Q, Hv, Dv], states after every token
    [B, Q, Hv, Dk, Dv]."""
    bsz = state.shape[0]
    outs, states = [], []
    for i in range(queries):
        rows = torch.arange(bsz, device=q.device) * queries + i  # token i of every request
        out, state = recurrent_gated_delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
        outs.append(out)
        states.append(state)
    out = torch.stack(outs, dim=1).reshape(bsz * queries, *outs[0].shape[1:])  # [B, Q, Hv, Dv] -> [B*Q, Hv, Dv]
    return out, torch.stack(states, dim=1)  # [B, Q, Hv, Dk, Dv]


@pytest.mark.parametrize("queries", QS)
@pytest.mark.parametrize("raw_gates", [False, True])
def test_gated_delta_rule_verify_steps_and_captures(queries, raw_gates):
    hk, hv, dk, dv = 2, 4, 16, 16
    bsz, num_slots = 4, 7
    tokens = bsz * queries
    q, k, v = _rand(tokens, hk, dk, seed=1), _rand(tokens, hk, dk, seed=2), _rand(tokens, hv, dv, seed=3)
    a, b = _rand(tokens, hv, seed=4), _rand(tokens, hv, seed=5)
    a_log, dt_bias = _rand(hv, seed=6, scale=0.5), _rand(hv, seed=7, scale=0.5)
    if raw_gates:
        g, beta = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias), torch.sigmoid(b)
    else:
        g, beta = -torch.rand(tokens, hv, generator=_gen(8)).to(DEVICE), torch.rand(tokens, hv, generator=_gen(9)).to(DEVICE)
    pool = _rand(num_slots, hv, dk, dv, seed=10, scale=0.3)
    slots = torch.tensor([5, 0, -1, 2], device=DEVICE)  # row 2 is padding
    keep = torch.tensor([True, False, True, True], device=DEVICE)
    live = slots >= 0
    state_in = torch.where((keep & live)[:, None, None, None], pool[slots.clamp(min=0)], 0.0)  # [B, Hv, Dk, Dv]
    ref_out, ref_states = _step_reference(q, k, v, g, beta, state_in, queries)
    expected_pool = pool.clone()
    expected_pool[slots[live]] = ref_states[live, -1]
    capture = torch.full((bsz * max(queries - 1, 1) + 2, hv, dk, dv), 7.0, device=DEVICE)  # 2 spare rows
    expected_capture = capture.clone()
    for r in range(bsz):
        if live[r]:
            expected_capture[r * (queries - 1) : (r + 1) * (queries - 1)] = ref_states[r, :-1]
    gates = dict(a_log=a_log, dt_bias=dt_bias) if raw_gates else {}
    out = gated_delta_rule_verify(q, k, v, a if raw_gates else g, b if raw_gates else beta, pool, slots, keep,
                                  queries, capture=capture, **gates)
    torch.testing.assert_close(out[live.repeat_interleave(queries)], ref_out[live.repeat_interleave(queries)],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected_pool, atol=1e-5, rtol=1e-5)  # other slots untouched
    torch.testing.assert_close(capture, expected_capture, atol=1e-5, rtol=1e-5)  # padding rows untouched


def test_gated_delta_rule_verify_one_query_is_the_decode_kernel():
    hk, hv, dk, dv = 1, 2, 16, 16
    q, k, v = _rand(3, hk, dk, seed=1), _rand(3, hk, dk, seed=2), _rand(3, hv, dv, seed=3)
    g, beta = -torch.rand(3, hv, generator=_gen(4)).to(DEVICE), torch.rand(3, hv, generator=_gen(5)).to(DEVICE)
    pool = _rand(4, hv, dk, dv, seed=6)
    slots, keep = torch.tensor([3, 1, 0], device=DEVICE), torch.tensor([True, True, False], device=DEVICE)
    from lamina.kernels.triton_decode import gated_delta_rule_decode

    pool2 = pool.clone()
    out = gated_delta_rule_verify(q, k, v, g, beta, pool, slots, keep, 1)
    torch.testing.assert_close(out, gated_delta_rule_decode(q, k, v, g, beta, pool2, slots, keep), rtol=0, atol=0)
    torch.testing.assert_close(pool, pool2, rtol=0, atol=0)


# ---- causal conv1d ----------------------------------------------------------------------------------


@pytest.mark.parametrize("queries", QS)
@pytest.mark.parametrize("kernel", [4, 2])
def test_causal_conv1d_verify_steps_and_captures(queries, kernel):
    channels, bsz, num_slots = 300, 4, 6  # channels over one block of 256
    tokens = bsz * queries
    x = _rand(tokens, 2 * channels, seed=1)[:, :channels]  # [B*Q, C], strided rows
    weight = _rand(channels, kernel, seed=2)
    pool = _rand(num_slots, channels, kernel - 1, seed=3)
    slots = torch.tensor([-1, 4, 1, 3], device=DEVICE)  # row 0 is padding
    keep = torch.tensor([True, True, False, True], device=DEVICE)
    live = slots >= 0
    state_in = torch.where((keep & live)[:, None, None], pool[slots.clamp(min=0)], 0.0)  # [B, C, K-1]
    qsl = torch.arange(bsz + 1, device=DEVICE) * queries  # [B+1]
    req = torch.arange(bsz, device=DEVICE).repeat_interleave(queries)  # [B*Q]: every token captured
    off = torch.arange(queries, device=DEVICE).repeat(bsz)  # [B*Q]
    ref_out, ref_final, ref_states = causal_conv1d_varlen(x, weight, state_in, qsl, queries, capture=(req, off))
    ref_states = ref_states.view(bsz, queries, channels, kernel - 1)  # [B, Q, C, K-1]
    expected_pool = pool.clone()
    expected_pool[slots[live]] = ref_final[live]
    capture = torch.full((bsz * max(queries - 1, 1) + 1, channels, kernel - 1), 5.0, device=DEVICE)
    expected_capture = capture.clone()
    for r in range(bsz):
        if live[r]:
            expected_capture[r * (queries - 1) : (r + 1) * (queries - 1)] = ref_states[r, :-1]
    out = causal_conv1d_verify(x, weight, pool, slots, keep, queries, capture=capture)
    rows = live.repeat_interleave(queries)
    torch.testing.assert_close(out[rows], ref_out[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected_pool, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(capture, expected_capture, atol=1e-6, rtol=1e-6)


# ---- the Qwen3.5-35B-A3B widths (GPU only) ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("queries", [2, 4])
def test_verify_kernels_at_real_width(queries):
    """bf16 activations at the 35B shapes: attention 16 q / 2 kv heads of 256, delta rule 16 k / 32 v
    heads of 128, conv over 8192 channels; 64 requests with contexts up to 2000 tokens."""
    bsz, page = 64, 16
    seq_lens = torch.randint(queries, 2000, (bsz,), generator=_gen(0)).to(DEVICE)
    max_pages = -(-2000 // page)
    k_cache = _rand(bsz * max_pages, page, 2, 256, seed=1, dtype=torch.bfloat16)
    v_cache = _rand(bsz * max_pages, page, 2, 256, seed=2, dtype=torch.bfloat16)
    tables = torch.randperm(bsz * max_pages, generator=_gen(3)).to(DEVICE).view(bsz, max_pages)  # [B, pages]
    q = _rand(bsz * queries, 16, 256, seed=4, dtype=torch.bfloat16)
    qsl = torch.arange(bsz + 1, device=DEVICE) * queries
    ref = paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, queries, 2000, 256**-0.5).float()
    ours = paged_verify_attention(q, k_cache, v_cache, tables, seq_lens, 256**-0.5, queries).float()
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-2

    tokens = bsz * queries
    qk = _rand(tokens, 2, 16, 128, seed=5, dtype=torch.bfloat16)
    v = _rand(tokens, 32, 128, seed=6, dtype=torch.bfloat16)
    g, beta = -torch.rand(tokens, 32, generator=_gen(7)).to(DEVICE), torch.rand(tokens, 32, generator=_gen(8)).to(DEVICE)
    pool = _rand(bsz + 1, 32, 128, 128, seed=9, scale=0.1)
    slots, keep = torch.arange(bsz, device=DEVICE), torch.ones(bsz, dtype=torch.bool, device=DEVICE)
    ref_out, ref_states = _step_reference(qk[:, 0], qk[:, 1], v, g, beta, pool[:bsz].clone(), queries)
    capture = torch.empty(bsz * (queries - 1), 32, 128, 128, device=DEVICE)
    out = gated_delta_rule_verify(qk[:, 0], qk[:, 1], v, g, beta, pool, slots, keep, queries, capture=capture)
    assert ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item() < 1e-2
    torch.testing.assert_close(pool[:bsz], ref_states[:, -1], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(capture.view(bsz, queries - 1, 32, 128, 128), ref_states[:, :-1], atol=1e-3, rtol=1e-3)

    x = _rand(tokens, 8192, seed=10, dtype=torch.bfloat16)
    weight = _rand(8192, 4, seed=11, dtype=torch.bfloat16)
    conv_pool = _rand(bsz, 8192, 3, seed=12, dtype=torch.bfloat16)
    req = torch.arange(bsz, device=DEVICE).repeat_interleave(queries)
    off = torch.arange(queries, device=DEVICE).repeat(bsz)
    ref_y, ref_final, ref_cap = causal_conv1d_varlen(x, weight, conv_pool.clone(), qsl, queries, capture=(req, off))
    conv_capture = torch.empty(bsz * (queries - 1), 8192, 3, dtype=torch.bfloat16, device=DEVICE)
    y = causal_conv1d_verify(x, weight, conv_pool, slots, keep, queries, capture=conv_capture)
    torch.testing.assert_close(y, ref_y, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(conv_pool, ref_final)
    torch.testing.assert_close(conv_capture.view(bsz, queries - 1, 8192, 3),
                               ref_cap.view(bsz, queries, 8192, 3)[:, :-1])


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("hq,queries", [(16, 2), (16, 4), (16, 5), (32, 3), (32, 4), (128, 2)])
def test_verify_attention_equals_decode_rows_at_real_width(hq, queries, cache_dtype):
    """At the 35B attention shape (16 q / 2 kv heads of 256, 16-token pages, bf16 queries, a bf16 or
    FP8 cache), 16 key splits and 64-key blocks, contexts up to 20k: every verification row is the
    one-token kernel's output at its position, bit for bit (one kernel, more query rows per program).
    Also past 32 rows (GROUP 8 at Q = 5; GROUP 16, 32 q / 2 kv heads, at Q = 3 and 4), in row tiles
    (as one 2D dot, Triton's Hopper wgmma path at 64 rows rounded differently, session 40).
    GROUP 64 (128 q / 2 kv heads): a tile is one token's 64 rows, the one-token kernel's own tile."""
    from lamina.kernels.triton_decode import paged_decode_attention

    bsz, page, longest = 16, 16, 20_000
    seq_lens = torch.randint(queries, longest, (bsz,), generator=_gen(20))
    seq_lens[:4] = torch.tensor([queries, 64 + queries - 1, 1024 + 1, longest])  # block edges, the longest
    seq_lens = seq_lens.to(DEVICE)
    max_pages = -(-longest // page)
    k_cache = _rand(bsz * max_pages, page, 2, 256, seed=21, dtype=torch.bfloat16).to(cache_dtype)
    v_cache = _rand(bsz * max_pages, page, 2, 256, seed=22, dtype=torch.bfloat16).to(cache_dtype)
    tables = torch.randperm(bsz * max_pages, generator=_gen(23)).to(DEVICE).view(bsz, max_pages)  # [B, pages]
    q = _rand(bsz * queries, hq, 256, seed=24, dtype=torch.bfloat16)
    gate = _rand(bsz * queries, hq, 256, seed=25, dtype=torch.bfloat16)
    verify = paged_verify_attention(q, k_cache, v_cache, tables, seq_lens, 256**-0.5, queries, gate=gate)
    for i in range(queries):
        rows = torch.arange(bsz, device=DEVICE) * queries + i
        one = paged_decode_attention(q[rows], k_cache, v_cache, tables, seq_lens - queries + i + 1, 256**-0.5,
                                     gate=gate[rows])
        assert torch.equal(verify[rows], one), f"query {i}: {(verify[rows].float() - one.float()).abs().max()}"

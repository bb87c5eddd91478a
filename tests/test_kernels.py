"""Reference kernels vs. per-token loops and transformers' Qwen3-Next torch fallbacks (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lamina.kernels import (
    causal_conv1d_varlen,
    chunk_gated_delta_rule_varlen,
    flat_positions,
    from_padded,
    gated_delta_rule_varlen,
    padded_index,
    paged_attention,
    recurrent_gated_delta_rule_step,
    to_padded,
    write_kv_cache,
)
from tests.reference import torch_only_transformers

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
torch_only_transformers()  # its torch delta rule, also where fla-core is installed (tests/reference.py)

ATOL = 1e-4
RTOL = 1e-4


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def make_qsl(lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def split_flat(x: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    return list(torch.split(x, lens, dim=0))


# ----------------------------------------------------------------------------- varlen


def test_varlen_roundtrip():
    lens = [3, 0, 1, 5]
    qsl = make_qsl(lens)
    x = torch.randn(sum(lens), 2, 3)
    index, valid = padded_index(qsl, 6)
    assert index.shape == (4, 6) and valid.dtype == torch.bool
    assert valid.sum(1).tolist() == lens
    assert index[3, :5].tolist() == [4, 5, 6, 7, 8]
    assert (index[~valid] == 0).all()
    xp = to_padded(x, index, valid)  # [B, L, 2, 3]
    assert (xp[~valid] == 0).all()
    close(xp[2, 0], x[3])
    flat = flat_positions(qsl, 6, x.shape[0])
    assert torch.equal(from_padded(xp, valid, flat), x)
    assert torch.equal(from_padded(xp, valid), x)


# ----------------------------------------------------------------------------- gated delta rule


def loop_gdr(q, k, v, g, beta, state, use_l2norm=True):
    """Per-token reference for one request: q, k [L, Hk, Dk], v [L, Hv, Dv], state [Hv, Dk, Dv]."""
    hv = v.shape[1]
    rep = hv // k.shape[1]
    q = q.float().repeat_interleave(rep, dim=1)
    k = k.float().repeat_interleave(rep, dim=1)
    if use_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    s = state.clone().float()
    outs = []
    for t in range(q.shape[0]):
        for h in range(hv):
            s[h] = s[h] * torch.exp(g[t, h])
            u = beta[t, h] * (v[t, h] - s[h].T @ k[t, h])
            s[h] = s[h] + torch.outer(k[t, h], u)
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    out = torch.stack(outs) if outs else v.new_zeros((0, *v.shape[1:]))
    return out, s


def make_gdr_inputs(lens, hk=2, hv=4, dk=16, dv=8, seed=0, k_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, hk, dk, generator=gen)
    k = torch.randn(t, hk, dk, generator=gen) * k_scale
    v = torch.randn(t, hv, dv, generator=gen)
    g = F.logsigmoid(torch.randn(t, hv, generator=gen) + 2.0)  # <= 0, mild decay
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen))
    state = 0.5 * torch.randn(len(lens), hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


LENS = [1, 3, 64, 65, 130]


@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunk_gdr_matches_loop(chunk_size):
    lens = LENS
    q, k, v, g, beta, state = make_gdr_inputs(lens)
    qsl = make_qsl(lens)
    out, final = chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, qsl, max(lens), chunk_size=chunk_size)
    assert out.shape == v.shape and out.dtype == v.dtype
    assert final.shape == state.shape and final.dtype == torch.float32
    parts = [split_flat(x, lens) for x in (q, k, v, g, beta)]
    ref_out = []
    for b in range(len(lens)):
        o, s = loop_gdr(*(p[b] for p in parts), state[b])
        ref_out.append(o)
        close(final[b], s)
    close(out, torch.cat(ref_out))


def test_chunk_gdr_matches_transformers():
    lens = LENS
    q, k, v, g, beta, state = make_gdr_inputs(lens, seed=1)
    qsl = make_qsl(lens)
    out, final = gated_delta_rule_varlen(q, k, v, g, beta, state, qsl, max(lens))
    parts = [split_flat(x, lens) for x in (q, k, v, g, beta)]
    for b in range(len(lens)):
        args = [p[b][None] for p in parts]  # [1, L, H, ...]
        for fn in (qwen3_next.torch_chunk_gated_delta_rule, qwen3_next.torch_recurrent_gated_delta_rule):
            ref_o, ref_s = fn(
                *args, initial_state=state[b : b + 1].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
            )
            close(out[qsl[b] : qsl[b + 1]], ref_o[0])
            close(final[b], ref_s[0])


def test_chunk_gdr_without_l2norm():
    lens = [5, 70]
    q, k, v, g, beta, state = make_gdr_inputs(lens, seed=2, k_scale=0.2)
    q = q * 0.2
    qsl = make_qsl(lens)
    out, final = chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, qsl, 70, use_qk_l2norm=False)
    parts = [split_flat(x, lens) for x in (q, k, v, g, beta)]
    for b in range(len(lens)):
        o, s = loop_gdr(*(p[b] for p in parts), state[b], use_l2norm=False)
        close(out[qsl[b] : qsl[b + 1]], o)
        close(final[b], s)


def test_chunk_gdr_continuation():
    """Running a request in two pieces, state carried over, equals running it whole."""
    lens = [130, 70, 3]
    first = [50, 64, 1]
    second = [a - b for a, b in zip(lens, first)]
    q, k, v, g, beta, state = make_gdr_inputs(lens, seed=3)
    out_full, final_full = chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, make_qsl(lens), max(lens))

    pieces = [[], []]
    for x in (q, k, v, g, beta):
        per_req = split_flat(x, lens)
        pieces[0].append(torch.cat([r[:n] for r, n in zip(per_req, first)]))
        pieces[1].append(torch.cat([r[n:] for r, n in zip(per_req, first)]))
    out1, mid = chunk_gated_delta_rule_varlen(*pieces[0], state, make_qsl(first), max(first))
    out2, final2 = chunk_gated_delta_rule_varlen(*pieces[1], mid, make_qsl(second), max(second))
    close(final2, final_full)
    o1, o2, of = split_flat(out1, first), split_flat(out2, second), split_flat(out_full, lens)
    for b in range(len(lens)):
        close(torch.cat([o1[b], o2[b]]), of[b])


def test_step_gdr_decode_batch():
    lens = [1] * 5
    q, k, v, g, beta, state = make_gdr_inputs(lens, seed=4)
    qsl = make_qsl(lens)
    out, new_state = recurrent_gated_delta_rule_step(q, k, v, g, beta, state)
    assert out.shape == v.shape and new_state.dtype == torch.float32
    state_before = state.clone()
    out_d, state_d = gated_delta_rule_varlen(q, k, v, g, beta, state, qsl, 1)
    assert torch.equal(state, state_before)  # inputs untouched
    close(out_d, out)
    close(state_d, new_state)
    out_c, state_c = chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, qsl, 1)
    close(out_c, out)
    close(state_c, new_state)
    for b in range(5):
        o, s = loop_gdr(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], state[b])
        close(out[b], o[0])
        close(new_state[b], s)
    # transformers' recurrent form, the batch as [B, 1, H, D]
    ref_o, ref_s = qwen3_next.torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
        initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    close(out, ref_o[:, 0])
    close(new_state, ref_s)


def test_step_then_chunk_chain():
    """Prefill, then several decode steps, equals one prefill over everything."""
    lens = [9, 66]
    steps = 3
    total = [n + steps for n in lens]
    q, k, v, g, beta, state = make_gdr_inputs(total, seed=5)
    _, final_full = chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, make_qsl(total), max(total))
    per = [split_flat(x, total) for x in (q, k, v, g, beta)]
    pre = [torch.cat([r[:n] for r, n in zip(p, lens)]) for p in per]
    _, s = gated_delta_rule_varlen(*pre, state, make_qsl(lens), max(lens))
    for i in range(steps):
        tok = [torch.stack([r[n + i] for r, n in zip(p, lens)]) for p in per]
        _, s = gated_delta_rule_varlen(*tok, s, make_qsl([1, 1]), 1)
    close(s, final_full)


@pytest.mark.parametrize("lens", [[2, 2, 2], [4, 3, 4, 1], [5, 2]])
def test_verification_sized_steps_use_small_chunks(lens, monkeypatch):
    """Verification steps (K+1 tokens a request) run the chunked form on chunks of the next power
    of two >= the longest request, not padded to 64; outputs, final and captured states match the
    per-token loop."""
    from lamina.kernels import gated_delta_rule as gdr

    seen = []
    real = gdr.chunk_gated_delta_rule_varlen

    def spy(*args, **kwargs):
        seen.append(args[8])
        return real(*args, **kwargs)

    monkeypatch.setattr(gdr, "chunk_gated_delta_rule_varlen", spy)
    q, k, v, g, beta, state = make_gdr_inputs(lens, seed=7)
    qsl = make_qsl(lens)
    req = torch.tensor([b for b, n in enumerate(lens) for _ in range(n)])
    offset = torch.tensor([i for n in lens for i in range(n)])
    out, final, captured = gdr.gated_delta_rule_varlen(
        q, k, v, g, beta, state, qsl, max(lens), capture=(req, offset, max(lens) - 1)
    )
    assert seen == [1 << (max(lens) - 1).bit_length()]
    parts = [split_flat(x, lens) for x in (q, k, v, g, beta)]
    row = 0
    for b, n in enumerate(lens):
        o, s = loop_gdr(*(p[b] for p in parts), state[b])
        close(out[qsl[b] : qsl[b + 1]], o)
        close(final[b], s)
        for i in range(n):  # the state after token i is the final state of the first i+1 tokens
            _, s_i = loop_gdr(*(p[b][: i + 1] for p in parts), state[b])
            close(captured[row], s_i)
            row += 1


# ----------------------------------------------------------------------------- causal conv1d


def loop_conv(x, weight, state, silu=True):
    """x [L, C], weight [C, K], state [C, K-1] -> out [L, C], new state [C, K-1]."""
    kk = weight.shape[1]
    seq = torch.cat([state.T, x], dim=0)  # [K-1+L, C]
    outs = []
    for t in range(x.shape[0]):
        y = (seq[t : t + kk].T * weight).sum(-1)
        outs.append(F.silu(y) if silu else y)
    out = torch.stack(outs) if outs else x.new_zeros((0, x.shape[1]))
    return out, seq[seq.shape[0] - (kk - 1) :].T


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_matches_loop(activation):
    lens = [1, 2, 3, 7, 0, 65]
    c, kk = 6, 4
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(sum(lens), c, generator=gen)
    w = torch.randn(c, kk, generator=gen)
    state = torch.randn(len(lens), c, kk - 1, generator=gen)
    qsl = make_qsl(lens)
    out, new_state = causal_conv1d_varlen(x, w, state, qsl, max(lens), activation=activation)
    assert out.shape == x.shape and new_state.shape == state.shape
    xs = split_flat(x, lens)
    for b in range(len(lens)):
        o, s = loop_conv(xs[b], w, state[b], silu=activation == "silu")
        close(out[qsl[b] : qsl[b + 1]], o)
        close(new_state[b], s)


def test_conv_matches_transformers():
    lens = [1, 2, 5, 64]
    c, kk = 8, 4
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(sum(lens), c, generator=gen)
    w = torch.randn(c, kk, generator=gen)
    qsl = make_qsl(lens)
    zeros = torch.zeros(len(lens), c, kk - 1)
    out, state = causal_conv1d_varlen(x, w, zeros, qsl, max(lens))
    xs = split_flat(x, lens)
    for b in range(len(lens)):
        ref = qwen3_next.causal_conv1d_fn(xs[b].T[None], w, None, activation="silu")  # [1, C, L]
        close(out[qsl[b] : qsl[b + 1]], ref[0].T)
        # chained single-token updates from an empty state reach the same outputs and state
        conv_state = torch.zeros(1, c, kk - 1)
        for t in range(lens[b]):
            y = qwen3_next.causal_conv1d_update(xs[b][t][None, :, None], conv_state, w, None, "silu")
            close(out[qsl[b] + t], y[0, :, 0])
        close(state[b], conv_state[0])

    # continue every request with a second step of mixed lengths (decode and chunk)
    lens2 = [1, 3, 1, 2]
    x2 = torch.randn(sum(lens2), c, generator=gen)
    out2, state2 = causal_conv1d_varlen(x2, w, state, make_qsl(lens2), max(lens2))
    ref_state = state.clone()
    ref = qwen3_next.causal_conv1d_update(
        torch.stack([r[0] for r in split_flat(x2, lens2)])[:, :, None], ref_state, w, None, "silu"
    )  # first new token of every request, as one decode batch
    qsl2 = make_qsl(lens2)
    close(out2[qsl2[:-1].long()], ref[:, :, 0])
    x2s = split_flat(x2, lens2)
    for b in range(len(lens)):
        whole = torch.cat([xs[b], x2s[b]])  # [L1+L2, C]
        ref_whole = qwen3_next.causal_conv1d_fn(whole.T[None], w, None, activation="silu")[0].T
        close(out2[qsl2[b] : qsl2[b + 1]], ref_whole[lens[b] :])
        history = torch.cat([torch.zeros(kk - 1, c), whole])  # zero-padded history
        close(state2[b], history[-(kk - 1) :].T)


def test_conv_empty_step_keeps_state():
    c, kk = 4, 4
    state = torch.randn(3, c, kk - 1)
    out, new_state = causal_conv1d_varlen(torch.zeros(0, c), torch.randn(c, kk), state, make_qsl([0, 0, 0]), 0)
    assert out.shape == (0, c)
    assert torch.equal(new_state, state)


# ----------------------------------------------------------------------------- paged attention


def test_write_kv_cache_skips_negative_slots():
    nb, bs, h, d = 4, 4, 2, 3
    k_cache = torch.randn(nb, bs, h, d)
    v_cache = torch.randn(nb, bs, h, d)
    k0, v0 = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, -1, 0, -1, 13, -1])
    k = torch.randn(6, h, d)
    v = torch.randn(6, h, d)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    ek, ev = k0.view(-1, h, d).clone(), v0.view(-1, h, d).clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            ek[s], ev[s] = k[t], v[t]
    assert torch.equal(k_cache.view(-1, h, d), ek)
    assert torch.equal(v_cache.view(-1, h, d), ev)

    # negative slots only: slot 0 keeps its old contents
    k1 = k_cache.clone()
    write_kv_cache(k[:2], v[:2], k_cache, v_cache, torch.tensor([-1, 7]))
    k1.view(-1, h, d)[7] = k[1]
    assert torch.equal(k_cache, k1)


def loop_attention(q, keys, values, ctx_before, scale):
    """q [n, Hq, D]; keys/values [ctx_before + n, Hkv, D]; query i sees keys 0..ctx_before+i."""
    group = q.shape[1] // keys.shape[1]
    outs = []
    for i in range(q.shape[0]):
        n = ctx_before + i + 1
        kk = keys[:n].repeat_interleave(group, dim=1)  # [n, Hq, D]
        vv = values[:n].repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i], kk) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", p, vv))
    return torch.stack(outs)


MIXED_STEP = [(0, 5), (10, 1), (7, 9), (0, 1), (33, 1), (3, 16)]  # prefills, chunked prefill, decodes
FRESH_PROMPTS = [(0, 5), (0, 1), (0, 9), (0, 16), (0, 2)]  # every query starts at position 0


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("reqs,causal_from_start", [(MIXED_STEP, False), (FRESH_PROMPTS, False), (FRESH_PROMPTS, True)])
def test_paged_attention_mixed_batch(hq, hkv, reqs, causal_from_start):
    """(context already cached, new tokens this step) per request; fresh prompts also through
    SDPA's own causal rule (`causal_from_start`), which must give the built mask's result."""
    d, bs, nb = 8, 4, 40
    gen = torch.Generator().manual_seed(20)
    k_cache = torch.zeros(nb, bs, hkv, d)
    v_cache = torch.zeros(nb, bs, hkv, d)
    perm = torch.randperm(nb, generator=gen).tolist()
    max_blocks = max(-(-(c + n) // bs) for c, n in reqs) + 1
    tables, keys, values, slot_old, slot_new = [], [], [], [], []
    for c, n in reqs:
        need = -(-(c + n) // bs)
        blocks = [perm.pop() for _ in range(need)]
        tables.append(blocks + [0] * (max_blocks - need))
        kk = torch.randn(c + n, hkv, d, generator=gen)
        vv = torch.randn(c + n, hkv, d, generator=gen)
        keys.append(kk)
        values.append(vv)
        slots = [blocks[p // bs] * bs + p % bs for p in range(c + n)]
        slot_old.append(slots[:c])
        slot_new.append(slots[c:])
    block_tables = torch.tensor(tables, dtype=torch.int32)
    # earlier steps, written with some padding slots mixed in
    old_k = torch.cat([kk[:c] for kk, (c, _) in zip(keys, reqs)] + [torch.randn(3, hkv, d)])
    old_v = torch.cat([vv[:c] for vv, (c, _) in zip(values, reqs)] + [torch.randn(3, hkv, d)])
    write_kv_cache(old_k, old_v, k_cache, v_cache, torch.tensor(sum(slot_old, []) + [-1, -1, -1]))
    # this step
    new_k = torch.cat([kk[c:] for kk, (c, _) in zip(keys, reqs)])
    new_v = torch.cat([vv[c:] for vv, (c, _) in zip(values, reqs)])
    write_kv_cache(new_k, new_v, k_cache, v_cache, torch.tensor(sum(slot_new, [])))

    q_lens = [n for _, n in reqs]
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    qsl = make_qsl(q_lens)
    seq_lens = torch.tensor([c + n for c, n in reqs])
    scale = d**-0.5
    out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), int(seq_lens.max()), scale,
                          causal_from_start=causal_from_start)
    assert out.shape == q.shape
    qs = split_flat(q, q_lens)
    for b, (c, n) in enumerate(reqs):
        ref = loop_attention(qs[b], keys[b], values[b], c, scale)
        close(out[qsl[b] : qsl[b + 1]], ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("lengths", [[997], [1001, 5, 64], [8191]])
def test_fresh_prompts_on_cuda_take_flash_and_match_the_mask(lengths):
    """On CUDA the causal rule prefers flash (no plan per shape, unlike SDPA's cuDNN choice): bf16 fresh
    prompts at the Qwen3.5 attention shape (16 query heads, 2 KV heads, dim 256) agree with the
    masked path, and a new length costs no plan build. The flash kernels are loaded first, at
    another length: the first flash call of a process loads their module (CUDA's lazy loading,
    about 80 ms on an H100), which every length after it shares."""
    import time

    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, d, bs = 16, 2, 256, 16
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(3)

    def attention_args(lengths):
        blocks_per = [-(-n // bs) for n in lengths]
        k_cache = torch.randn(sum(blocks_per) + 1, bs, hkv, d, device=dev, dtype=dtype, generator=gen)
        v_cache = torch.randn_like(k_cache)
        starts = [1 + sum(blocks_per[:i]) for i in range(len(lengths))]
        width = max(blocks_per)
        block_tables = torch.tensor([[s + j if j < n else 0 for j in range(width)] for s, n in zip(starts, blocks_per)],
                                    dtype=torch.int32, device=dev)
        q = torch.randn(sum(lengths), hq, d, device=dev, dtype=dtype, generator=gen)
        qsl = make_qsl(lengths).to(dev)
        seq_lens = torch.tensor(lengths, device=dev)
        return (q, k_cache, v_cache, block_tables, seq_lens, qsl, max(lengths), max(lengths), d**-0.5)

    paged_attention(*attention_args([40]), causal_from_start=True)  # loads the flash kernels
    args = attention_args(lengths)
    masked = paged_attention(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fresh = paged_attention(*args, causal_from_start=True)  # the first causal call at this shape
    torch.cuda.synchronize()
    first_ms = 1e3 * (time.perf_counter() - start)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # flash only: fails if flash cannot take the call
        flash_only = paged_attention(*args, causal_from_start=True)
    assert torch.equal(fresh, flash_only)
    torch.testing.assert_close(fresh.float(), masked.float(), atol=2e-2, rtol=2e-2)
    assert first_ms < 50, f"a new length took {first_ms:.1f} ms (cuDNN's plan build took 66-103 ms)"


def test_paged_attention_decode_only():
    d, bs, nb, hq, hkv = 16, 8, 12, 4, 2
    gen = torch.Generator().manual_seed(21)
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen)
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen)
    block_tables = torch.tensor([[3, 7, 0], [11, 0, 0], [5, 2, 9]])
    seq_lens = torch.tensor([12, 1, 24])
    q = torch.randn(3, hq, d, generator=gen)
    out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, make_qsl([1, 1, 1]), 1, 24, 0.3)
    for b in range(3):
        n = int(seq_lens[b])
        slots = [int(block_tables[b, p // bs]) * bs + p % bs for p in range(n)]
        kk = k_cache.view(-1, hkv, d)[slots]
        vv = v_cache.view(-1, hkv, d)[slots]
        close(out[b : b + 1], loop_attention(q[b : b + 1], kk, vv, n - 1, 0.3))

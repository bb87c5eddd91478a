"""Request groups: steps that mix short and long requests run the padded kernels per group of
similar requests (lamina.kernels.request_groups), with the same results as one padded call."""

from __future__ import annotations

import random

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.kernels import causal_conv1d_varlen, gated_delta_rule_varlen, paged_attention, write_kv_cache
from lamina.kernels import request_groups as rg
from tests.test_kernels import close, make_gdr_inputs, make_qsl

ENGINE = dict(device="cpu", dtype="float32", show_progress=False)


# ---- planning ------------------------------------------------------------------------------
def test_plan_splits_decodes_from_a_long_chunk():
    lens = [1] * 200 + [8000] + [1] * 5
    groups = rg.plan_groups(lens)
    assert groups is not None and len(groups) == 2
    assert groups[1] == [200] and groups[0] == [r for r in range(206) if r != 200]
    padded = sum(len(g) * max(lens[r] for r in g) for g in groups)
    assert padded <= 2 * sum(lens) + 2 * rg.TOKEN_SLACK  # vs 206 * 8000 in one call


def test_plan_keeps_uniform_and_small_steps_whole():
    assert rg.plan_groups([1] * 256) is None  # decode
    assert rg.plan_groups([4] * 256) is None  # verification, K = 3
    assert rg.plan_groups([8192]) is None  # a lone prefill chunk
    assert rg.plan_groups([1] * 30 + [100]) is None  # little padding in absolute terms
    assert rg.plan_groups([1] * 30 + [500]) is not None  # 15500 padded rows for 530 real ones
    assert rg.plan_groups([1] * 64, [100] * 64) is None


def test_plan_by_context_separates_long_contexts_and_prompt_chunks():
    q = [1] * 63 + [1]
    s = [500] * 63 + [32000]
    groups = rg.plan_groups(q, s)
    assert groups == [list(range(63)), [63]]
    # a prompt chunk is never grouped with decodes, even at similar context lengths
    groups = rg.plan_groups([1] * 100 + [3000], [3000] * 101)
    assert groups == [list(range(100)), [100]]


def test_plan_caps_the_context_rows_of_a_group():
    groups = rg.plan_groups([1] * 256, [32768] * 256)  # no padding at all, but 8M context rows
    assert groups is not None and len(groups) == 16 and all(len(g) == 16 for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(256))
    assert rg.plan_groups([1] * 16, [32768] * 16) is None  # 512k rows: one call


def test_plan_by_kind_separates_decodes_continued_chunks_and_fresh_prompts():
    # a step padding alone would not split: three decodes and a short continued chunk
    assert rg.plan_groups([1, 1, 1, 40], [101, 101, 101, 100]) is None
    assert rg.plan_groups([1, 1, 1, 40], [101, 101, 101, 100], by_kind=True) == [[0, 1, 2], [3]]
    # decodes (a one-token fresh prompt among them), continued chunks (verification-sized too),
    # fresh prompts by context length
    q = [1, 30, 1, 4, 50, 100000, 1, 60]
    s = [80, 30, 1, 70, 90, 100000, 500, 60]
    assert rg.plan_groups(q, s, by_kind=True) == [[0, 2, 6], [3, 4], [1, 7], [5]]
    # one kind: one call
    assert rg.plan_groups([1] * 64, [100 + i for i in range(64)], by_kind=True) is None
    assert rg.plan_groups([5, 7], [50, 70], by_kind=True) is None
    assert rg.plan_groups([1], [1], by_kind=True) is None
    assert rg.plan_groups([30, 60], [30, 60], by_kind=True) is None  # fresh, similar lengths
    # fresh prompts on the varlen kernel (LAMINA_FRESH_PROMPT_ATTENTION=varlen): with the continued chunks,
    # whatever their lengths; a step of prompts alone, of any lengths, is one call
    assert rg.plan_groups(q, s, by_kind=True, fresh_with_continued=True) == [[0, 2, 6], [1, 3, 4, 5, 7]]
    prompts = [30, 30, 200000, 30, 30]
    assert rg.plan_groups(prompts, prompts, by_kind=True) == [[0, 1, 3, 4], [2]]
    assert rg.plan_groups(prompts, prompts, by_kind=True, fresh_with_continued=True) is None


def test_paged_attention_by_kind_groups_on_a_step_padding_keeps_whole(monkeypatch):
    """Triton set (here Triton's interpreter) with the varlen kernel: a mixed step that padding
    alone keeps whole still runs its decodes on the decode kernel, its continued chunk on the
    varlen kernel and its fresh prompt on the causal rule; a step of decodes only, ungrouped, the
    decode kernel. Results equal the masked reference."""
    import importlib

    from lamina.kernels import triton_decode, triton_prefill_attention

    pa_module = importlib.import_module("lamina.kernels.paged_attention")
    calls = {"decode": [], "varlen": [], "causal": []}
    decode, chunked, single = (triton_decode.paged_decode_attention,
                               triton_prefill_attention.paged_prefill_attention, pa_module.paged_attention)
    monkeypatch.setattr(triton_decode, "paged_decode_attention",
                        lambda *a, **k: calls["decode"].append(a[0].shape[0]) or decode(*a, **k))
    monkeypatch.setattr(triton_prefill_attention, "paged_prefill_attention",
                        lambda *a, **k: calls["varlen"].append(a[0].shape[0]) or chunked(*a, **k))

    def spy(*a, **k):
        if k.get("causal_from_start") and k.get("groups") is None:
            calls["causal"].append(a[0].shape[0])
        return single(*a, **k)

    monkeypatch.setattr(pa_module, "paged_attention", spy)
    d, bs, hq, hkv = 16, 4, 4, 2
    reqs = [(20, 1), (0, 6), (9, 1), (11, 5), (30, 1)]  # (cached context, new tokens)
    gen = torch.Generator().manual_seed(3)
    max_blocks = max(-(-(c + n) // bs) for c, n in reqs)
    nb = len(reqs) * max_blocks + 1
    k_cache, v_cache = torch.randn(nb, bs, hkv, d, generator=gen), torch.randn(nb, bs, hkv, d, generator=gen)
    block_tables = torch.randperm(nb - 1, generator=gen)[: len(reqs) * max_blocks].view(len(reqs), max_blocks) + 1
    q_lens, seq = [n for _, n in reqs], [c + n for c, n in reqs]
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    gate = torch.randn(q.shape, generator=gen)
    qsl, seq_lens = make_qsl(q_lens), torch.tensor(seq)
    args = (q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), max(seq), d**-0.5)
    ref = single(*args) * torch.sigmoid(gate)
    assert rg.plan_groups(q_lens, seq) is None  # padding keeps it whole
    plan = rg.plan_groups(q_lens, seq, by_kind=True)
    assert plan == [[0, 2, 4], [3], [1]]
    groups = rg.build_groups(plan, q_lens, seq, "cpu")
    got = single(*args, groups=groups, fast_groups=True, gate=gate, varlen=True)
    close(got, ref)
    assert calls == {"decode": [3], "varlen": [5], "causal": [6]}
    decodes = [0, 2, 4]  # the decodes alone, one call without groups
    rows = torch.tensor([int(qsl[r]) for r in decodes])
    alone = single(q[rows], k_cache, v_cache, block_tables[decodes], seq_lens[decodes], make_qsl([1, 1, 1]), 1,
                   max(seq), d**-0.5, fast_groups=True, gate=gate[rows], varlen=True, decodes_only=True)
    close(alone, ref[rows])
    assert calls["decode"] == [3, 3] and calls["varlen"] == [5]
    assert torch.equal(alone, got[rows])  # a decode computes the same way whatever shares its step
    # a request without tokens among the decodes (the step's metadata: 3 tokens, 4 requests): not
    # the one-query-each decode kernel
    with_empty = [0, 2, 3, 4]
    rows = torch.tensor([int(qsl[0]), int(qsl[2]), int(qsl[4])])
    empty_qsl = torch.tensor([0, 1, 2, 2, 3])  # request 3 (the continued chunk) scheduled no token
    out = single(q[rows], k_cache, v_cache, block_tables[with_empty], seq_lens[with_empty], empty_qsl, 1, max(seq),
                 d**-0.5, fast_groups=True, gate=gate[rows], varlen=True)
    assert calls["decode"] == [3, 3] and calls["varlen"] == [5, 3]  # the varlen kernel took it
    close(out, ref[rows])
    # fresh prompts on the varlen kernel too (LAMINA_FRESH_PROMPT_ATTENTION=varlen): the same step,
    # the fresh prompt's group no longer on the causal rule
    fresh_too = single(*args, groups=groups, fast_groups=True, gate=gate, varlen=True, fresh_varlen=True)
    close(fresh_too, ref)
    assert calls["varlen"] == [5, 3, 5, 6] and calls["causal"] == [6]
    fresh_rows = slice(int(qsl[1]), int(qsl[2]))  # the fresh prompt, alone, on the varlen kernel: its rows
    alone = single(q[fresh_rows], k_cache, v_cache, block_tables[1:2], seq_lens[1:2], make_qsl([6]), 6, 6, d**-0.5,
                   fast_groups=True, gate=gate[fresh_rows], varlen=True, causal_from_start=True, fresh_varlen=True)
    assert calls["varlen"] == [5, 3, 5, 6, 6]  # the call alone went to the varlen kernel too
    assert torch.equal(alone, fresh_too[fresh_rows])


def test_fresh_prompt_attention_switch(monkeypatch):
    """`LAMINA_FRESH_PROMPT_ATTENTION`: the varlen kernel by default and with `varlen` (only where
    the varlen kernel is on: the Triton set without LAMINA_PREFILL_ATTENTION=sdpa), SDPA's causal
    rule with `sdpa`; anything else is refused, naming the value."""
    from lamina.kernels.selection import fresh_prompt_varlen_enabled

    monkeypatch.delenv("LAMINA_FRESH_PROMPT_ATTENTION", raising=False)
    monkeypatch.delenv("LAMINA_PREFILL_ATTENTION", raising=False)
    assert fresh_prompt_varlen_enabled("triton") and not fresh_prompt_varlen_enabled("reference")
    monkeypatch.setenv("LAMINA_FRESH_PROMPT_ATTENTION", "sdpa")
    assert not fresh_prompt_varlen_enabled("triton")
    monkeypatch.setenv("LAMINA_FRESH_PROMPT_ATTENTION", "varlen")
    assert fresh_prompt_varlen_enabled("triton") and not fresh_prompt_varlen_enabled("reference")
    monkeypatch.setenv("LAMINA_PREFILL_ATTENTION", "sdpa")
    assert not fresh_prompt_varlen_enabled("triton")
    monkeypatch.setenv("LAMINA_FRESH_PROMPT_ATTENTION", "flash")
    with pytest.raises(ValueError, match="'flash'"):
        fresh_prompt_varlen_enabled("triton")


# ---- kernels: grouped == one call --------------------------------------------------------
def _groups(lens, seq_lens=None, capture=None, by_context=False):
    seq = seq_lens if seq_lens is not None else lens
    plan = rg.plan_groups(lens, seq if by_context else None)
    assert plan is not None and len(plan) > 1
    return rg.build_groups(plan, lens, seq, "cpu", capture)


@pytest.fixture
def eager_groups(monkeypatch):
    """Split even tiny steps."""
    monkeypatch.setattr(rg, "TOKEN_SLACK", 0)
    monkeypatch.setattr(rg, "CONTEXT_SLACK", 0)
    monkeypatch.setattr(rg, "PAD_FACTOR", 1)


def test_delta_rule_grouped_matches_one_call(eager_groups):
    lens = [1, 40, 1, 3, 1, 2, 70, 1]
    q, k, v, g, beta, state = make_gdr_inputs(lens, seed=11)
    qsl = make_qsl(lens)
    req = [1, 3, 3, 5, 7, 6, 6]
    off = [10, 0, 2, 1, 0, 5, 69]
    capture = (torch.tensor(req), torch.tensor(off), max(off))
    ref = gated_delta_rule_varlen(q, k, v, g, beta, state, qsl, max(lens), capture=capture)
    groups = _groups(lens, capture=(req, off))
    got = gated_delta_rule_varlen(q, k, v, g, beta, state, qsl, max(lens), capture=capture, groups=groups)
    for a, b in zip(got, ref):
        close(a, b)


def test_delta_rule_grouped_with_empty_requests_default_planning():
    """A request with no token this step lands among the decodes (review finding: the grouped call
    took the one-token path and raised)."""
    lens = [1] * 10 + [0] + [5000]
    q, k, v, g, beta, state = make_gdr_inputs(lens, seed=12)
    qsl = make_qsl(lens)
    plan = rg.plan_groups(lens)
    assert plan is not None and [10] in [[r for r in grp if lens[r] == 0] for grp in plan]
    groups = rg.build_groups(plan, lens, lens, "cpu")
    ref = gated_delta_rule_varlen(q, k, v, g, beta, state, qsl, max(lens))
    got = gated_delta_rule_varlen(q, k, v, g, beta, state, qsl, max(lens), groups=groups)
    for a, b in zip(got, ref):
        close(a, b)
    close(got[1][10], state[10])  # the empty request's state is untouched


def test_groups_without_the_capture_list_are_refused(eager_groups):
    lens = [1, 40, 1, 3]
    q, k, v, g, beta, state = make_gdr_inputs(lens, seed=13)
    capture = (torch.tensor([1]), torch.tensor([5]), 5)
    groups = _groups(lens)  # built without capture_host
    with pytest.raises(ValueError, match="captured tokens"):
        gated_delta_rule_varlen(q, k, v, g, beta, state, make_qsl(lens), 40, capture=capture, groups=groups)


def test_conv_grouped_matches_one_call(eager_groups):
    lens = [1, 40, 1, 3, 0, 2, 70, 1]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(lens), 6, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    state = torch.randn(len(lens), 6, 3, generator=gen)
    qsl = make_qsl(lens)
    req, off = [1, 3, 5, 6], [39, 2, 0, 10]
    capture = (torch.tensor(req), torch.tensor(off))
    ref = causal_conv1d_varlen(x, weight, state, qsl, max(lens), capture=capture)
    got = causal_conv1d_varlen(x, weight, state, qsl, max(lens), capture=capture,
                               groups=_groups(lens, capture=(req, off)))
    for a, b in zip(got, ref):
        close(a, b)


@pytest.mark.parametrize("with_mask,fresh,fast,varlen", [
    (False, False, False, False), (True, False, False, False), (False, True, False, False),
    (False, False, True, False), (True, False, True, False), (False, False, True, True), (True, False, True, True)])
def test_paged_attention_grouped_matches_one_call(eager_groups, with_mask, fresh, fast, varlen, monkeypatch):
    """Groups give the one call's result; for fresh prompts also on SDPA's own causal rule. With
    `fast_groups` (the Triton kernel set; here Triton's interpreter) a mixed step's groups of decodes
    run the paged decode kernel and its groups of fresh prompts the causal rule, and with `varlen`
    its continued chunks the varlen kernel, unless a key_mask (sparse attention) keeps every group
    on the masked call."""
    d, bs, hq, hkv = 16, 4, 4, 2
    reqs = [(3, 1), (60, 1), (0, 12), (20, 1), (5, 4), (90, 1)]  # (cached context, new tokens)
    if fresh:
        reqs = [(0, 1), (0, 61), (0, 12), (0, 3), (0, 90)]
    if fast:  # decodes (two of one context length: a group of two), fresh prompts and a continued chunk
        reqs = [(3, 1), (59, 1), (0, 20), (0, 24), (20, 1), (5, 40), (59, 1), (90, 1)]
        import importlib

        from lamina.kernels import triton_decode, triton_prefill_attention

        pa_module = importlib.import_module("lamina.kernels.paged_attention")  # the module, not the function

        calls = {"decode": 0, "causal": 0, "varlen": 0}
        decode, single = triton_decode.paged_decode_attention, pa_module.paged_attention
        monkeypatch.setattr(triton_decode, "paged_decode_attention",
                            lambda *a, **k: calls.__setitem__("decode", calls["decode"] + 1) or decode(*a, **k))
        chunked = triton_prefill_attention.paged_prefill_attention
        monkeypatch.setattr(triton_prefill_attention, "paged_prefill_attention",
                            lambda *a, **k: calls.__setitem__("varlen", calls["varlen"] + 1) or chunked(*a, **k))

        def spy(*a, **k):
            calls["causal"] += bool(k.get("causal_from_start")) and k.get("groups") is None
            return single(*a, **k)

        monkeypatch.setattr(pa_module, "paged_attention", spy)
    gen = torch.Generator().manual_seed(5)
    max_blocks = max(-(-(c + n) // bs) for c, n in reqs)
    nb = len(reqs) * max_blocks + 1
    k_cache, v_cache = torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, slots = [], []
    for c, n in reqs:
        blocks = [perm.pop() for _ in range(-(-(c + n) // bs))]
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        slots += [blocks[p // bs] * bs + p % bs for p in range(c + n)]
    write_kv_cache(torch.randn(len(slots), hkv, d, generator=gen), torch.randn(len(slots), hkv, d, generator=gen),
                   k_cache, v_cache, torch.tensor(slots))
    q_lens = [n for _, n in reqs]
    seq = [c + n for c, n in reqs]
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    qsl, block_tables, seq_lens = make_qsl(q_lens), torch.tensor(tables), torch.tensor(seq)
    key_mask = None
    if with_mask:  # a sparse selection that keeps every query's own position
        ctx = -(-max(seq) // bs) * bs
        key_mask = torch.rand(len(reqs), max(q_lens), ctx, generator=gen) < 0.5
        for b, (c, n) in enumerate(reqs):
            for i in range(max(q_lens)):
                key_mask[b, i, min(c + i, c + n - 1) if i < n else 0] = True
    args = (q, k_cache, v_cache, block_tables, seq_lens, qsl, max(q_lens), max(seq), d**-0.5)
    ref = paged_attention(*args, key_mask=key_mask)
    groups = _groups(q_lens, seq, by_context=True)
    got = paged_attention(*args, key_mask=key_mask, groups=groups, causal_from_start=fresh, fast_groups=fast,
                          varlen=varlen)
    close(got, ref)
    if fast:  # the output gate: inside the decode and varlen kernels, multiplied after for the others
        gate = torch.randn(q.shape, generator=gen)
        gated = paged_attention(*args, key_mask=key_mask, groups=groups, fast_groups=True, gate=gate, varlen=varlen)
        close(gated, ref * torch.sigmoid(gate))
        assert any(g.num_reqs > 1 and g.max_query_len == 1 for g in groups)  # a decode group of several requests
        fresh_groups = [g for g in groups if g.from_start]
        decode_groups = [g for g in groups if g.max_query_len == 1]
        assert fresh_groups and decode_groups and len(groups) > len(fresh_groups) + len(decode_groups)
        continued = len(groups) - len(fresh_groups) - len(decode_groups)
        expected = (0, 0, 0) if with_mask else (  # two calls each
            2 * len(decode_groups), 2 * len(fresh_groups), 2 * continued if varlen else 0)
        assert (calls["decode"], calls["causal"], calls["varlen"]) == expected
        if varlen and not with_mask:  # the whole step as one continued chunk: one varlen call, same result
            one = [(c, n) for c, n in reqs].index((5, 40))
            rows = slice(sum(q_lens[:one]), sum(q_lens[: one + 1]))
            alone = paged_attention(q[rows], k_cache, v_cache, block_tables[one : one + 1], seq_lens[one : one + 1],
                                    make_qsl([40]), 40, 45, d**-0.5, varlen=True)
            close(alone, ref[rows])
            assert calls["varlen"] == expected[2] + 1
    if fresh:
        assert groups is not None and len(groups) > 1  # the grouped causal path really ran
        close(paged_attention(*args, causal_from_start=True), ref)


# ---- the engine ------------------------------------------------------------------------------
def _run(path, monkeypatch, grouped: bool, **kw):
    monkeypatch.setenv("LAMINA_REQUEST_GROUPS", "1" if grouped else "0")
    rng = random.Random(1)
    lens = (3, 70, 5, 44, 2, 90)
    prompts = [{"prompt_token_ids": [rng.randrange(0, 990) for _ in range(n)]} for n in lens]
    calls = []
    real = rg.build_groups
    monkeypatch.setattr(rg, "build_groups", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    with LLM(str(path), **ENGINE, max_num_batched_tokens=64, block_size=8, **kw) as llm:
        # requests join while others decode, so steps mix decodes and prompt chunks
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        ids = [engine.add_request(prompts[0], params), engine.add_request(prompts[1], params)]
        out, step = {}, 0
        while engine.has_unfinished_requests():
            if step in (2, 4, 6, 8) and len(ids) < len(prompts):
                ids.append(engine.add_request(prompts[len(ids)], params))
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
            step += 1
    return [out[i] for i in ids], calls


@pytest.mark.parametrize("family,spec_k", [("qwen3_next", 0), ("qwen3_next", 2), ("qwen4_exp", 0), ("qwen4_exp", 2)])
def test_engine_output_unchanged_by_groups(family, spec_k, eager_groups, monkeypatch, tmp_path,
                                           qwen3_next_dir):
    from tests import tiny_checkpoints as tc

    if family == "qwen4_exp":
        path = tc.make_qwen4_exp(tmp_path / "q4")
    else:
        path = qwen3_next_dir
    kw = {}
    if spec_k:
        import shutil

        shared = family == "qwen4_exp"
        path = tc.add_mtp_weights(shutil.copytree(path, tmp_path / "mtp"), shared_head=shared)
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec_k}
    grouped, calls = _run(path, monkeypatch, True, **kw)
    assert calls and max(calls) > 1  # steps really were split
    plain, no_calls = _run(path, monkeypatch, False, **kw)
    assert not no_calls
    assert grouped == plain

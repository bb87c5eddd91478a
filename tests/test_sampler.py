"""Tests for lamina.worker.sampler."""

import math

import pytest
import torch

from lamina.worker.sampler import Sampler, SamplingBatch
from lamina.worker.top_k_top_p import apply_min_p, apply_top_k_top_p
from lamina.sampling_params import SamplingParams

V = 64
EOS = [1, 2]


def build(params, output_lens=None, vocab=V):
    output_lens = output_lens if output_lens is not None else [0] * len(params)
    return SamplingBatch.build(params, output_lens, EOS, "cpu", vocab)


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, V, dtype=torch.bfloat16)
    batch = build([SamplingParams(temperature=0.0)] * 5)
    out = Sampler()(logits, batch)
    assert out.token_ids.dtype == torch.long
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs is None


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    out = Sampler()(logits, build(params))
    assert out.token_ids[0] == logits[0].argmax()
    assert out.token_ids[2] == logits[2].argmax()


def _run_seeded(seed, logits_rows, batch_rows, target_row, steps=6):
    """Sample `steps` times with the seeded request at `target_row` of a batch (output index =
    step; the other rows, some seeded too, at other indices)."""
    tokens = []
    for step in range(steps):
        params, lens = [], []
        for r in range(batch_rows):
            if r == target_row:
                params.append(SamplingParams(temperature=1.0, seed=seed))
                lens.append(step)
            else:
                params.append(SamplingParams(temperature=0.9, top_p=0.95, seed=r if r % 2 else None))
                lens.append(3 * r + step)
        logits = torch.randn(batch_rows, V)  # other rows: arbitrary
        logits[target_row] = logits_rows[step]
        out = Sampler()(logits, build(params, output_lens=lens))
        tokens.append(int(out.token_ids[target_row]))
    return tokens


def test_seeded_reproducible_and_batch_independent():
    base = torch.Generator().manual_seed(123)
    rows = torch.randn(6, V, generator=base) * 0.5  # flat-ish: many plausible tokens
    alone = _run_seeded(7, rows, batch_rows=1, target_row=0)
    torch.manual_seed(1)
    again = _run_seeded(7, rows, batch_rows=1, target_row=0)
    torch.manual_seed(99)
    in_batch = _run_seeded(7, rows, batch_rows=5, target_row=3)
    other_seed = _run_seeded(8, rows, batch_rows=1, target_row=0)
    assert alone == again == in_batch
    assert other_seed != alone


def test_two_seeded_rows_are_independent_of_each_other():
    logits = torch.zeros(2, V)
    p = SamplingParams(seed=5)
    out = Sampler()(logits, build([p, p]))
    # Same seed, same output index, same logits -> same token in both rows.
    assert out.token_ids[0] == out.token_ids[1]


def test_a_seeded_draw_is_a_function_of_the_output_index():
    """The token at output index i does not depend on the draws before it (there is no
    generator state): sampling index 5 directly gives what index 5 gives after indices 0-4, and
    the noise positions can be overridden on the device (`with_noise_positions`)."""
    torch.manual_seed(0)
    logits = torch.randn(8, V) * 0.3  # flat-ish
    p = SamplingParams(temperature=1.0, seed=11)
    in_order = [int(Sampler()(logits[i : i + 1], build([p], output_lens=[i])).token_ids[0]) for i in range(8)]
    assert int(Sampler()(logits[5:6], build([p], output_lens=[5])).token_ids[0]) == in_order[5]
    batch = build([p] * 8, output_lens=[0] * 8).with_noise_positions(torch.arange(8))
    assert Sampler()(logits, batch).token_ids.tolist() == in_order
    assert len(set(in_order)) > 3  # the indices draw different noise


def test_top_k_keeps_k_and_the_ties_of_the_kth():
    """vLLM and transformers keep every token tied with the k-th; a cut on the value also does not
    depend on the order a sort put tied tokens in."""
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    logits[2, :10] = 5.0  # ten tied tokens straddle the cut at k = 4
    top_k = torch.tensor([1, 7, 4])
    masked = apply_top_k_top_p(logits, top_k, None)
    assert torch.isfinite(masked).sum(-1).tolist() == [1, 7, 10]
    for r, k in enumerate([1, 7, 4]):
        kept = torch.isfinite(masked[r])
        assert torch.equal(kept, logits[r] >= logits[r].topk(k).values.min())
        assert torch.equal(masked[r][kept], logits[r][kept])
    # the same rows in another order and batch give the same sets
    again = apply_top_k_top_p(logits[[2, 0]], top_k[[2, 0]], None)
    assert torch.equal(torch.isfinite(again), torch.isfinite(masked[[2, 0]]))


def test_top_p_keeps_the_ties_of_its_last_token():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    probs = logits.softmax(-1)[0]
    p = float(probs[0] + probs[1]) - 1e-4  # reached at the first of the three tied tokens
    masked = apply_top_k_top_p(logits, None, torch.tensor([p]))
    assert torch.isfinite(masked).tolist() == [[True, True, True, True, False]]


def test_top_k_disabled_rows_untouched_and_sampled_in_set():
    torch.manual_seed(0)
    logits = torch.randn(200, V)
    params = [SamplingParams(top_k=3) if i % 2 == 0 else SamplingParams() for i in range(200)]
    batch = build(params)
    assert batch.top_k.tolist()[:2] == [3, V]
    out = Sampler()(logits, batch)
    top3 = logits.topk(3, dim=-1).indices
    even = torch.arange(0, 200, 2)
    assert (top3[even] == out.token_ids[even].unsqueeze(1)).any(-1).all()


def test_top_p_keeps_minimal_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(4, 1)
    logits = probs.log()[:, [2, 0, 3, 1]]  # shuffled: token 1 is 0.5, 3 is 0.3, 0 is 0.15, 2 is 0.05
    top_p = torch.tensor([0.4, 0.75, 0.81, 1.0])
    masked = apply_top_k_top_p(logits, None, top_p)
    kept = [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in masked]
    assert kept == [{1}, {1, 3}, {1, 3, 0}, {0, 1, 2, 3}]


def test_top_p_tiny_keeps_top_token():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    masked = apply_top_k_top_p(logits, None, torch.tensor([1e-9]))
    assert torch.isfinite(masked).tolist() == [[False, True, False]]


def test_top_k_then_top_p_on_renormalised():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top-k=2 -> renormalised {0.571, 0.429}; top_p=0.55 keeps only token 0,
    # top_p=0.6 keeps both.
    for p, want in [(0.55, 1), (0.6, 2)]:
        masked = apply_top_k_top_p(probs.log(), torch.tensor([2]), torch.tensor([p]))
        assert int(torch.isfinite(masked).sum()) == want


def test_window_path_keeps_the_reference_set_per_row_whatever_the_batch():
    """`filter_top_k_top_p` (rows with top_k <= TOP_K_WINDOW: a top-k of that fixed width, no sort;
    other filtered rows: the sort) keeps exactly `apply_top_k_top_p`'s set, ties included: logits
    rounded to bfloat16, so many tie, also with the k-th beyond the window and at top-p's last
    token; -inf logits (bans); a row alone or in a batch mixing both paths and unfiltered rows keeps
    the same set."""
    from lamina.worker.top_k_top_p import TOP_K_WINDOW, filter_top_k_top_p

    vocab = 700
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, vocab, generator=gen) * 2).to(torch.bfloat16).float()  # [B, V]
    # ten tokens above 200 tied ones: top-k 20's cut is the tie, which runs past the window; top-p 0.3
    # then keeps every tied token only if they all count in its normaliser (in the window alone, the
    # ten would hold 0.385 of the mass, not 0.27, and top-p would stop among them)
    logits[3] = -10.0
    logits[3, :10] = 7.0 + torch.arange(10) * 1e-2
    logits[3, 10:210] = 5.0
    logits[4, 50:] = float("-inf")  # fewer finite logits than the window
    options = [(20, 0.95), (1, 1.0), (TOP_K_WINDOW, 0.9), (20, 0.3), (60, 0.99), (TOP_K_WINDOW + 1, 0.8),
               (0, 0.9), (0, 1.0), (20, 1.0), (7, 1e-9), (300, 1.0), (40, 0.3)]
    params = [SamplingParams(temperature=0.7, top_k=k, top_p=p) for k, p in options]
    batch = SamplingBatch.build(params, [0] * 12, [0], "cpu", vocab)
    assert batch.window_rows == [0, 1, 2, 3, 4, 8, 9, 11] and batch.wide_rows == [5, 6, 10]
    got = torch.isfinite(filter_top_k_top_p(logits, batch))  # [B, V]
    want = torch.isfinite(apply_top_k_top_p(logits, batch.top_k, batch.top_p))
    assert torch.equal(got, want)
    assert got[3].sum() == 210 and got[7].all()
    for row in range(12):  # alone: the same set (one path, no index)
        alone = SamplingBatch.build(params[row:row + 1], [0], [0], "cpu", vocab)
        assert torch.equal(torch.isfinite(filter_top_k_top_p(logits[row:row + 1], alone))[0], got[row]), row
    # a window-only batch of two rows: the window path over the whole batch
    pair = SamplingBatch.build([params[0], params[3]], [0, 0], [0], "cpu", vocab)
    assert pair.window_index is None and pair.wide_rows == []
    assert torch.equal(torch.isfinite(filter_top_k_top_p(logits[[0, 3]], pair)), got[[0, 3]])


def test_min_p_mask():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.clone(), torch.tensor([0.35, 0.0]))
    # threshold 0.175: keep 0.5 and 0.3
    assert (out[0] > 0).tolist() == [True, True, False, False]
    assert (out[1] > 0).all()


def test_min_p_in_sampler():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(500, 1)
    batch = build([SamplingParams(min_p=0.35)] * 500, vocab=4)
    out = Sampler()(logits, batch)
    assert set(out.token_ids.tolist()) <= {0, 1}


def test_min_p_applies_before_top_p():
    """vLLM's order: min-p first, then top-p over what min-p left (renormalised). A at 0.4, B at
    0.3 and 100 tokens at 0.003: min-p 0.1 keeps {A, B}; top-p 0.5 of that keeps only A (top-p
    first would keep A and B)."""
    probs = torch.tensor([0.4, 0.3] + [0.003] * 100)
    batch = build([SamplingParams(top_p=0.5, min_p=0.1)], vocab=102)
    p = Sampler.probs(probs.log()[None].clone(), batch)
    assert p[0, 0] == 1.0 and (p[0, 1:] == 0).all()
    alone = Sampler.probs(probs.log()[None].clone(), build([SamplingParams(min_p=0.1)], vocab=102))
    assert torch.allclose(alone[0, :2], torch.tensor([4 / 7, 3 / 7])) and (alone[0, 2:] == 0).all()


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 1] = 50.0  # EOS
    logits[0, 2] = 40.0  # EOS (second id)
    logits[0, 9] = 30.0  # stop token id
    logits[0, 20] = 20.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    assert int(Sampler()(logits, build([p], output_lens=[0])).token_ids) == 20
    assert int(Sampler()(logits, build([p], output_lens=[2])).token_ids) == 20
    assert int(Sampler()(logits, build([p], output_lens=[3])).token_ids) == 1
    # Random sampling also respects the ban.
    q = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[9])
    out = Sampler()(logits.repeat(50, 1), build([q] * 50, output_lens=[1] * 50))
    assert not torch.isin(out.token_ids, torch.tensor([1, 2, 9])).any()


def test_min_tokens_bans_eos_with_ignore_eos_too():
    """vLLM: EOS is among the ids min_tokens holds back, also with ignore_eos (which only keeps EOS
    from stopping the request afterwards)."""
    logits = torch.zeros(1, V)
    logits[0, 1] = 50.0
    logits[0, 9] = 30.0
    logits[0, 20] = 20.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    batch = build([p], output_lens=[0])
    assert sorted(batch.ban_cols.tolist()) == [1, 2, 9]
    assert int(Sampler()(logits, batch).token_ids) == 20
    assert int(Sampler()(logits, build([p], output_lens=[3])).token_ids) == 1


def test_seed_minus_one_means_no_seed():
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2


def test_logprobs_match_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, V, dtype=torch.float16)
    logits[1, 1] = 20.0  # EOS is banned for row 1 but still shows in raw logprobs
    params = [
        SamplingParams(temperature=0.7, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0, min_tokens=2),
        SamplingParams(temperature=1.0),
    ]
    out = Sampler()(logits, build(params))
    ref = torch.log_softmax(logits.float(), dim=-1)
    lists = out.logprobs_lists()
    ranks = out.sampled_ranks_list()
    assert lists[2] is None and ranks[2] is None
    for row, n in [(0, 3), (1, 0)]:
        tok = int(out.token_ids[row])
        d = lists[row]
        assert tok in d
        assert d[tok] == pytest.approx(float(ref[row, tok]), abs=1e-6)
        top = ref[row].topk(n)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert d[t] == pytest.approx(v, abs=1e-6)
        assert len(d) in (n, n + 1)
        assert ranks[row] == int((ref[row] > ref[row, tok]).sum()) + 1
    assert int(out.token_ids[1]) != 1
    assert ranks[1] == 2  # banned EOS is the raw top token


def test_temperature_sampling_frequency():
    torch.manual_seed(1234)
    n = 40000
    base = torch.tensor([1.0, 0.5, 0.0, -1.0])
    temp = 0.7
    logits = base.repeat(n, 1)  # [N, 4]
    out = Sampler()(logits, build([SamplingParams(temperature=temp)] * n, vocab=4))
    counts = torch.bincount(out.token_ids, minlength=4).double() / n
    expected = torch.softmax(base.double() / temp, dim=-1)
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma).all(), (counts, expected)


def test_greedy_rows_with_a_seed_are_not_seeded_rows():
    logits = torch.randn(2, V)
    batch = build([SamplingParams(temperature=0.0, seed=3)] * 2)
    assert batch.seeded_rows == [] and batch.seeded is None
    assert torch.equal(Sampler()(logits, batch).token_ids, logits.argmax(-1))


def test_build_flags():
    params = [SamplingParams(temperature=0.0, top_k=5), SamplingParams(top_p=0.9, logprobs=2)]
    b = build(params)
    assert not b.all_greedy and b.any_greedy
    assert 0 not in b.window_rows + b.wide_rows  # the greedy row's top-k is not applied
    assert b.window_rows + b.wide_rows == [1]
    assert not b.need_min_p
    assert b.max_num_logprobs == 2
    assert b.temperature.tolist() == [1.0, 1.0]
    assert b.greedy.tolist() == [True, False]
    assert math.isclose(b.top_p[1].item(), 0.9, rel_tol=1e-6)


def test_seeded_noise_of_two_seeds_is_not_shifted_copies():
    """Seeds 600 and 1480 have keys that differ by 152 (xor): with the index xor-ed straight into the
    key, seed 1480 at index 152 drew seed 600's noise at index 0. The index is mixed first now."""
    from lamina.kernels.seeded_noise import seed_key, seeded_exponential

    d = seed_key(600) ^ seed_key(1480)
    assert d == 152
    for i in range(4):
        first = seeded_exponential(torch.tensor([seed_key(600)]), torch.tensor([i]), 64)
        shifted = seeded_exponential(torch.tensor([seed_key(1480)]), torch.tensor([i ^ d]), 64)
        assert not torch.equal(first, shifted), i


@pytest.mark.gpu
def test_window_path_keeps_the_reference_set_on_the_gpu():
    """On CUDA at the 248k vocabulary: the window path (topk, scans) keeps the sort's set for
    bfloat16-rounded logits with the Qwen3.5 defaults and others, and each row's set is the same
    alone as in the batch."""
    from lamina.worker.top_k_top_p import filter_top_k_top_p

    vocab = 248320
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, vocab, generator=gen) * 3).to(torch.bfloat16).float().cuda() / 0.6  # [B, V]
    options = [(20, 0.95), (40, 0.8), (1, 1.0), (128, 0.99), (5, 0.3), (0, 0.95), (20, 1.0), (500, 0.9)] * 2
    params = [SamplingParams(temperature=0.6, top_k=k, top_p=p) for k, p in options]
    for kernels in ("torch", "triton"):  # the window's cut as torch ops, or in one launch
        batch = SamplingBatch.build(params, [0] * 16, [0], "cuda", vocab, sampler_kernels=kernels)
        got = torch.isfinite(filter_top_k_top_p(logits, batch))
        want = torch.isfinite(apply_top_k_top_p(logits, batch.top_k, batch.top_p))
        assert torch.equal(got, want), kernels
        for row in (0, 4, 5, 7):
            alone = SamplingBatch.build(params[row:row + 1], [0], [0], "cuda", vocab, sampler_kernels=kernels)
            assert torch.equal(torch.isfinite(filter_top_k_top_p(logits[row:row + 1], alone))[0], got[row]), (kernels, row)


def _reported(out, row):
    """(sampled token's value, rank, {token: value} of the top N) of one row."""
    lp = out.logprobs
    top = dict(zip(lp.top_token_ids[row].tolist(), lp.top_logprobs[row].tolist()))
    return float(lp.sampled_logprobs[row]), int(lp.sampled_ranks[row]), top


def test_logprobs_modes():
    """vLLM's logprobs_mode: raw logprobs (the default) and raw logits of the model; processed values
    after the bias (greedy row) and after temperature and top-k (random row), removed tokens -inf."""
    torch.manual_seed(3)
    logits = torch.randn(2, V)
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={5: 4.0}),
              SamplingParams(temperature=0.5, top_k=4, logprobs=6, seed=11)]
    outs = {mode: Sampler(mode)(logits, build(params)) for mode in
            ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")}
    tokens = outs["raw_logprobs"].token_ids
    assert all(torch.equal(o.token_ids, tokens) for o in outs.values())  # the mode changes reports only
    biased = logits[0].clone()
    biased[5] += 4.0
    top4 = logits[1].topk(4).indices
    filtered = torch.full((V,), float("-inf"))
    filtered[top4] = logits[1, top4] / 0.5
    expected = {"raw_logprobs": [logits[0].log_softmax(-1), logits[1].log_softmax(-1)],
                "raw_logits": [logits[0], logits[1]],
                "processed_logprobs": [biased.log_softmax(-1), filtered.log_softmax(-1)],
                "processed_logits": [biased, filtered]}
    for mode, rows in expected.items():
        for row, values in enumerate(rows):
            own, rank, top = _reported(outs[mode], row)
            token = int(tokens[row])
            assert own == pytest.approx(float(values[token]), abs=1e-5)
            assert rank == 1 + int((values > values[token]).sum())
            n = params[row].logprobs
            want = values.topk(n)
            got = list(top.items())[:n]  # (the tensors hold the batch's largest N)
            finite = int(want.values.isfinite().sum())  # (the order among -inf ties is the kernel's)
            assert [t for t, _ in got[:finite]] == want.indices[:finite].tolist()
            assert [v for _, v in got] == pytest.approx(want.values.tolist(), abs=1e-5)
    assert int(tokens[0]) == int(biased.argmax())
    _, _, top = _reported(outs["processed_logprobs"], 1)
    assert sum(math.isinf(v) for v in list(top.values())[:6]) == 2  # 6 asked, 4 left by top-k
    with pytest.raises(ValueError, match="logprobs_mode = 'processed'"):
        Sampler("processed")

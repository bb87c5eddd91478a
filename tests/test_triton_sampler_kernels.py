"""The sampler's Triton kernels against their torch references, under Triton's CPU interpreter where
there is no GPU (tests/conftest.py turns it on):
- a seeded request's noise in one launch (lamina.kernels.triton_seeded_noise) against the torch
  reference (lamina.kernels.seeded_noise): the same values within float32 rounding at every token,
  the smallest and largest uniforms included (where a float32 `1 - t` or a float32 uniform would
  lose the noise's precision), written into the given rows only, and the sampler drawing the same
  tokens with either;
- the top-k window's cut in one launch (lamina.kernels.triton_window_cut) against the torch
  window_cut and the sort (lamina.worker.top_k_top_p), and its top-p-only nucleus cut against the sort."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

pytest.importorskip("triton")

from lamina.kernels.seeded_noise import fill_seeded_exponential, seed_key, seeded_exponential, seeded_hash  # noqa: E402
from lamina.kernels.selection import sampler_kernels  # noqa: E402
from lamina.kernels.triton_seeded_noise import fill_seeded_exponential_triton  # noqa: E402
from lamina.sampling_params import SamplingParams  # noqa: E402
from lamina.worker.rejection_sampler import verify_drafts  # noqa: E402
from lamina.worker.sampler import Sampler, SamplingBatch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# a few float32 ulps; on a GPU the kernel's log (u <= 1/2) may be an approximate one
RTOL = 1e-6 if DEVICE == "cpu" else 2e-6


def _keys(seeds) -> torch.Tensor:
    return torch.tensor([seed_key(s) for s in seeds], device=DEVICE)


@pytest.mark.parametrize("vocab", [1, 1000, 2051])
def test_kernel_matches_the_reference_in_the_given_rows(vocab):
    seeds = [0, 1, 600, 1480, 2**63 - 1, -5]
    keys = _keys(seeds)
    positions = torch.tensor([0, 7, 152, 3, 1 << 20, (1 << 32) + 9], device=DEVICE)
    rows = torch.tensor([6, 0, 2, 3, 7, 5], device=DEVICE)
    noise = torch.full((9, vocab), -1.0, device=DEVICE)
    fill_seeded_exponential_triton(noise, rows, keys, positions)
    reference = seeded_exponential(keys, positions, vocab, torch.float64)  # [S, V]
    torch.testing.assert_close(noise[rows].double(), reference, rtol=RTOL, atol=0)
    untouched = torch.tensor([1, 4, 8], device=DEVICE)
    assert (noise[untouched] == -1.0).all()


def test_smallest_and_largest_uniforms_keep_their_precision():
    """Over 2**18 token ids, the largest hash gives u ~ 1 - 4e-6: a float32 uniform is off by ~1%
    there (its noise -log u ~ 4e-6); the kernel's complement series is not. The smallest hash
    gives the largest noise."""
    vocab = 1 << 18
    keys, positions = _keys([12345]), torch.tensor([3], device=DEVICE)
    h = seeded_hash(keys, positions, vocab)[0]  # [V]
    extremes = torch.stack([h.argmin(), h.argmax()])  # [2] token ids
    noise = torch.empty(1, vocab, device=DEVICE)
    fill_seeded_exponential_triton(noise, torch.zeros(1, dtype=torch.long, device=DEVICE), keys, positions)
    exact = -torch.log((h[extremes].double() + 0.5) / 2**32)  # [2]
    torch.testing.assert_close(noise[0, extremes].double(), exact, rtol=RTOL, atol=0)
    naive = -torch.log((h[extremes].float() + 0.5) * 2.0**-32)  # [2] a float32 uniform
    assert ((naive.double() - exact).abs() / exact)[1] > 1e-3  # the case is a discriminating one
    assert noise.min() > 0


def test_no_rows_and_bad_shapes():
    noise = torch.zeros(2, 8, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    fill_seeded_exponential_triton(noise, empty, empty, empty)
    assert (noise == 0).all()
    with pytest.raises(ValueError, match="one entry per seeded row"):
        fill_seeded_exponential_triton(noise, torch.zeros(2, dtype=torch.long, device=DEVICE), _keys([1]),
                                       torch.zeros(1, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="unit column stride"):
        fill_seeded_exponential_triton(noise.t(), empty, empty, empty)
    with pytest.raises(ValueError, match="'torch' or 'triton'"):
        fill_seeded_exponential(noise, empty, empty, empty, "cuda")


def test_selection(monkeypatch):
    monkeypatch.delenv("LAMINA_SAMPLER_KERNELS", raising=False)
    assert sampler_kernels("triton") == "triton"
    assert sampler_kernels("reference") == "torch"
    monkeypatch.setenv("LAMINA_SAMPLER_KERNELS", "torch")
    assert sampler_kernels("triton") == "torch"
    monkeypatch.setenv("LAMINA_SAMPLER_KERNELS", "fast")
    with pytest.raises(ValueError, match="LAMINA_SAMPLER_KERNELS = 'fast'"):
        sampler_kernels("triton")


def test_sampler_and_verification_draw_alike_with_either_noise():
    """The tokens a batch of seeded rows (and one unseeded, one greedy) samples, and the drafts
    verification accepts, are the same with the kernel's noise as with the reference's: the two
    differ by float32 rounding, far below the gaps of these distributions' races."""
    vocab, batch_size = 3001, 6
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch_size, vocab, generator=gen) * 3).to(DEVICE)  # [B, V]
    params = [SamplingParams(temperature=0.9, seed=s) for s in (3, 4, 5, 6)]
    params += [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=50, seed=7)]
    tokens = {}
    for kernels in ("torch", "triton"):
        batch = SamplingBatch.build(params, [0, 1, 2, 3, 4, 5], [0], DEVICE, vocab, sampler_kernels=kernels)
        tokens[kernels] = Sampler()(logits, batch).token_ids.tolist()
    assert tokens["torch"] == tokens["triton"]

    # verification: request 0 (seeded) checks two drafts, request 1 (seeded) one; drafts are the
    # tokens plain seeded sampling draws at those rows, so each is accepted with either noise
    rows = torch.tensor([[0, 1, 2], [3, 4, 4]], device=DEVICE)  # [B, W]
    row_req = torch.tensor([0, 0, 0, 1, 1], device=DEVICE)
    row_pos = torch.tensor([0, 1, 2, 0, 1], device=DEVICE)
    num_drafts = torch.tensor([2, 1], device=DEVICE)
    vparams = [params[0]] * 3 + [params[1]] * 2
    out_lens = [0, 1, 2, 5, 6]
    plain = Sampler()(logits[:5], SamplingBatch.build(vparams, out_lens, [0], DEVICE, vocab)).token_ids
    row_draft = torch.tensor([plain[0], plain[1], -1, plain[3], -1], device=DEVICE)
    results = {}
    for kernels in ("torch", "triton"):
        batch = SamplingBatch.build(vparams, out_lens, [0], DEVICE, vocab, sampler_kernels=kernels)
        out = verify_drafts(logits[:5], rows, row_req, row_pos, row_draft, num_drafts, batch)
        results[kernels] = (out.num_accepted.tolist(), out.tokens.tolist())
    assert results["torch"] == results["triton"]
    assert results["triton"][0] == [2, 1]


def test_window_cut_kernel_keeps_the_reference_set():
    """The top-k window's cut in one launch (lamina.kernels.triton_window_cut) keeps the set of the
    sort (apply_top_k_top_p) and of the torch window_cut: bfloat16 ties, ties of the k-th beyond
    the window (the branch that counts the whole row), -inf logits, top-p 1 and tiny."""
    from lamina.kernels.triton_window_cut import window_cut_triton
    from lamina.worker.top_k_top_p import TOP_K_WINDOW, apply_top_k_top_p, filter_top_k_top_p, window_cut

    vocab = 3000
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(8, vocab, generator=gen) * 2).to(torch.bfloat16).float()  # [B, V]
    logits[1] = -10.0
    logits[1, :10] = 7.0 + torch.arange(10) * 1e-2
    logits[1, 10:210] = 5.0  # the k-th's ties run past the window; top-p 0.3 keeps them all
    logits[2, 60:] = float("-inf")
    logits = logits.to(DEVICE)
    options = [(20, 0.95), (20, 0.3), (100, 0.9), (1, 1.0), (TOP_K_WINDOW, 0.99), (5, 1e-9), (40, 1.0), (7, 0.5)]
    top_k = torch.tensor([k for k, _ in options], device=DEVICE)
    top_p = torch.tensor([p for _, p in options], device=DEVICE)
    cut = window_cut_triton(logits, top_k, top_p, TOP_K_WINDOW)  # [B, 1]
    got = logits >= cut
    assert torch.equal(got, torch.isfinite(apply_top_k_top_p(logits, top_k, top_p)))
    assert torch.equal(got, logits >= window_cut(logits, top_k, top_p))
    assert got[1].sum() == 210
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p) for k, p in options]
    batch = SamplingBatch.build(params, [0] * 8, [0], DEVICE, vocab, sampler_kernels="triton")
    assert torch.equal(torch.isfinite(filter_top_k_top_p(logits, batch)), got)


@pytest.fixture
def nucleus_cut_on(monkeypatch):
    """The sampler takes the nucleus cut (lamina.kernels.selection.nucleus_cut_enabled) in the test."""
    from lamina.kernels import selection

    monkeypatch.setenv("LAMINA_NUCLEUS_CUT", "1")
    selection.nucleus_cut_enabled.cache_clear()
    yield
    monkeypatch.delenv("LAMINA_NUCLEUS_CUT", raising=False)
    selection.nucleus_cut_enabled.cache_clear()


def test_nucleus_cut_kernel_keeps_the_sorted_set(nucleus_cut_on, monkeypatch):
    """Top-p without top-k in one launch after the window's `topk` (lamina.kernels.triton_window_cut.
    nucleus_cut_triton) keeps the sort's set (sorted_cut): rows whose window holds top-p of the mass
    and rows that bisect (flat logits, top-p near 1), bfloat16 and integer ties (also at the cut),
    -inf logits, a tiny top-p; through the sampler's groups, alone and in a batch with other rows."""
    from lamina.kernels.triton_window_cut import nucleus_cut_triton
    from lamina.worker.top_k_top_p import TOP_K_WINDOW, filter_top_k_top_p, sorted_cut

    vocab = 3000
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(9, vocab, generator=gen)  # [B, V]
    logits[0] *= 4  # peaked: the window holds the nucleus
    logits[1] *= 0.1  # flat: bisection over the row
    logits[2] = (logits[2] * 2).to(torch.bfloat16).float()  # ties
    logits[3, 100:] = float("-inf")  # fewer finite logits than the window
    logits[4] = logits[4].round()  # seven values: every cut falls on a tie that runs past the window
    logits[6] = -logits[6].abs()  # negative logits only (the float keys' negative half)
    logits = logits.to(DEVICE)
    top_p = torch.tensor([0.95, 0.9, 0.5, 0.99, 0.7, 0.3, 0.8, 1e-6, 0.999], device=DEVICE)
    window_mass = logits.softmax(-1).topk(TOP_K_WINDOW, dim=-1).values.sum(-1)  # [B]
    bisected = (window_mass < top_p).tolist()
    assert bisected[1] and bisected[8] and not bisected[0]  # both branches run
    want = logits >= sorted_cut(logits, None, top_p)
    for sections in (1, 4):  # a bisection; several points a step (the default's path, NUCLEUS_SECTIONS)
        got = logits >= nucleus_cut_triton(logits, top_p, TOP_K_WINDOW, sections=sections)  # [B, V]
        assert torch.equal(got, want), (sections, (got != want).sum(1))
    got = logits >= nucleus_cut_triton(logits, top_p, TOP_K_WINDOW)
    assert torch.equal(got, want)
    assert got[7].sum() == 1 and 1 < got[4].sum() < vocab
    import lamina.kernels.triton_window_cut as window_module
    from lamina.kernels import selection

    calls = []
    real = window_module.nucleus_cut_triton
    monkeypatch.setattr(window_module, "nucleus_cut_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    options = [dict(top_p=p) for p in top_p.tolist()] + [dict(top_k=20, top_p=0.9), dict(top_k=500), dict()]
    params = [SamplingParams(temperature=0.8, **o) for o in options]
    mixed = torch.cat([logits, logits[:3]])  # [12, V]
    batch = SamplingBatch.build(params, [0] * 12, [0], DEVICE, vocab, sampler_kernels="triton")
    assert batch.wide_rows == list(range(9)) + [10] and batch.window_rows == [9]
    filtered = torch.isfinite(filter_top_k_top_p(mixed, batch))  # [12, V]
    assert torch.equal(filtered[:9], got) and filtered[11].all()
    assert torch.equal(filtered[10], logits[1] >= logits[1].topk(500).values[-1])
    for row in (1, 4):  # alone: the whole batch is the wide group
        alone = SamplingBatch.build(params[row:row + 1], [0], [0], DEVICE, vocab, sampler_kernels="triton")
        assert alone.wide_index is None
        assert torch.equal(torch.isfinite(filter_top_k_top_p(logits[row:row + 1], alone))[0], got[row])
    assert len(calls) == 3  # the sampler's filter took the kernel
    monkeypatch.setenv("LAMINA_NUCLEUS_CUT", "0")  # switched off: the sort, the same sets
    selection.nucleus_cut_enabled.cache_clear()
    assert torch.equal(torch.isfinite(filter_top_k_top_p(mixed, batch)), filtered) and len(calls) == 3
    monkeypatch.setenv("LAMINA_NUCLEUS_CUT", "yes")
    selection.nucleus_cut_enabled.cache_clear()
    with pytest.raises(ValueError, match="LAMINA_NUCLEUS_CUT = 'yes' must be 0 or 1"):
        filter_top_k_top_p(mixed, batch)


def test_search_cut_keeps_the_sorted_set_of_a_top_k_past_the_window():
    """Rows whose top-k is wider than the window (lamina.kernels.triton_window_cut.nucleus_cut_triton
    with top_k): the k-th largest logit found by count, then top-p within the top-k from the window or
    by a search, keep the sort's set: ties at the k-th (bfloat16, integers, +0.0 with -0.0), a k-th
    that is -inf (fewer finite logits than k), k one below the vocabulary, top-p 1 (top-k alone), a
    tiny top-p, flat rows; rows with k = V (top-p alone) in the same launch skip the count."""
    from lamina.kernels.triton_window_cut import nucleus_cut_triton
    from lamina.worker.top_k_top_p import TOP_K_WINDOW, sorted_cut

    vocab = 2000
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(10, vocab, generator=gen)  # [B, V]
    logits[0] *= 4  # peaked: the window holds top-p of the top-k's mass
    logits[1] *= 0.1  # flat: both searches run
    logits[2] = (logits[2] * 2).to(torch.bfloat16).float()  # ties, also at the k-th
    logits[3] = logits[3].round()  # seven values: the k-th's ties run far past k
    logits[4, 150:] = float("-inf")  # the k-th (k = 300) is -inf
    logits[5, :100] = 1.0
    logits[5, 100:600] = -0.0  # the k-th (k = 500) is zero, +0.0 and -0.0 ones tied: top-p's normaliser
    logits[5, 600:1500] = 0.0  # counts both (with the -0.0 ones 0.16 of the mass lies above 0, else 0.23)
    logits[5, 1500:] = -1.0
    logits[6] *= 0.3
    logits[8] *= 0.5
    logits = logits.to(DEVICE)
    options = [(300, 0.9), (1000, 0.95), (200, 0.8), (129, 0.99), (300, 1.0), (500, 0.2), (vocab - 1, 1.0),
               (500, 1e-6), (vocab, 0.7), (700, 1.0)]
    top_k = torch.tensor([k for k, _ in options], device=DEVICE)
    top_p = torch.tensor([p for _, p in options], device=DEVICE)
    want = logits >= sorted_cut(logits, top_k, top_p)  # [B, V]
    assert want[5].sum() == 1500 and want[4].all() and want[7].sum() == 1 and want[9].sum() == 700
    for sections in (1, 4, 8):
        got = logits >= nucleus_cut_triton(logits, top_p, TOP_K_WINDOW, top_k=top_k, sections=sections)  # [B, V]
        assert torch.equal(got, want), (sections, (got != want).sum(1))
    # the searches ran: the window holds less than top-p of the top-k's mass in the flat row
    kept = logits[1].masked_fill(~want[1], float("-inf")).softmax(-1)
    assert kept.topk(TOP_K_WINDOW).values.sum() < 0.95 < 1


def test_the_runner_warms_the_sampler_kernels(qwen3_next_dir, nucleus_cut_on, monkeypatch):
    """On the Triton kernel set the runner compiles the sampler's kernels when its caches are
    allocated (on CUDA; called again directly here), launching all three at the model's vocabulary."""
    import lamina.kernels.triton_seeded_noise as noise_module
    import lamina.kernels.triton_window_cut as window_module
    from lamina import LLM

    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    with LLM(str(qwen3_next_dir), device=DEVICE, dtype="float32", max_model_len=64, show_progress=False) as llm:
        runner = llm.engine.executor.runner
        assert runner.sampler_kernels == "triton"
        launched = []
        for module, name in ((noise_module, "fill_seeded_exponential_triton"), (window_module, "window_cut_triton"),
                             (window_module, "nucleus_cut_triton")):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: launched.append(_name) or _real(*a, **k))
        runner.warm_sampler_kernels()
    assert sorted(launched) == ["fill_seeded_exponential_triton", "nucleus_cut_triton", "window_cut_triton"]

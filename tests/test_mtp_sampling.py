"""Speculative sampling keeps the target's distribution (a statistical test on a tiny vocabulary).

A target and a drafter that are first-order Markov chains over 6 tokens, with different
transition matrices (the drafter even gives zero probability to some tokens the target likes).
Many independent sequences are generated at once: the drafter proposes 2 tokens, the target
verifies them with `verify_drafts` (the function the runner uses), and plain target sampling
fills in whatever a step did not emit. The empirical joint distribution of the first three
tokens must match the target chain's exact one: a chi-square statistic over the 216 cells stays
below a bound that a broken sampler (stale draft probabilities, or a broken acceptance test)
exceeds by far. Fixed seeds: the test is deterministic.
"""

from __future__ import annotations

import pytest
import torch

from lamina.worker import rejection_sampler
from lamina.worker.rejection_sampler import sample_drafts, verify_drafts
from lamina.worker.sampler import SamplingBatch
from lamina.sampling_params import SamplingParams

V, K, N = 6, 2, 60_000
CELLS = V**3
BOUND = CELLS + 6 * (2 * CELLS) ** 0.5  # chi-square with 215 dof: mean 215, sd ~21


def chains():
    gen = torch.Generator().manual_seed(0)
    target = torch.rand(V, V, generator=gen) ** 2 + 0.02
    draft = torch.rand(V, V, generator=gen) ** 2
    draft[:, 1] = 0.0  # the drafter never proposes token 1
    return target / target.sum(1, keepdim=True), draft / draft.sum(1, keepdim=True)


def draw(probs: torch.Tensor) -> torch.Tensor:
    return torch.multinomial(probs, 1)[:, 0]


def verify(p_rows, q_rows, drafts, num_drafts, mutation=None):
    """p_rows [B, k+1, V], q_rows [B, k, V], drafts [B, k] -> (tokens [B, k+1], num_accepted [B])."""
    bsz, width = p_rows.shape[:2]
    k = width - 1
    rows = torch.arange(bsz * width).view(bsz, width)  # [B, W]
    row_req = torch.arange(bsz).repeat_interleave(width)
    row_pos = torch.arange(width).repeat(bsz)
    row_draft = torch.cat([drafts, torch.full((bsz, 1), -1)], dim=1).reshape(-1)  # [R]
    q_flat = torch.cat([q_rows, torch.zeros(bsz, 1, V)], dim=1).reshape(-1, V)  # [R, V]
    if mutation == "stale_q":
        q_flat = p_rows.reshape(-1, V)  # verifies with the wrong q (here: p itself)
    params = SamplingParams(temperature=1.0)
    batch = SamplingBatch.build([params] * (bsz * width), [0] * (bsz * width), [], "cpu", V)
    out = verify_drafts(
        p_rows.reshape(-1, V).log(), rows, row_req, row_pos, row_draft, torch.full((bsz,), num_drafts), batch, q_flat,
    )
    return out.tokens, out.num_accepted


def generate(mutation=None) -> torch.Tensor:
    """First three tokens after token 0 of N sequences, [N, 3]."""
    torch.manual_seed(1)
    p, q = chains()
    start = torch.zeros(N, dtype=torch.long)
    d1 = draw(q[start])
    d2 = draw(q[d1])
    p_rows = torch.stack([p[start], p[d1], p[d2]], dim=1)  # [N, 3, V]
    q_rows = torch.stack([q[start], q[d1]], dim=1)  # [N, 2, V]
    tokens, accepted = verify(p_rows, q_rows, torch.stack([d1, d2], dim=1), K, mutation)
    out = torch.empty(N, 3, dtype=torch.long)
    out[:, 0] = tokens[:, 0]
    # Tokens a step did not emit come from plain target sampling (a k = 0 verification).
    for j in (1, 2):
        plain, _ = verify(p[out[:, j - 1]][:, None], torch.zeros(N, 0, V), torch.zeros(N, 0, dtype=torch.long), 0)
        out[:, j] = torch.where(accepted >= j, tokens[:, j], plain[:, 0])
    return out


def chi_square(samples: torch.Tensor) -> float:
    p, _ = chains()
    exact = p[0][:, None, None] * p[:, :, None] * p[None, :, :]  # [V, V, V]: p(a|0) p(b|a) p(c|b)
    index = samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2]
    counts = torch.bincount(index, minlength=CELLS).double()
    expected = exact.reshape(-1).double() * samples.shape[0]
    return float(((counts - expected) ** 2 / expected).sum())


def test_speculative_sampling_preserves_the_target_distribution():
    stat = chi_square(generate())
    assert stat < BOUND, f"chi-square {stat:.0f} over {CELLS} cells exceeds {BOUND:.0f}"


@pytest.mark.parametrize("mutation", ["stale_q", "always_accept"])
def test_a_broken_sampler_fails_the_bound(mutation, monkeypatch):
    if mutation == "always_accept":  # u = 0 passes every acceptance test
        monkeypatch.setattr(rejection_sampler, "_uniforms", lambda n, batch, device: torch.zeros(n, device=device))
    stat = chi_square(generate(None if mutation == "always_accept" else mutation))
    assert stat > 3 * BOUND, f"chi-square {stat:.0f}: the broken sampler went unnoticed"


# ---- seeded requests: coupling (each row draws what plain seeded sampling draws at its index) ----
N_SEEDED = 20_000  # one seed per sequence: SamplingBatch.build runs per row on the host
def seeded_batch(num_rows: int, seeds: torch.Tensor, positions: torch.Tensor) -> SamplingBatch:
    """Rows of seeded requests (`seeds` [rows]) sampling output indices `positions` [rows]."""
    params = [SamplingParams(temperature=1.0, seed=int(s)) for s in seeds]
    return SamplingBatch.build(params, positions.tolist(), [], "cpu", V)


def seeded_draw(probs: torch.Tensor, seeds: torch.Tensor, index: int) -> torch.Tensor:
    """Plain seeded sampling from `probs` [N_SEEDED, V] at output index `index` (what the sampler does)."""
    batch = seeded_batch(len(seeds), seeds, torch.full((len(seeds),), index))
    return sample_drafts(probs.log(), batch)[0]


def generate_seeded(mutation=None, n: int = N_SEEDED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n seeded sequences (seed i) that have emitted the token at output index 0 (plain seeded
    sampling after token 0): the drafter proposes indices 1 and 2 with the seeds' noise there,
    the target verifies (rows: indices 1, 2 and the bonus index 3). Returns (the verification's
    tokens [n, 3] at indices 1-3, num_accepted [n], the plain seeded text [n, 4] at indices 0-3)."""
    p, q = chains()
    seeds = torch.arange(n)
    plain = torch.empty(n, 4, dtype=torch.long)  # what every K must reproduce
    prev = torch.zeros(n, dtype=torch.long)
    for i in range(4):
        plain[:, i] = prev = seeded_draw(p[prev], seeds, i)
    d1 = seeded_draw(q[plain[:, 0]], seeds, 1)
    d2 = seeded_draw(q[d1], seeds, 2 if mutation != "same_noise" else 1)
    drafts = torch.stack([d1, d2], dim=1)  # [n, 2]
    width = K + 1
    p_rows = torch.stack([p[plain[:, 0]], p[d1], p[d2]], dim=1)  # [n, 3, V]: predicts indices 1, 2, 3
    rows = torch.arange(n * width).view(n, width)
    row_req = torch.arange(n).repeat_interleave(width)
    row_pos = torch.arange(width).repeat(n)
    row_draft = torch.cat([drafts, torch.full((n, 1), -1)], dim=1).reshape(-1)  # [R]
    positions = (1 + row_pos) if mutation != "index_zero" else torch.zeros_like(row_pos)  # [R]
    batch = seeded_batch(n * width, seeds.repeat_interleave(width), positions)
    out = verify_drafts(p_rows.reshape(-1, V).log(), rows, row_req, row_pos, row_draft,
                        torch.full((n,), K), batch, None)
    return out.tokens, out.num_accepted, plain


def test_seeded_verification_emits_the_plain_seeded_text():
    """A seeded request's verified tokens are, row by row, what plain seeded sampling draws at
    those output indices (so its text does not depend on K): at every accepted draft and at the
    first rejected row (the rows after it are discarded). Drafts drawn with the same noise are
    accepted often (coupling), and the plain seeded text has the target's distribution."""
    tokens, accepted, plain = generate_seeded()
    emitted = torch.arange(K + 1)[None, :] <= accepted[:, None]  # [N_SEEDED, K+1]: rows 0..accepted are emitted
    assert torch.equal(tokens[emitted], plain[:, 1:][emitted])
    # coupled drafts are accepted often; rejection sampling (unseeded) is the bound (here ~1 - TV)
    # (from the same last tokens): coupling accepts a little less, never more than ~sampling noise
    torch.manual_seed(1)
    p, q = chains()
    last = plain[:, 0]
    d1 = draw(q[last])
    d2 = draw(q[d1])
    _, rejection_accepted = verify(torch.stack([p[last], p[d1], p[d2]], dim=1), torch.stack([q[last], q[d1]], dim=1),
                                   torch.stack([d1, d2], dim=1), K)
    coupled, bound = accepted.float().mean().item(), rejection_accepted.float().mean().item()
    assert 0.6 * bound < coupled <= bound + 0.02, (coupled, bound)
    stat = chi_square(plain[:, :3])
    assert stat < BOUND, f"chi-square {stat:.0f} of the seeded text over {CELLS} cells exceeds {BOUND:.0f}"


def test_seeded_noise_not_keyed_by_the_output_index_fails():
    """Mutations: all rows drawing index 0's noise breaks the equality with the plain text; a
    drafter drawing draft 2 with index 1's noise loses acceptances (and never the text)."""
    tokens, accepted, plain = generate_seeded("index_zero", 5000)
    emitted = torch.arange(K + 1)[None, :] <= accepted[:, None]
    assert not torch.equal(tokens[emitted], plain[:, 1:][emitted])
    _, accepted_ok, _ = generate_seeded(n=5000)
    tokens, accepted_bad, plain = generate_seeded("same_noise", 5000)
    emitted = torch.arange(K + 1)[None, :] <= accepted_bad[:, None]
    assert torch.equal(tokens[emitted], plain[:, 1:][emitted])
    assert (accepted_bad == 2).float().mean() < 0.5 * (accepted_ok == 2).float().mean()

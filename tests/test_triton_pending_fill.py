"""Filling in a step planned ahead under MTP (lamina.kernels.triton_pending_fill) against the torch
reference (lamina.kernels.pending_fill): the same tokens, positions, context lengths, KV slots and
shifts, exactly, under Triton's CPU interpreter where there is no GPU (tests/conftest.py turns it
on). The engine-level check, planned-ahead tokens equal to the synchronous run's, is
tests/test_mtp_async.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

pytest.importorskip("triton")

from lamina.kernels.pending_fill import fill_pending_reference  # noqa: E402
from lamina.kernels.triton_pending_fill import fill_pending_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 4


def _step(seed: int, num_reqs: int, queries: int, num_prev: int, num_drafts: int, pending_every: int):
    """A staged step of `num_reqs` requests planned as if every draft were accepted, and the
    previous step's results: request b is pending unless b % pending_every == 1."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = 6
    tables = torch.randint(0, 50, (num_reqs, max_blocks), generator=gen)  # [B, M]
    # optimistic positions: room for a shift of up to the previous step's drafts
    starts = torch.randint(num_drafts, max_blocks * BLOCK_SIZE - queries, (num_reqs,), generator=gen)  # [B]
    positions = starts[:, None] + torch.arange(queries)  # [B, Q]
    slots = tables.gather(1, positions // BLOCK_SIZE) * BLOCK_SIZE + positions % BLOCK_SIZE  # [B, Q]
    token_ids = torch.randint(0, 1000, (num_reqs, queries), generator=gen)  # [B, Q]
    seq_lens = starts + queries  # [B]
    source_rows = torch.randperm(num_prev, generator=gen)[:num_reqs]  # [B]
    source_rows[1::pending_every] = -1
    bonus = torch.randint(0, 1000, (num_prev,), generator=gen)  # [B_prev]
    drafts = torch.randint(0, 1000, (num_prev, num_drafts), generator=gen)  # [B_prev, D]
    rejected = torch.randint(0, num_drafts + 1, (num_prev,), generator=gen)  # [B_prev]
    staged = [token_ids, positions, seq_lens, slots, tables]
    return [t.to(DEVICE) for t in staged], [t.to(DEVICE) for t in (source_rows, bonus, drafts, rejected)]


@pytest.mark.parametrize("num_reqs,queries,num_prev,num_drafts,pending_every", [
    (1, 2, 1, 1, 3),   # batch 1, K = 1, pending
    (5, 4, 7, 3, 2),   # K = 3, every other request not pending
    (3, 3, 4, 5, 9),   # the previous step proposed more drafts than this one verifies
    (4, 1, 4, 0, 2),   # one token a request, no drafts: only the target token is filled in
])
def test_triton_fill_equals_reference(num_reqs, queries, num_prev, num_drafts, pending_every):
    staged, previous = _step(num_reqs + queries, num_reqs, queries, num_prev, num_drafts, pending_every)
    expected = [t.clone() for t in staged]
    actual = [t.clone() for t in staged]
    want = fill_pending_reference(*expected, *previous, BLOCK_SIZE)
    got = fill_pending_triton(*actual, *previous, BLOCK_SIZE)
    assert torch.equal(got, want)
    for name, a, e in zip(("token_ids", "positions", "seq_lens", "slot_mapping", "block_tables"), actual, expected):
        assert torch.equal(a, e), name
    source_rows, bonus, drafts, rejected = previous
    pending = source_rows >= 0
    assert pending.any() and (~pending).any() or num_reqs == 1
    # what the reference computes, spelled out: pending rows take the previous step's target token
    # and drafts and move back by its rejected count; the others are left as staged
    for b in range(num_reqs):
        row = int(source_rows[b])
        if row < 0:
            assert torch.equal(actual[0][b], staged[0][b]) and int(got[b]) == 0
            continue
        assert actual[0][b].tolist() == [int(bonus[row])] + drafts[row, : queries - 1].tolist()
        assert torch.equal(actual[1][b], staged[1][b] - rejected[row])
        assert int(actual[2][b]) == int(staged[2][b] - rejected[row])


def test_rows_with_nothing_pending_may_hold_any_position():
    """Padding rows (nothing pending) may hold positions past their block tables: both forms leave
    them as they are and read no block for them."""
    staged, previous = _step(3, 4, 2, 4, 1, 2)
    staged[1][1] = 10_000  # request 1 is not pending
    expected, actual = [t.clone() for t in staged], [t.clone() for t in staged]
    assert torch.equal(fill_pending_triton(*actual, *previous, BLOCK_SIZE),
                       fill_pending_reference(*expected, *previous, BLOCK_SIZE))
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    assert int(actual[1][1, 0]) == 10_000 and torch.equal(actual[3][1], staged[3][1])


def test_too_few_drafts_refused():
    staged, previous = _step(0, 2, 3, 2, 1, 2)
    with pytest.raises(ValueError, match="need 2 drafts"):
        fill_pending_triton(*staged, *previous, BLOCK_SIZE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("queries", [1, 2, 4])
def test_triton_fill_equals_reference_on_the_gpu(queries):
    """The verification graphs' largest batch (64), compiled for the GPU rather than interpreted."""
    staged, previous = _step(queries, 64, queries, 64, 3, 5)
    expected, actual = [t.clone() for t in staged], [t.clone() for t in staged]
    assert torch.equal(fill_pending_triton(*actual, *previous, BLOCK_SIZE),
                       fill_pending_reference(*expected, *previous, BLOCK_SIZE))
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


def test_pending_fill_switch(monkeypatch):
    from lamina.kernels.selection import pending_fill_kernels

    assert pending_fill_kernels("triton") == "triton" and pending_fill_kernels("reference") == "torch"
    monkeypatch.setenv("LAMINA_PENDING_FILL", "torch")
    assert pending_fill_kernels("triton") == "torch"
    monkeypatch.setenv("LAMINA_PENDING_FILL", "cuda")
    with pytest.raises(ValueError, match="LAMINA_PENDING_FILL = 'cuda' must be 'triton' or 'torch'"):
        pending_fill_kernels("triton")

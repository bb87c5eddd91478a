"""The grouped state-row copy (speculative decoding's commit, lamina.kernels.triton_state_rows)
against the torch reference: bit-identical pools, under Triton's CPU interpreter where there is
no GPU (tests/conftest.py turns it on)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

triton = pytest.importorskip("triton")

from lamina.kernels.state_rows import copy_state_rows_reference  # noqa: E402
from lamina.kernels.triton_state_rows import BLOCK, TABLE_CACHE_SIZE, StateRowCopier  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pools(seed: int, slots: int, rows: int):
    """Pools of two kinds (fp32 delta-rule-like, bf16 conv-like, one row longer than a program's
    block) with their captured rows, as a model's state pools and a step's capture."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [((3, 4, 5), torch.float32), ((6, 3), torch.bfloat16), ((3, 4, 5), torch.float32),
              ((BLOCK + 7,), torch.float32), ((6, 3), torch.bfloat16)]
    pairs = []
    for shape, dtype in shapes:
        pool = torch.randn(slots, *shape, generator=gen).to(DEVICE, dtype)
        captured = torch.randn(rows, *shape, generator=gen).to(DEVICE, dtype)
        pairs.append((pool, captured))
    return pairs


def _copy(pairs):
    return [(p.clone(), c.clone()) for p, c in pairs]


def _check(copier, pairs, dst_rows, src_rows):
    expected = _copy(pairs)
    copier(pairs, dst_rows, src_rows)
    copy_state_rows_reference(expected, dst_rows, src_rows)
    for (pool, captured), (want, want_captured) in zip(pairs, expected):
        assert torch.equal(pool, want)
        assert torch.equal(captured, want_captured)  # sources untouched


def test_negative_source_rows_copy_nothing():
    """The device-side commit of a step planned ahead (spec_step.commit): a request that accepted
    every draft gets source row -1, and its slot keeps its state, in both forms."""
    pairs = _pools(3, slots=6, rows=5)
    before = _copy(pairs)
    dst_rows = torch.tensor([4, 0, 2], dtype=torch.long, device=DEVICE)
    src_rows = torch.tensor([3, -1, 1], dtype=torch.long, device=DEVICE)
    reference = _copy(pairs)
    StateRowCopier()(pairs, dst_rows, src_rows, skip_negative=True)
    copy_state_rows_reference(reference, dst_rows, src_rows, skip_negative=True)
    for (pool, captured), (want, _), (old, old_captured) in zip(pairs, reference, before):
        assert torch.equal(pool, want)
        assert torch.equal(pool[0], old[0])  # skipped
        assert torch.equal(pool[4], old_captured[3]) and torch.equal(pool[2], old_captured[1])
        assert torch.equal(captured, old_captured)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_copy_rows_equals_reference(count):
    pairs = _pools(0, slots=6, rows=5)
    before = _copy(pairs)
    dst_rows = torch.tensor([4, 0, 2][:count], dtype=torch.long, device=DEVICE)
    src_rows = torch.tensor([3, 4, 0][:count], dtype=torch.long, device=DEVICE)
    copier = StateRowCopier()
    _check(copier, pairs, dst_rows, src_rows)
    changed = [not torch.equal(p, b) for (p, _), (b, _) in zip(pairs, before)]
    assert all(changed) if count else not any(changed)
    # the same tensors again, other rows: the cached address tables (three groups, two tables each)
    _check(copier, pairs, torch.tensor([1], device=DEVICE), torch.tensor([2], device=DEVICE))
    assert len(copier._tables) == 6


def test_copy_rows_with_fresh_sources_past_the_table_cache():
    """Fresh captured rows every call (the eager verification path): every call right, the
    destination tables kept, the cache bounded."""
    copier = StateRowCopier()
    pools = _pools(4, slots=5, rows=2)
    dst_rows, src_rows = torch.tensor([3, 1], device=DEVICE), torch.tensor([0, 1], device=DEVICE)
    for seed in range(TABLE_CACHE_SIZE + 4):
        fresh = [(pool, captured.clone().add_(seed)) for pool, captured in pools]
        _check(copier, fresh, dst_rows, src_rows)
        assert len(copier._tables) <= TABLE_CACHE_SIZE
    destination_keys = {tuple(p.data_ptr() for p, _ in pools if p.dtype == dtype) for dtype in (torch.float32, torch.bfloat16)}
    # one float32 group per row length: the destination keys are subsets of these, all still cached
    assert sum(1 for key in copier._tables if set(key) <= set().union(*destination_keys)) == 3


def test_copy_rows_rejects_row_lists_of_different_lengths():
    pairs = _pools(5, slots=4, rows=3)
    with pytest.raises(ValueError, match="2 destination rows but 1 source rows"):
        StateRowCopier()(pairs, torch.tensor([0, 1], device=DEVICE), torch.tensor([2], device=DEVICE))


def test_copy_rows_with_a_tensor_both_written_and_read_follows_the_reference_order(monkeypatch):
    """(a <- b), (b <- c): one launch would race on a GPU (the interpreter runs programs in
    order, so it cannot show the race): the copier must not launch, and takes the reference's
    pair order."""
    from lamina.kernels import triton_state_rows

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched a copy whose destination is also a source")

    monkeypatch.setattr(triton_state_rows, "_copy_rows_kernel", NoLaunch())
    gen = torch.Generator().manual_seed(6)
    a, b, c = (torch.randn(4, 3, 5, generator=gen).to(DEVICE) for _ in range(3))
    a2, b2, c2 = a.clone(), b.clone(), c.clone()
    b_before = b.clone()
    dst_rows, src_rows = torch.tensor([0, 2], device=DEVICE), torch.tensor([2, 0], device=DEVICE)
    StateRowCopier()([(a, b), (b, c)], dst_rows, src_rows)
    copy_state_rows_reference([(a2, b2), (b2, c2)], dst_rows, src_rows)
    assert torch.equal(a, a2) and torch.equal(b, b2) and torch.equal(c, c2)
    assert torch.equal(a[0], b_before[2]) and torch.equal(b[2], c[0])  # a read b's rows before b was written
    # b written by a pair the kernel does not take (a bf16 source: the reference's dtype change)
    c16 = c.to(torch.bfloat16)
    a2, b2 = a.clone(), b.clone()
    StateRowCopier()([(a, b), (b, c16)], dst_rows, src_rows)
    copy_state_rows_reference([(a2, b2), (b2, c16)], dst_rows, src_rows)
    assert torch.equal(a, a2) and torch.equal(b, b2)


def test_copy_rows_falls_back_for_pairs_the_kernel_does_not_take():
    """A dtype change and a non-contiguous source go through the reference, beside kernel groups."""
    pairs = _pools(2, slots=4, rows=3)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(3, 10, 4, generator=gen).to(DEVICE)
    pairs.append((torch.zeros(4, 10, 2, device=DEVICE), wide[:, :, :2]))  # non-contiguous source
    pairs.append((torch.zeros(4, 5, dtype=torch.bfloat16, device=DEVICE), torch.randn(3, 5, generator=gen).to(DEVICE)))
    expected = _copy(pairs)
    dst_rows = torch.tensor([1, 3], device=DEVICE)
    src_rows = torch.tensor([2, 0], device=DEVICE)
    StateRowCopier()(pairs, dst_rows, src_rows)
    copy_state_rows_reference(expected, dst_rows, src_rows)
    for (pool, _), (want, _) in zip(pairs, expected):
        assert torch.equal(pool, want)


def test_copy_rows_caches_the_grouping_per_pair_list(monkeypatch):
    """The same tensors (a new list of them, as every graph-replayed commit passes) group once;
    fresh captured rows (the eager path) group again, and the cache holds no strong reference
    to them; an entry is used only for the very tensors it was built from."""
    import gc
    import weakref

    from lamina.kernels import triton_state_rows

    calls = []
    real_group = triton_state_rows._group
    monkeypatch.setattr(triton_state_rows, "_group", lambda pairs: calls.append(len(pairs)) or real_group(pairs))
    copier = StateRowCopier()
    pairs = _pools(7, slots=5, rows=3)
    dst_rows, src_rows = torch.tensor([4, 1], device=DEVICE), torch.tensor([0, 2], device=DEVICE)
    _check(copier, pairs, dst_rows, src_rows)
    _check(copier, list(pairs), torch.tensor([0], device=DEVICE), torch.tensor([1], device=DEVICE))
    assert calls == [5]
    fresh = [(pool, captured.clone()) for pool, captured in pairs]
    _check(copier, fresh, dst_rows, src_rows)
    assert calls == [5, 5]
    dead = weakref.ref(fresh[0][1])
    del fresh
    gc.collect()
    assert dead() is None  # the plan cache kept no captured rows alive
    # pools 0 and 2 are of one group: their captured rows exchanged, a plan reused by mistake would
    # copy each pool's rows from the other's capture
    swapped = [(pairs[0][0], pairs[2][1]), pairs[1], (pairs[2][0], pairs[0][1])] + pairs[3:]
    _check(copier, swapped, dst_rows, src_rows)
    assert calls == [5, 5, 5]
    # the safety check itself: another list's plan planted under this list's key is not used
    key_of = lambda ps: tuple(x for d, s in ps for x in (id(d), d.data_ptr(), id(s), s.data_ptr()))  # noqa: E731
    copier._plans[key_of(pairs)] = copier._plans[key_of(swapped)]
    _check(copier, pairs, dst_rows, src_rows)
    assert calls == [5, 5, 5, 5]
    _check(copier, pairs, dst_rows, src_rows)  # regrouped and cached again under its key
    assert calls == [5, 5, 5, 5]

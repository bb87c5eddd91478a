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

from lamina.kernels.triton_state_rows import BLOCK, StateRowCopier, copy_state_rows_reference  # noqa: E402

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


@pytest.mark.parametrize("count", [0, 1, 3])
def test_copy_rows_equals_reference(count):
    pairs = _pools(0, slots=6, rows=5)
    expected = _copy(pairs)
    dst_rows = torch.tensor([4, 0, 2][:count], dtype=torch.long, device=DEVICE)
    src_rows = torch.tensor([3, 4, 0][:count], dtype=torch.long, device=DEVICE)
    copier = StateRowCopier()
    copier(pairs, dst_rows, src_rows)
    copy_state_rows_reference(expected, dst_rows, src_rows)
    for (pool, captured), (want, want_captured) in zip(pairs, expected):
        assert torch.equal(pool, want)
        assert torch.equal(captured, want_captured)  # sources untouched
    if count:
        assert not torch.equal(pairs[0][0], _pools(0, slots=6, rows=5)[0][0])  # the copy did something
    # the second call reuses the cached address tables and still copies into the right tensors
    again = _pools(1, slots=6, rows=5)
    again_expected = _copy(again)
    copier(again, dst_rows, src_rows)
    copy_state_rows_reference(again_expected, dst_rows, src_rows)
    assert all(torch.equal(p, w) for (p, _), (w, _) in zip(again, again_expected))


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

"""Row copies between many state tensors in one launch: `dst[dst_rows[i]] = src[src_rows[i]]`
for every (dst, src) pair of a list.

Speculative decoding commits, after each verification step that rejected a draft, the captured
state of the accepted position into the request's slot of every recurrent state pool: two pools
(conv, delta rule) per gated delta net layer, 60 for Qwen3.5-35B-A3B. As `index_select` +
`index_copy_` per pool that is 120 eager launches a step (~2.7 ms of host time and ~0.38 ms of
GPU time at batch 1 on an H200, `docs/PERFORMANCE.md`). Here the pairs are grouped by element
size and row length, and each group is one launch that reads its tensors' addresses from a
device table (`[pairs]` int64, cached per address tuple: the table holds exactly its key, so a
recycled address never makes it stale). Every row is copied bit for bit (as integers of the
element's width), so the result is the reference's exactly.

`copy_state_rows_reference` is the torch form (CPU, and pairs the kernel does not take:
differing dtypes, non-contiguous rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK = 4096  # elements a program copies (16 KB of fp32): a 2 MB delta-rule state is 128 programs
_WORD = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_TABLE_CACHE_SIZE = 16


@triton.jit
def _copy_rows_kernel(dst_table, src_table, dst_rows, src_rows, row_numel, WORD: tl.constexpr, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    copy = tl.program_id(1)
    block = tl.program_id(2)
    dst = tl.load(dst_table + pair).to(tl.pointer_type(WORD))
    src = tl.load(src_table + pair).to(tl.pointer_type(WORD))
    dst_row = tl.load(dst_rows + copy).to(tl.int64)
    src_row = tl.load(src_rows + copy).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < row_numel
    values = tl.load(src + src_row * row_numel + offsets, mask=mask)
    tl.store(dst + dst_row * row_numel + offsets, values, mask=mask)


def copy_state_rows_reference(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], dst_rows: torch.Tensor, src_rows: torch.Tensor,
) -> None:
    """`dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))` for every (dst, src) pair."""
    for dst, src in pairs:
        dst.index_copy_(0, dst_rows, src.index_select(0, src_rows).to(dst.dtype))


class StateRowCopier:
    """The Triton form, with its address tables cached (one copier per runner)."""

    def __init__(self):
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}

    def _table(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        key = tuple(t.data_ptr() for t in tensors)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) >= _TABLE_CACHE_SIZE:
                self._tables.pop(next(iter(self._tables)))
            table = torch.tensor(key, dtype=torch.int64).to(tensors[0].device)  # [pairs]
            self._tables[key] = table
        return table

    def __call__(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], dst_rows: torch.Tensor, src_rows: torch.Tensor,
    ) -> None:
        """`dst[dst_rows[i]] = src[src_rows[i]]` for every (dst, src) pair (rows of the same
        length); `dst_rows` and `src_rows` [N] int64 on the tensors' device, no destination row
        twice."""
        count = dst_rows.shape[0]
        if count == 0 or not pairs:
            return
        # Host work is most of what a commit costs at small batches: only cheap attribute reads per
        # pair (no views, no shape slices: rows are copied flat, so equal row lengths suffice), and
        # the address tables come from the cache once the tensors repeat.
        groups: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        others = []
        for dst, src in pairs:
            size = dst.element_size()
            row_numel = dst.numel() // dst.shape[0] if dst.shape[0] else -1
            if (dst.dtype == src.dtype and size in _WORD and src.shape[0]
                    and src.numel() // src.shape[0] == row_numel and dst.is_contiguous() and src.is_contiguous()):
                dsts, srcs = groups.setdefault((size, row_numel), ([], []))
                dsts.append(dst)
                srcs.append(src)
            else:
                others.append((dst, src))
        for (size, row_numel), (dsts, srcs) in groups.items():
            grid = (len(dsts), count, triton.cdiv(row_numel, BLOCK))
            _copy_rows_kernel[grid](
                self._table(dsts), self._table(srcs), dst_rows, src_rows, row_numel, WORD=_WORD[size], BLOCK=BLOCK,
            )
        if others:
            copy_state_rows_reference(others, dst_rows, src_rows)

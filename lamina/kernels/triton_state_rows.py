"""Row copies between many state tensors in one launch: `dst[dst_rows[i]] = src[src_rows[i]]`
for every (dst, src) pair of a list.

Speculative decoding commits, after each verification step that rejected a draft, the captured
state of the accepted position into the request's slot of every recurrent state pool: two pools
(conv, delta rule) per gated delta net layer, 60 for Qwen3.5-35B-A3B. As `index_select` +
`index_copy_` per pool (lamina.kernels.state_rows) that is 120 eager launches a step: 1.7 ms
from the host's start to the device's end at batch 1 on an H200, 0.31 ms here
(`docs/PERFORMANCE.md`, session 18). The pairs are grouped by element size and row length, and
each group is one launch that reads its tensors' addresses from a device table (`[pairs]` int64,
cached per address tuple, least recently used out: a table holds exactly its key, so a recycled
address never makes it stale). Rows are copied as flat runs of integers of the element's width,
bit for bit, so the result is the reference's exactly.

Pairs the kernel does not take go through the reference: differing dtypes or row lengths,
non-contiguous tensors, and every pair when a tensor is both a destination and a source (the
reference copies pair by pair through a temporary; one launch would race).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from lamina.kernels.state_rows import copy_state_rows_reference

BLOCK = 4096  # elements a program copies (16 KB of fp32): a 2 MB delta-rule state is 128 programs
_WORD = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
TABLE_CACHE_SIZE = 16


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


class StateRowCopier:
    """The Triton form, with its address tables cached (one copier per runner)."""

    def __init__(self):
        self._tables: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()

    def _table(self, key: tuple[int, ...], device: torch.device) -> torch.Tensor:
        table = self._tables.get(key)
        if table is not None:
            self._tables.move_to_end(key)
            return table
        if len(self._tables) >= TABLE_CACHE_SIZE:
            self._tables.popitem(last=False)
        host = torch.tensor(key, dtype=torch.int64, pin_memory=device.type == "cuda")  # [pairs]
        table = host.to(device, non_blocking=True)  # no stall: the pinned copy lives until it is done
        self._tables[key] = table
        return table

    def __call__(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], dst_rows: torch.Tensor, src_rows: torch.Tensor,
    ) -> None:
        """`dst[dst_rows[i]] = src[src_rows[i]]` for every (dst, src) pair; `dst_rows` and
        `src_rows` [N] int64 on the tensors' device, in range, no destination row twice. The
        kernel copies a row as a flat run of its elements: pairs of one row length and dtype,
        contiguous, take it whatever their trailing shapes."""
        count = dst_rows.shape[0]
        if src_rows.shape[0] != count:
            raise ValueError(f"copy_state_rows: {count} destination rows but {src_rows.shape[0]} source rows")
        if count == 0 or not pairs:
            return
        # Host work is most of what a commit costs at small batches: only cheap attribute reads per
        # pair (no views, no shape slices), and the address tables come from the cache once the
        # tensors repeat (always under the verification graphs' persistent capture rows).
        groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        others = []
        for dst, src in pairs:
            size = dst.element_size()
            row_numel = dst.numel() // dst.shape[0] if dst.shape[0] else -1
            if (dst.dtype == src.dtype and size in _WORD and src.shape[0]
                    and src.numel() // src.shape[0] == row_numel and dst.is_contiguous() and src.is_contiguous()):
                dsts, srcs = groups.setdefault((size, row_numel), ([], []))
                dsts.append(dst.data_ptr())
                srcs.append(src.data_ptr())
            else:
                others.append((dst, src))
        written = {p for dsts, _ in groups.values() for p in dsts} | {d.data_ptr() for d, _ in others}
        read = {p for _, srcs in groups.values() for p in srcs} | {s.data_ptr() for _, s in others}
        if written & read:  # a tensor both written and read: the reference's order, pair by pair
            copy_state_rows_reference(pairs, dst_rows, src_rows)
            return
        device = dst_rows.device
        for (size, row_numel), (dsts, srcs) in groups.items():
            grid = (len(dsts), count, triton.cdiv(row_numel, BLOCK))
            _copy_rows_kernel[grid](
                self._table(tuple(dsts), device), self._table(tuple(srcs), device), dst_rows, src_rows, row_numel,
                WORD=_WORD[size], BLOCK=BLOCK,
            )
        if others:
            copy_state_rows_reference(others, dst_rows, src_rows)

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
address never makes it stale), and the grouping itself is cached per pair list (weak references
to the tensors; under the verification graphs every commit has the same pairs). Rows are copied
as flat runs of integers of the element's width, bit for bit, so the result is the reference's
exactly.

Pairs the kernel does not take go through the reference: differing dtypes or row lengths,
non-contiguous tensors, and every pair when a tensor is both a destination and a source (the
reference copies pair by pair through a temporary; one launch would race).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.state_rows import copy_state_rows_reference

BLOCK = 4096  # elements a program copies (16 KB of fp32): a 2 MB delta-rule state is 128 programs
_WORD = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
TABLE_CACHE_SIZE = 16
PLAN_CACHE_SIZE = 8


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
    mask = offsets < tl.where(src_row >= 0, row_numel, 0)  # a negative source row: nothing to copy
    values = tl.load(src + src_row * row_numel + offsets, mask=mask)
    tl.store(dst + dst_row * row_numel + offsets, values, mask=mask)


class StateRowCopier:
    """The Triton form, with its address tables cached (one copier per runner)."""

    def __init__(self):
        self._tables: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._plans: OrderedDict[tuple[int, ...], tuple[list[weakref.ref], _Plan]] = OrderedDict()

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

    def _plan(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> _Plan:
        """How `pairs` copy: cached per pair list (the same tensors at the same addresses), so a
        commit under the verification graphs' persistent capture rows (every step the same
        pools and rows) skips the per-pair checks: ~120 us of host time for 60 pools. The
        cache keeps weak references only: a captured row tensor of an eager step is not kept
        alive by it, and an entry whose tensors died (a new tensor may take the old id) misses.
        A hit needs the same live tensor objects at the same addresses; what it cannot see is an
        in-place change of a tensor's metadata (`resize_`, `as_strided_`, `.data =`), which
        state pools and capture rows never get."""
        key = tuple(x for dst, src in pairs for x in (id(dst), dst.data_ptr(), id(src), src.data_ptr()))
        entry = self._plans.get(key)
        if entry is not None and all(ref() is t for ref, t in zip(entry[0], (t for pair in pairs for t in pair))):
            self._plans.move_to_end(key)
            return entry[1]
        plan = _group(pairs)
        self._plans.pop(key, None)  # an entry of dead tensors whose ids and addresses came back
        if len(self._plans) >= PLAN_CACHE_SIZE:
            self._plans.popitem(last=False)
        self._plans[key] = ([weakref.ref(t) for pair in pairs for t in pair], plan)
        return plan

    def __call__(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], dst_rows: torch.Tensor, src_rows: torch.Tensor,
        *, skip_negative: bool = False,
    ) -> None:
        """`dst[dst_rows[i]] = src[src_rows[i]]` for every (dst, src) pair; `dst_rows` and
        `src_rows` [N] int64 on the tensors' device, in range (with `skip_negative`, a negative
        source row copies nothing), no destination row twice. The kernel copies a row as a flat
        run of its elements: pairs of one row length and dtype, contiguous, take it whatever
        their trailing shapes (and always skips negative source rows)."""
        count = dst_rows.shape[0]
        if src_rows.shape[0] != count:
            raise ValueError(f"copy_state_rows: {count} destination rows but {src_rows.shape[0]} source rows")
        if count == 0 or not pairs:
            return
        plan = self._plan(pairs)
        if plan.overlapping:  # a tensor both written and read: the reference's order, pair by pair
            copy_state_rows_reference(pairs, dst_rows, src_rows, skip_negative=skip_negative)
            return
        device = dst_rows.device
        for (size, row_numel), (dsts, srcs) in plan.groups.items():
            grid = (len(dsts), count, triton.cdiv(row_numel, BLOCK))
            _copy_rows_kernel[grid](
                self._table(dsts, device), self._table(srcs, device), dst_rows, src_rows, row_numel,
                WORD=_WORD[size], BLOCK=BLOCK, **FP_FUSION,
            )
        if plan.others:
            copy_state_rows_reference([pairs[i] for i in plan.others], dst_rows, src_rows, skip_negative=skip_negative)


@dataclass(frozen=True)
class _Plan:
    groups: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]]  # (size, row numel) -> addresses
    others: tuple[int, ...]  # indices of the pairs the reference copies
    overlapping: bool  # some tensor both written and read


def _group(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> _Plan:
    """Pairs by (element size, row length) when the kernel takes them: same dtype, contiguous."""
    groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    others = []
    for i, (dst, src) in enumerate(pairs):
        size = dst.element_size()
        row_numel = dst.numel() // dst.shape[0] if dst.shape[0] else -1
        if (dst.dtype == src.dtype and size in _WORD and src.shape[0]
                and src.numel() // src.shape[0] == row_numel and dst.is_contiguous() and src.is_contiguous()):
            dsts, srcs = groups.setdefault((size, row_numel), ([], []))
            dsts.append(dst.data_ptr())
            srcs.append(src.data_ptr())
        else:
            others.append(i)
    written = {p for dsts, _ in groups.values() for p in dsts} | {pairs[i][0].data_ptr() for i in others}
    read = {p for _, srcs in groups.values() for p in srcs} | {pairs[i][1].data_ptr() for i in others}
    return _Plan({k: (tuple(d), tuple(s)) for k, (d, s) in groups.items()}, tuple(others), bool(written & read))

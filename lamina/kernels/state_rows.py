"""Row copies between state tensors, the torch form: `dst[dst_rows[i]] = src[src_rows[i]]` for
every (dst, src) pair of a list (speculative decoding's commit of the accepted position's states,
lamina.layers.metadata.StateCapture). Imports no Triton: MTP on the reference kernels needs none.
The Triton form, one launch per group of like pairs, is lamina.kernels.triton_state_rows."""

from __future__ import annotations

import torch


def copy_state_rows_reference(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], dst_rows: torch.Tensor, src_rows: torch.Tensor,
    *, skip_negative: bool = False,
) -> None:
    """`dst.index_copy_(0, dst_rows, src.index_select(0, src_rows).to(dst.dtype))` for every
    (dst, src) pair, in order. With `skip_negative` a destination row whose source row is
    negative keeps its value (it is rewritten with itself: no host sync to drop it)."""
    keep = src_rows < 0 if skip_negative else None  # [N]
    for dst, src in pairs:
        rows = src.index_select(0, src_rows.clamp(min=0) if skip_negative else src_rows).to(dst.dtype)  # [N, ...]
        if keep is not None:
            rows = torch.where(keep.view(-1, *[1] * (rows.dim() - 1)), dst.index_select(0, dst_rows), rows)
        dst.index_copy_(0, dst_rows, rows)

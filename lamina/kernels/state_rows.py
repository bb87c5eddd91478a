"""Row copies between state tensors, the torch form: `dst[dst_rows[i]] = src[src_rows[i]]` for
every (dst, src) pair of a list (speculative decoding's commit of the accepted position's states,
lamina.layers.metadata.StateCapture). Imports no Triton: MTP on the reference kernels needs none.
The Triton form, one launch per group of like pairs, is lamina.kernels.triton_state_rows."""

from __future__ import annotations

import torch


def copy_state_rows_reference(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], dst_rows: torch.Tensor, src_rows: torch.Tensor,
) -> None:
    """`dst.index_copy_(0, dst_rows, src.index_select(0, src_rows).to(dst.dtype))` for every
    (dst, src) pair, in order."""
    for dst, src in pairs:
        dst.index_copy_(0, dst_rows, src.index_select(0, src_rows).to(dst.dtype))

"""The sampler's top-k, top-p and min-p filters (functional, usable on their own).

`apply_top_k_top_p` is the reference: it sorts the whole vocabulary and keeps, per row, the k
likeliest tokens, then the smallest prefix of them that reaches top_p of the renormalised mass,
with every token tied with the last one kept (a threshold on the logits). The sampler takes
`filter_top_k_top_p`, which computes the same kept set per row: rows whose top-k is at most
TOP_K_WINDOW from a `topk` of that fixed width (`window_cut`, or its one-launch Triton form); rows
with a wider top-k or none (top-p alone) from the sort (`sorted_cut`), or on the Triton kernels
with `LAMINA_NUCLEUS_CUT=1` from the same window and searches over the row's logits
(`lamina.kernels.triton_window_cut.nucleus_cut_triton`). Which way a row goes follows its own
options only, never its batch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lamina.worker.sampler import SamplingBatch

__all__ = ["TOP_K_WINDOW", "apply_top_k_top_p", "sorted_cut", "window_cut", "filter_top_k_top_p", "apply_min_p"]

# Rows whose top-k is at most this take the top-k of this fixed width instead of sorting the
# vocabulary (`window_cut`); a fixed width, so that a row's arithmetic never depends on its batch.
TOP_K_WINDOW = 128


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to ``-inf``, sorting the whole vocabulary
    (the reference; the sampler takes `filter_top_k_top_p`, which computes the same set).

    Args:
        logits: ``[B, V]`` float logits (already temperature-scaled).
        top_k: ``[B]`` int64; values ``>= V`` mean disabled. ``None`` skips.
        top_p: ``[B]`` float in (0, 1]; ``1`` means disabled. ``None`` skips.

    Top-k keeps the ``k`` likeliest tokens and every token tied with the
    k-th (as vLLM and transformers do).  Top-p is applied after top-k, on the
    renormalised distribution, and keeps the smallest prefix of the sorted
    tokens whose cumulative probability reaches ``top_p`` (the most likely
    token always), again with every token tied with the last one kept.  So
    the kept set is a threshold on the logits, whatever order the sort gave
    tied tokens in (a sort's tie order may differ between devices and batch
    shapes).  Returns a new tensor.
    """
    if top_k is None and top_p is None:
        return logits
    return logits.masked_fill(logits < sorted_cut(logits, top_k, top_p), float("-inf"))  # [B, V]


def sorted_cut(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Each row's lowest kept logit `[B, 1]` under top-k then top-p (`apply_top_k_top_p`), from
    the whole vocabulary sorted."""
    vocab = logits.shape[1]
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [B, V]
    cut = sorted_logits[:, :1]  # [B, 1]: the lowest logit kept so far (the top one is always kept)
    if top_k is not None:
        k = top_k.clamp(min=1, max=vocab).unsqueeze(1)  # [B, 1]
        cut = sorted_logits.gather(1, k - 1)  # [B, 1]: the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cut, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)  # [B, V]
        # Probability mass strictly before each position; a position is kept
        # while the mass before it is still short of top_p. In float64: a CUDA
        # scan's order follows the number of rows (CUB for one row, tiles sized
        # by the row count for more), so a float32 sum could flip a near-tie with
        # the batch; in float64 only a tie within ~1e-16 of top_p could. (One float64
        # [B, V], the bytes of the float32 sum and difference it replaces.)
        mass_before = probs.cumsum(dim=-1, dtype=torch.float64).sub_(probs)  # [B, V]
        keep = mass_before < top_p.double().unsqueeze(1)  # [B, V]
        keep |= (top_p >= 1.0).unsqueeze(1)  # rows with top_p == 1 keep everything
        keep[:, 0] = True  # the most likely token always survives
        last = keep.sum(dim=-1, keepdim=True) - 1  # [B, 1]: the last kept position
        cut_p = sorted_logits.gather(1, last)  # [B, 1]
        cut = cut_p if top_k is None else torch.maximum(cut, cut_p)
    return cut


def window_cut(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int = TOP_K_WINDOW) -> torch.Tensor:
    """`sorted_cut` for rows whose `top_k` is at most `width`, from their `width` likeliest logits
    (`topk`, no sort of the vocabulary): the same kept set. Tokens tied with the k-th logit beyond
    the window still count in top-p's normaliser (the threshold keeps them), by their number.
    logits `[B, V]`, top_k `[B]` int64 in [1, width], top_p `[B]` (1: no top-p). Returns `[B, 1]`."""
    width = min(width, logits.shape[1])
    values = logits.topk(width, dim=-1).values  # [B, W], best first
    k = top_k.clamp(min=1, max=width).unsqueeze(1)  # [B, 1]
    cut = values.gather(1, k - 1)  # [B, 1]: the k-th largest
    kept = values.masked_fill(values < cut, float("-inf"))  # [B, W]
    # ties with the k-th logit outside the window: in the kept set, at the end of the sorted order
    beyond = (logits == cut).sum(dim=1, keepdim=True) - (values == cut).sum(dim=1, keepdim=True)  # [B, 1]
    top = values[:, :1]  # [B, 1]
    weights = (kept - top).exp()  # [B, W]
    # running sums in an order that is each row's own: a scan along the outer dimension (one
    # sequential pass per column); along the inner one, a CUDA scan's order follows the number of rows
    running = weights.t().contiguous().cumsum(dim=0).t()  # [B, W]
    total = running[:, -1:] + beyond * (cut - top).exp()  # [B, 1]
    mass_before = (running - weights) / total  # [B, W]
    keep = (mass_before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)  # [B, W]
    keep[:, 0] = True  # the most likely token always survives
    last = keep.sum(dim=-1, keepdim=True) - 1  # [B, 1]: the last kept position in the window
    return torch.maximum(cut, kept.gather(1, last))  # [B, 1]


def filter_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`apply_top_k_top_p` over the batch's filtered rows, each by its own group (`window_rows`:
    `window_cut`, in one Triton launch after the `topk` when the batch's `sampler_kernels` say so
    and the vocabulary is at least the window; `wide_rows` (a top-k wider than the window, or top-p
    alone): the Triton search cut under the same conditions with `LAMINA_NUCLEUS_CUT=1`, else
    `sorted_cut`); other rows are left whole. Returns a new tensor."""
    cut = None  # [B, 1]
    window, wide = window_cut, sorted_cut
    if batch.sampler_kernels == "triton" and logits.shape[1] >= TOP_K_WINDOW and logits.dtype == torch.float32:
        from lamina.kernels.selection import nucleus_cut_enabled
        from lamina.kernels.triton_window_cut import nucleus_cut_triton, window_cut_triton

        window = functools.partial(window_cut_triton, width=TOP_K_WINDOW)
        if nucleus_cut_enabled():
            def wide(rows: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
                return nucleus_cut_triton(rows, top_p, TOP_K_WINDOW, top_k=top_k)
    groups = ((batch.window_rows, batch.window_index, window), (batch.wide_rows, batch.wide_index, wide))
    for rows, index, cut_of in groups:
        if not rows:
            continue
        if index is None:  # the whole batch
            cut = cut_of(logits, batch.top_k, batch.top_p)
        else:
            if cut is None:  # rows of neither group are left whole
                cut = torch.full((logits.shape[0], 1), float("-inf"), device=logits.device, dtype=logits.dtype)
            cut.index_copy_(0, index, cut_of(logits.index_select(0, index), batch.top_k.index_select(0, index),
                                             batch.top_p.index_select(0, index)))
    if cut is None:  # no row filters
        return logits
    return logits.masked_fill(logits < cut, float("-inf"))  # [B, V]


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero probabilities below ``min_p * max(prob)`` per row (in place).

    Args:
        probs: ``[B, V]`` probabilities (need not be normalised).
        min_p: ``[B]`` in [0, 1]; ``0`` disables the row's filter.
    """
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return probs.masked_fill_(probs < threshold, 0.0)

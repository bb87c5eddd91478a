"""The top-k / top-p cut of rows whose top-k fits a fixed window, in one launch (the torch form and
its meaning: `lamina.worker.top_k_top_p.window_cut`). The torch form is ~30 small launches after the
`topk`, which made it slower than sorting the vocabulary at batch 1 on an H100 (0.47 against 0.36
ms, benchmarks/results/sampler_window_ab_h100_s26.json); here one program per row reads its W
sorted logits and does the rest in registers: the k-th value, top-p's renormalised running mass
(a scan), its last kept position. Tokens tied with the k-th logit beyond the window count in the
normaliser; only a row whose window ends on that tie reads its whole row to count them (a branch
in the program), so the common row reads W values.

`nucleus_cut_triton` cuts rows whose top-k is wider than the window (or absent: top-p alone) from
the same window: it searches the row's logits for the k-th largest by count, reads the row for the
kept set's normaliser, and searches the top-p cut by mass when the window holds less than top-p of
it (the sort's set either way: `lamina.worker.top_k_top_p.sorted_cut`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION

BLOCK_V = 2048


@triton.jit
def _window_cut_kernel(values, logits, top_k, top_p, cut_out, vocab_size, values_stride, logits_stride,
                       W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, W)
    v = tl.load(values + row * values_stride + offs)  # [W] the row's W largest logits, best first
    k = tl.minimum(tl.maximum(tl.load(top_k + row), 1), W)
    cut = tl.load(values + row * values_stride + k - 1)  # the k-th largest
    top = tl.load(values + row * values_stride)
    kept = tl.where(v >= cut, v, float("-inf"))  # [W]
    weights = tl.exp(kept - top)  # [W]
    running = tl.cumsum(weights, 0)  # [W]
    total = tl.sum(tl.where(offs == W - 1, running, 0.0), 0)
    # ties of the k-th may run past the window (not when it is -inf: those weigh nothing)
    if (tl.load(values + row * values_stride + W - 1) == cut) & (cut > float("-inf")):
        count = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(logits + row * logits_stride + cols, mask=cols < vocab_size, other=float("-inf"))
            count += (x == cut).to(tl.int32)
        beyond = tl.sum(count, 0) - tl.sum((v == cut).to(tl.int32), 0)
        total += beyond.to(tl.float32) * tl.exp(cut - top)
    mass_before = (running - weights) / total  # [W]
    p = tl.load(top_p + row)
    threshold = tl.where(p >= 1.0, float("inf"), p)  # top-p 1 keeps every position
    keep = (mass_before < threshold) | (offs == 0)  # [W]: the most likely token always survives
    last = tl.sum(keep.to(tl.int32), 0) - 1
    cut_p = tl.load(values + row * values_stride + last)
    cut_p = tl.where(cut_p >= cut, cut_p, float("-inf"))  # a position past the top-k holds -inf
    tl.store(cut_out + row, tl.maximum(cut, cut_p))


def _window(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked inputs of a cut kernel: each row's `width` largest logits `[B, W]` (best first;
    W = width, at most the vocabulary) and the output `[B, 1]`."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [B, V] with unit column stride, got {logits.dtype} "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    width = min(width, logits.shape[1])
    if width & (width - 1):
        raise ValueError(f"the window must be a power of two no wider than the vocabulary, got {width} "
                         f"(vocab {logits.shape[1]})")
    values = logits.topk(width, dim=-1).values  # [B, W], best first
    return values, torch.empty(logits.shape[0], 1, dtype=logits.dtype, device=logits.device)


def window_cut_triton(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int) -> torch.Tensor:
    """`lamina.worker.top_k_top_p.window_cut` in one launch after the `topk`: logits `[B, V]` float32
    (unit column stride), top_k `[B]` int64, top_p `[B]` float32; returns the cut `[B, 1]`."""
    values, cut = _window(logits, width)  # [B, W] best first, [B, 1]
    num_rows, vocab = logits.shape
    if num_rows:
        _window_cut_kernel[(num_rows,)](values, logits, top_k.contiguous(), top_p.contiguous(), cut, vocab,
                                        values.stride(0), logits.stride(0), W=values.shape[1], BLOCK=BLOCK_V,
                                        **FP_FUSION)
    return cut


# ---- top-k wider than the window, top-p alone: the search cut ------------------------------------


_BELOW_EVERY_KEY = tl.constexpr(-2139095042)  # one below `_float_key` of -inf
NUCLEUS_SECTIONS = 8  # points a step of the search tries (nucleus_cut_triton)


@triton.jit
def _float_key(x):
    """An int64 that orders as the float32 `x` does (-inf lowest; -0.0 is +0.0's key, as they compare
    equal)."""
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _key_value(key):
    """The float32 whose `_float_key` is `key`."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mass_above(logits_row, vocab_size, top, floor, BLOCK: tl.constexpr):
    """The unnormalised mass (exp(logit - top)) of the row's logits whose key is above `floor`, block
    by block in a fixed order (`_BELOW_EVERY_KEY`: the whole row's normaliser)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits_row + cols, mask=cols < vocab_size, other=float("-inf"))
        acc += tl.where(_float_key(x) > floor, tl.exp(x - top), 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _above_each(logits_row, vocab_size, top, floors, COUNT: tl.constexpr, SECTIONS: tl.constexpr,
                BLOCK: tl.constexpr):
    """`[SECTIONS]`: how many of the row's logits (COUNT) or how much of its unnormalised mass lies
    above each of `floors` (float keys), in one read of the row, block by block in a fixed order."""
    if COUNT:
        acc = tl.zeros([SECTIONS, BLOCK], dtype=tl.int32)
    else:
        acc = tl.zeros([SECTIONS, BLOCK], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits_row + cols, mask=cols < vocab_size, other=float("-inf"))
        above = (_float_key(x)[None, :] > floors[:, None]) & (cols < vocab_size)[None, :]  # [S, BLOCK]
        if COUNT:
            acc += above.to(tl.int32)
        else:
            acc += tl.where(above, tl.exp(x - top)[None, :], 0.0)
    return tl.sum(acc, 1)


@triton.jit
def _search_key(logits_row, vocab_size, top, total, target, lo, hi, COUNT: tl.constexpr,
                SECTIONS: tl.constexpr, BLOCK: tl.constexpr):
    """The lowest float key `hi` above which the row holds less than `target`: fewer logits (COUNT;
    then `hi` is the target-th largest logit's key) or less than `target` of the mass over `total`
    (then `hi` is the lowest logit top-p keeps). Starts from `lo`, above which the row holds at least
    the target, and `hi`, above which it holds less; each read of the row splits [lo, hi] at SECTIONS
    points (1: a bisection)."""
    sections = tl.arange(0, SECTIONS).to(tl.int64)
    while hi - lo > 1:
        floors = lo + ((hi - lo) * (sections + 1)) // (SECTIONS + 1)  # [S] ascending, in [lo, hi]
        inside = (floors > lo) & (floors < hi)  # [S] at least one while hi - lo > 1
        if COUNT:
            reach = _above_each(logits_row, vocab_size, top, floors, True, SECTIONS, BLOCK) >= target  # [S]
        else:
            reach = _above_each(logits_row, vocab_size, top, floors, False, SECTIONS, BLOCK) / total >= target
        # what lies above a floor falls as the floor rises: the floors that still reach it come first
        lo = tl.max(tl.where(inside & reach, floors, lo), 0)
        hi = tl.min(tl.where(inside & ~reach, floors, hi), 0)
    return hi


@triton.jit
def _search_cut_kernel(values, logits, top_k, top_p, cut_out, vocab_size, values_stride, logits_stride,
                       W: tl.constexpr, BLOCK: tl.constexpr, SECTIONS: tl.constexpr, HAS_TOP_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, W)
    logits_row = logits + row * logits_stride
    v = tl.load(values + row * values_stride + offs)  # [W] the row's W largest logits, best first
    top = tl.load(values + row * values_stride)
    window_last = _float_key(tl.load(values + row * values_stride + W - 1))
    p = tl.load(top_p + row)
    # top-k: keys above `floor` (the k-th largest logit's key less one) are kept; the k-th lies past
    # the window (k > W), so above the window's last logit fewer than k lie, above every key all V
    floor = tl.full([], _BELOW_EVERY_KEY, tl.int64)
    if HAS_TOP_K:
        k = tl.load(top_k + row)
        if k < vocab_size:
            floor = _search_key(logits_row, vocab_size, top, 1.0, k, floor, window_last, True, SECTIONS, BLOCK) - 1
    if p >= 1.0:  # no top-p: the top-k's cut
        cut = _key_value(floor + 1)
    else:
        total = _mass_above(logits_row, vocab_size, top, floor, BLOCK)  # the kept set's normaliser
        weights = tl.exp(v - top)  # [W] all in the top-k
        running = tl.cumsum(weights, 0)  # [W]
        window_mass = tl.sum(tl.where(offs == W - 1, running, 0.0), 0) / total
        if window_mass >= p:  # the first position past the window is cut: the last kept one is in it
            keep = ((running - weights) / total < p) | (offs == 0)  # [W]
            cut = tl.load(values + row * values_stride + tl.sum(keep.to(tl.int32), 0) - 1)
        else:
            # the lowest kept logit has less than p of the mass strictly above it: above `floor` lies
            # all of it, above the window's last logit less than the window's mass
            cut = _key_value(_search_key(logits_row, vocab_size, top, total, p, floor, window_last, False,
                                         SECTIONS, BLOCK))
    tl.store(cut_out + row, cut)


def nucleus_cut_triton(logits: torch.Tensor, top_p: torch.Tensor, width: int, top_k: torch.Tensor | None = None,
                       block: int = BLOCK_V, sections: int = NUCLEUS_SECTIONS,
                       num_warps: int | None = None) -> torch.Tensor:
    """`lamina.worker.top_k_top_p.sorted_cut` for rows whose top-k is wider than `width` (or absent:
    top-p alone), without sorting the vocabulary: logits `[B, V]` float32 (unit column stride),
    top_p `[B]` float32 in (0, 1] (1: none), top_k `[B]` int64 in (width, V] or None (the whole
    vocabulary); returns the cut `[B, 1]`. A row reads its `width` largest logits (`topk`); with a
    top-k below V it searches the k-th largest logit by count; then it reads the row once for the
    normaliser of the kept set, and when the window holds less than top_p of that mass it searches
    the cut among the row's logits by mass. A search reads the row once per step (`sections` points a
    step, a power of two: about 32 / log2(sections + 1) steps; 1 is a bisection), in that row's
    program only: which way a row goes follows its own logits and options, never its batch. `block`
    (logits a loop step reads), `sections` and `num_warps`: for benchmarks."""
    if sections < 1 or sections & (sections - 1):
        raise ValueError(f"nucleus_cut_triton: sections = {sections} must be a power of two")
    values, cut = _window(logits, width)  # [B, W] best first, [B, 1]
    num_rows, vocab = logits.shape
    if num_rows:
        top_p = top_p.contiguous()
        _search_cut_kernel[(num_rows,)](values, logits, top_p if top_k is None else top_k.contiguous(), top_p, cut,
                                        vocab, values.stride(0), logits.stride(0), W=values.shape[1], BLOCK=block,
                                        SECTIONS=sections, HAS_TOP_K=top_k is not None, **FP_FUSION,
                                        **({} if num_warps is None else {"num_warps": num_warps}))
    return cut

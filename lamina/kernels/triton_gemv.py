"""`y = x @ W^T` for a few rows of x (decode), in one launch.

Two kernels. For one and two rows (`LAMINA_GEMV_FMA=1`, the default:
`lamina.kernels.selection.gemv_fma`) `_gemv_fma_kernel`: no `tl.dot`, one program per 1-4 output
features over the whole input, its plain [BLOCK_N, BLOCK_K] weight loads unrolled (all in flight
at once, the first read before the PDL wait) and multiplied elementwise in float32 with each row,
each feature summed once at the end: 264-3,088 programs on the Qwen3.5-35B-A3B linears, no split,
no ticket. On an H200 it streams the decode linears faster than the split-K kernel below, whose
16-row `tl.dot` tiles need 16+ features a program and so a split-K and its ticket tail on the
narrow weights (bench_stream_rows_fma_h200.json: out_proj 5.4 against 7.9 us, router 1.7 against
2.9; batch-1 decode 2.455 against 2.668 ms). Each weight load serves every row (one accumulator of
the same layout per row), but every program reads the whole input rows, so from three rows on the
split-K kernel, whose 16-row dot takes them for free, is faster (`gemv_config`).

The split-K kernel (three and four rows, `LAMINA_GEMV_FMA=0`, and `gemv_route`'s): cuBLAS runs a
batch-1 GEMV of a 2048 x 4096 bf16 weight (the delta net's out_proj, the attention o_proj) as a
split-K GEMM plus a separate reduction kernel at about half the copy bandwidth (FIELD_NOTES.md).
Here one program per (tile of BLOCK_N output features, split of the input
features) steps through its [BLOCK_N, K / SPLIT] weight block BLOCK_K columns at a time, the loads
pipelined (num_stages) behind a 16-row `tl.dot` that holds the (at most GEMV_MAX_ROWS) input rows;
with SPLIT > 1 the partials are summed in split order by the last program of a tile (an atomic
ticket, reset after, as the MoE down GEMV does): one launch, deterministic, and the sum of a row
never depends on the other rows. The linear layers on the Triton kernel set take one of the two
for up to `GEMV_MAX_ROWS` rows (lamina.layers.linear).

`gemv_route` is the MoE router's GEMV with the routing as its epilogue: the program that writes
the last tile of the logits (a second ticket, over the tiles) routes every row (softmax, top-k,
renormalisation: `triton_moe.softmax_topk`), one launch where the decode step had two. Opt-in
(`LAMINA_GEMV_ROUTE=1`, `lamina.kernels.selection.gemv_route_enabled`): slower on an H200.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.pdl import pdl_kwargs, wait_for_producer
from lamina.kernels.selection import gemv_fma, triton_interpreted
from lamina.kernels.triton_moe import softmax_topk

__all__ = ["GEMV_MAX_ROWS", "gemv", "gemv_config", "gemv_route"]

GEMV_MAX_ROWS = 4


@triton.jit
def _gemv_splitk_kernel(x_ptr, w_ptr, y_ptr, partial_ptr, ticket_ptr, rows, out_features, in_features,
                        stride_xm, stride_wn, stride_ym, k_steps,
                        route_weights_ptr, route_ids_ptr, route_ticket_ptr, num_experts,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                        PDL: tl.constexpr, ROUTE: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                        E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < out_features
    offs_m = tl.arange(0, 16)  # the input rows sit in the first rows of a 16-row tl.dot tile
    m_ok = offs_m < rows
    offs_k = tl.arange(0, BLOCK_K)
    k_first = split * k_steps * BLOCK_K
    # The first weight block is read before the wait for the producer of x (lamina.kernels.pdl):
    # weights are no kernel's output. Peeled from the loop, same sums in the same order.
    k = k_first + offs_k
    k_ok = k < in_features
    w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [K, N]
    wait_for_producer(PDL)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [16, K]
    acc = tl.dot(x, w, tl.zeros([16, BLOCK_N], tl.float32), input_precision=PRECISION)
    for step in range(1, k_steps):
        k = k_first + step * BLOCK_K + offs_k
        k_ok = k < in_features
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [16, K]
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # [K, N]
        acc += tl.dot(x, w, input_precision=PRECISION)
    if SPLIT == 1:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
        if ROUTE:
            _route_epilogue(y_ptr, route_weights_ptr, route_ids_ptr, route_ticket_ptr, rows, num_experts, stride_ym,
                            TOP_K, K_PAD, E_PAD, RENORMALIZE)
    else:
        # partials [SPLIT, 16, N_total]: this program's block, then the ticket of its tile.
        part_base = partial_ptr + split * 16 * out_features
        tl.store(part_base + offs_m[:, None] * out_features + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        done = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")  # release ours, acquire the others'
        if done == SPLIT - 1:
            total = tl.zeros([16, BLOCK_N], tl.float32)
            for j in range(0, SPLIT):  # in split order: deterministic
                total += tl.load(partial_ptr + j * 16 * out_features + offs_m[:, None] * out_features + offs_n[None, :],
                                 mask=m_ok[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], total.to(y_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])
            tl.atomic_xchg(ticket_ptr + tile, 0)  # ready for the next call (and the next graph replay)
            if ROUTE:
                _route_epilogue(y_ptr, route_weights_ptr, route_ids_ptr, route_ticket_ptr, rows, num_experts,
                                stride_ym, TOP_K, K_PAD, E_PAD, RENORMALIZE)


@triton.jit
def _gemv_fma_kernel(x_ptr, w_ptr, y_ptr, out_features, in_features, stride_xm, stride_wn, stride_ym,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
                     PRELOAD: tl.constexpr, PDL: tl.constexpr):
    """`fma` configs: one program per BLOCK_N output features over the whole input (no split, no
    ticket), K_STEPS unrolled steps of plain [BLOCK_N, BLOCK_K] weight loads (K contiguous), each
    load multiplied with all ROWS (<= 4) input rows: one float32 accumulator of the same
    [BLOCK_N, BLOCK_K] layout per row, each output summed once at the end. A row's products, their
    accumulation order and its final sum are the same whatever ROWS is (batch invariance): the
    other rows only add accumulators beside it. Few features per program: many programs, each
    with its loads up front. PRELOAD: the first step's weights are read before the PDL wait
    (weights are never written by a kernel of the step)."""
    tl.static_assert(ROWS <= 4)  # GEMV_MAX_ROWS: one accumulator a row below
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < out_features
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [N, 1]
    if PRELOAD:
        w_first = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < in_features)[None, :], other=0.0)
    wait_for_producer(PDL)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # rows 1-3: unused (and compiled away) below ROWS
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for step in tl.static_range(K_STEPS):
        k = step * BLOCK_K + offs_k
        k_ok = k < in_features
        if PRELOAD and step == 0:
            w = w_first.to(tl.float32)  # [N, K]
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [N, K]
        acc0 += w * tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        if ROWS > 1:
            acc1 += w * tl.load(x_ptr + stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        if ROWS > 2:
            acc2 += w * tl.load(x_ptr + 2 * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        if ROWS > 3:
            acc3 += w * tl.load(x_ptr + 3 * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, tl.sum(acc0, axis=1).to(out_ty), mask=n_ok)
    if ROWS > 1:
        tl.store(y_ptr + stride_ym + offs_n, tl.sum(acc1, axis=1).to(out_ty), mask=n_ok)
    if ROWS > 2:
        tl.store(y_ptr + 2 * stride_ym + offs_n, tl.sum(acc2, axis=1).to(out_ty), mask=n_ok)
    if ROWS > 3:
        tl.store(y_ptr + 3 * stride_ym + offs_n, tl.sum(acc3, axis=1).to(out_ty), mask=n_ok)


@triton.jit
def _route_epilogue(y_ptr, weights_ptr, ids_ptr, ticket_ptr, rows, num_experts, stride_ym,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Run by the program that wrote a tile of y: the one that finishes the last tile (an atomic
    ticket over the tiles, reset after) reads the rows' expert logits back and routes them
    (`softmax_topk`, what `route_softmax_topk` computes from the same rounded logits)."""
    tl.debug_barrier()  # every thread's part of the tile is stored before the ticket releases it
    done = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        experts = tl.arange(0, E_PAD)
        ok = experts < num_experts
        slots = tl.arange(0, K_PAD)
        for m in range(0, rows):
            logits = tl.load(y_ptr + m * stride_ym + experts, mask=ok, other=float("-inf"),
                             cache_modifier=".cg").to(tl.float32)
            top_p, top_i = softmax_topk(logits, experts, ok, TOP_K, K_PAD, E_PAD, RENORMALIZE)
            tl.store(weights_ptr + m * TOP_K + slots, top_p.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
            tl.store(ids_ptr + m * TOP_K + slots, top_i.to(tl.int64), mask=slots < TOP_K)
        tl.atomic_xchg(ticket_ptr, 0)  # ready for the next call (and the next graph replay)


# Tile sizes by weight shape, chosen by benchmarks/tune_gemv.py (--only linear) on an H200, L2-cold,
# one row (benchmarks/results/tune_gemv_linear_h200.json; copy 4.24 TB/s):
#   block_n x block_k: the weight block of one pipelined step; split: programs per output tile
#   along the input features (their partials summed by the tile's last program).
# - wide outputs (the delta-net in_proj 12352 x 2048, attention qkv 9216 x 2048): one program per
#   tile, 14.3 / 12.1 us against cuBLAS's 16.1 / 11.8;
# - long inputs (out_proj / o_proj 2048 x 4096): split 4, 8.2 us against cuBLAS's split-K GEMM +
#   reduction at 10.0;
# - small outputs (the router + shared-expert gate, 264 x 2048): narrow tiles, split 8, 3.5 us
#   against 4.9.
GEMV_CONFIG_WIDE = dict(block_n=32, block_k=128, split=1, warps=4, stages=4)
GEMV_CONFIG = dict(block_n=32, block_k=128, split=4, warps=4, stages=4)
GEMV_CONFIG_SMALL = dict(block_n=16, block_k=256, split=8, warps=4, stages=3)


# fma = 1: `_gemv_fma_kernel` (no tl.dot, no split); block_n / block_k / warps are its tiles, chosen
# by benchmarks/bench_stream_rows.py on an H200 (graphs of 40 distinct weights, L2-cold, one row;
# bench_stream_rows_fma_h200.json), us per call against the split-K kernel's tiles above:
#   in_proj 12352 x 2048: 13.55 (4 features a program) against 14.37;
#   out_proj / o_proj 2048 x 4096: 5.41 (1 feature a program) against 7.93;
#   router 264 x 2048: 1.65 (1 feature a program) against 2.90.
# preload: the first step's weights (and every step then that wide) are read before the PDL wait.
# Batch-1 / 2 / 4 decode (latency_gemv_rows_session15_h200.json, ms a step): split-K 2.668 / 3.313 /
# 4.327; FMA without preload 2.467 / 3.353 / 4.752, preloading 512 2.455 / 3.394 / 4.881, 2,048
# 2.476 / 3.255 / 4.580. So the wide weights (4,096+ rows) and out_proj take the FMA kernel for
# one and two rows and the split-K kernel for three and four (`gemv_config`); LAMINA_GEMV_FMA=0
# (`selection.gemv_fma`) takes the split-K kernel for every row count. Per weight at 1-4 rows
# (bench_gemv_rows{,12}_session16_h200.json, us a call):
#   router 264 x 2048: 1.52 / 1.92 / 3.19 / 3.22 (FMA at 1-2 rows, split-K at 3-4) against 1.28 /
#   1.60 / 1.76 / 1.92 with one FMA tile at every row count (1 feature, 8 warps, preload 2,048),
#   taken (GEMV_CONFIG_FMA_SMALL): the router's logits, which pick the experts, now round the
#   same at 1-4 rows;
#   out_proj 2048 x 4096, one row: 4.81 with 4 features preloading 2,048 against 5.20, but the
#   batch-1 step was slower with it (2.435 against 2.426 ms, latency_outproj_tile_session16_h200.json);
#   at three and four rows no FMA tile of 1-16 features beat the split-K kernel on the input
#   projections (in_proj 17.3 / 21.2 at best against 14.4 / 14.4).
GEMV_CONFIG_FMA_WIDE = dict(fma=1, block_n=4, block_k=512, warps=4, preload=512)
GEMV_CONFIG_FMA = dict(fma=1, block_n=1, block_k=512, warps=4, preload=512)
GEMV_CONFIG_FMA_SMALL = dict(fma=1, block_n=1, block_k=512, warps=8, preload=2048)
FMA_TWO_ROWS_PRELOAD = 2048
GEMV_FMA_MAX_ROWS = 2
# Outputs up to this many features (routers of up to ~1,000 experts with the shared-expert gate)
# take GEMV_CONFIG_FMA_SMALL at every row count.
FMA_SMALL_MAX_OUT = 1024
# The FMA kernel unrolls its input steps (512 or `preload` columns each); longer inputs take the
# split-K kernel.
FMA_MAX_IN_FEATURES = 16384
# Features a program of the default FMA tiles under Triton's interpreter (CI): see `_gemv`.
INTERPRETER_FMA_BLOCK_N = 32


def gemv_config(out_features: int, in_features: int, rows: int = 1) -> dict:
    """The tuned tiles for a weight of this shape at this many input rows (host ints, fixed per
    captured batch size), with `gemv_fma` on and inputs up to FMA_MAX_IN_FEATURES: the FMA
    kernel's for small outputs (up to FMA_SMALL_MAX_OUT, the router: one tile at every row count)
    and, for the others, up to GEMV_FMA_MAX_ROWS rows; the split-K kernel's otherwise. Each kernel
    sums a row the same way whatever the other rows; a request's bf16 rounding follows its step's
    row count only through this choice, as it does at the switch to cuBLAS beyond GEMV_MAX_ROWS
    (ARCHITECTURE.md, "Batch invariance")."""
    if gemv_fma() and in_features <= FMA_MAX_IN_FEATURES:
        if out_features <= FMA_SMALL_MAX_OUT:
            return GEMV_CONFIG_FMA_SMALL
        if rows <= GEMV_FMA_MAX_ROWS:
            return _fma_config(out_features, rows)
    return _dot_config(out_features)


def _fma_config(out_features: int, rows: int = 1) -> dict:
    if out_features <= FMA_SMALL_MAX_OUT:
        return GEMV_CONFIG_FMA_SMALL
    cfg = GEMV_CONFIG_FMA_WIDE if out_features >= 4096 else GEMV_CONFIG_FMA
    return cfg if rows <= 1 else dict(cfg, preload=FMA_TWO_ROWS_PRELOAD)


def _dot_config(out_features: int) -> dict:
    if out_features >= 4096:
        return GEMV_CONFIG_WIDE
    if out_features <= 512:
        return GEMV_CONFIG_SMALL
    return GEMV_CONFIG


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x `[M, K]` (M <= GEMV_MAX_ROWS), weight `[N, K]` with contiguous rows -> `[M, N]` in x's dtype."""
    return _gemv(x, weight, config, None)[0]


def gemv_route(x: torch.Tensor, weight: torch.Tensor, num_experts: int, top_k: int, renormalize: bool,
               config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router GEMV and the routing in one launch: logits = `gemv(x, weight)` `[M, N]` (the
    first `num_experts` columns the experts', any after them other gate rows), then
    `route_softmax_topk(logits[:, :num_experts], top_k, renormalize, x.dtype)` done by the program
    that finishes the last tile. Returns (logits, weights `[M, k]` x's dtype, ids `[M, k]` int64):
    the GEMV's logits and the routing kernel's ids; the weights too under Triton's interpreter, on a
    GPU to float32 rounding (the routing kernel sums the softmax in one warp, `ROUTE_WARPS`, this
    program in the GEMV's warps, so the sums may group differently)."""
    if not 0 < num_experts <= weight.shape[0] or not 0 < top_k <= num_experts:
        raise ValueError(f"gemv_route: top_k {top_k} of num_experts {num_experts} (weight rows {weight.shape[0]})")
    return _gemv(x, weight, config, (num_experts, top_k, renormalize))


def _gemv(x, weight, config, route):
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows, got {rows}")
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(f"gemv: x has {in_features} features, weight {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv: the weight's rows must be contiguous")
    if route and config and config.get("fma"):
        raise ValueError("gemv_route: the routing epilogue is the split-K kernel's; an fma config does not apply")
    if config:  # tuning: its `fma` (0 if absent) picks the kernel, the keys it lacks are that kernel's tiles
        cfg = dict(_fma_config(out_features) if config.get("fma") else _dot_config(out_features), **config)
    else:  # LAMINA_GEMV_FMA's kernel; the routing epilogue only exists in the split-K kernel
        cfg = dict(_dot_config(out_features) if route else gemv_config(out_features, in_features, rows))
        if cfg.get("fma") and triton_interpreted():
            # Triton's interpreter runs programs one after another: fewer, wider ones. The result is
            # the same (it sums each feature's products with NumPy whatever the tile).
            cfg["block_n"] = max(cfg["block_n"], INTERPRETER_FMA_BLOCK_N)
    if cfg.get("fma"):
        x = x if x.stride(-1) == 1 else x.contiguous()
        y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)  # [M, N]
        if rows:
            preload = cfg.get("preload", 0)  # 0, or the features of the first step, read before the PDL wait
            block_k = min(max(cfg["block_k"], preload), triton.next_power_of_2(in_features))
            _gemv_fma_kernel[(triton.cdiv(out_features, cfg["block_n"]),)](
                x, weight, y, out_features, in_features, x.stride(0), weight.stride(0), y.stride(0),
                ROWS=rows, BLOCK_N=cfg["block_n"], BLOCK_K=block_k, K_STEPS=triton.cdiv(in_features, block_k),
                PRELOAD=bool(preload),
                **pdl_kwargs(x.device), num_warps=cfg["warps"], **FP_FUSION)
        return y, y, y
    cfg.pop("fma", None)
    block_k = cfg["block_k"]
    k_blocks = triton.cdiv(in_features, block_k)
    split = max(1, min(cfg["split"], k_blocks))
    k_steps = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, k_steps)  # no split without a step of its own
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)  # [M, N]
    num_experts, top_k, renormalize = route or (1, 1, False)
    weights = torch.empty(rows, top_k, dtype=x.dtype, device=x.device) if route else y  # [M, k]
    ids = torch.empty(rows, top_k, dtype=torch.long, device=x.device) if route else y
    if rows == 0:
        return y, weights, ids
    tiles = triton.cdiv(out_features, cfg["block_n"])
    tickets = y  # unused without a split or a route
    if split > 1 or route:
        from lamina.kernels.triton_moe_gemv import _tickets

        tickets = _tickets(x.device, tiles + 1)  # one per tile, then the route's over the tiles
    partial = torch.empty(split, 16, out_features, dtype=torch.float32, device=x.device) if split > 1 else y  # [SPLIT, 16, N]
    _gemv_splitk_kernel[(tiles, split)](
        x, weight, y, partial, tickets, rows, out_features, in_features, x.stride(0), weight.stride(0), y.stride(0), k_steps,
        weights, ids, tickets[tiles:], num_experts,
        BLOCK_N=cfg["block_n"], BLOCK_K=block_k, SPLIT=split, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        ROUTE=route is not None, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
        **pdl_kwargs(x.device), num_warps=cfg["warps"], num_stages=cfg["stages"], **FP_FUSION,
    )
    return y, weights, ids


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) with the Triton GEMV for 2-D inputs of up to
    `GEMV_MAX_ROWS` rows (a host int fixed per captured batch size), cuBLAS beyond."""
    if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
        return gemv(x, weight)
    return torch.nn.functional.linear(x, weight)

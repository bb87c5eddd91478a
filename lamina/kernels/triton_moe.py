"""Fused routed-expert MoE in Triton: the fast path of `lamina.kernels.moe.grouped_experts`.

The (token, expert) pairs are sorted by expert on the device and each expert's pairs padded to a
multiple of BLOCK_M rows (`triton_align.align_pairs`), so every row block of the sorted list belongs to one
expert. Two grouped GEMM kernels then read each routed expert's weights once per output tile:

1. gate/up: `act[pair] = silu(x[token] @ gate_e^T) * (x[token] @ up_e^T)` (SiLU-and-mul fused);
2. down: `part[pair] = act[pair] @ down_e^T`, accumulated in float32 and stored in x's dtype (as
   the torch path's grouped GEMM rounds it),

and the slot sum adds a token's k parts times their routing weights (and the shared expert's part
times its sigmoid gate) in float32 in slot order (no atomics: deterministic; each part is rounded
to x's dtype once, the sum once). The
number of row blocks is bounded by host ints (pairs + min(pairs, experts) * (BLOCK_M - 1)), blocks
past the real ones exit at once, and nothing syncs: a decode step stays capturable in a CUDA graph.
At batch 1 this is a GEMV over the 8 chosen experts' weights (the regime where `index_select` +
`bmm` or `torch._grouped_mm` read far more than the weights); at batch 64 each routed expert's
weights are still read once per tile column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.expert_scales import ExpertScales
from lamina.kernels.graph_forward import in_graph_forward
from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.pdl import pdl_kwargs, wait_for_producer
from lamina.kernels.grouped_mm_moe import grouped_mm_moe, grouped_mm_usable
from lamina.kernels.selection import moe_prefill_grouped_mm
from lamina.kernels.tile_fit import launch_fitted
from lamina.kernels.triton_align import align_pairs

from lamina.kernels.triton_moe_gemv import GEMV_MAX_INTER, GEMV_MAX_TOKENS, fused_moe_gemv

__all__ = ["fused_moe", "sum_slots", "route_softmax_topk"]

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the row blocks, in column-tile-first order)


# The step-size counts the grouped kernels take. Triton compiles a kernel again for every new pattern of
# its integer arguments being divisible by 16 or equal to 1; counts that vary from step to step would
# make a server compile at run time whenever a step brings a new pattern (seconds each: an offline
# run of 64 x 1024-token prompts spent 4.3 s of one step compiling these). They are used only in
# masks and comparisons, so they are left unspecialised: one compile for every step size.
COUNT_ARGS = ["num_pairs", "num_tokens", "num_routed_blocks"]


@triton.jit
def _rows_of_block(pid_m, expert, sorted_pairs_ptr, num_pairs, num_tokens, num_routed_blocks,
                   TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows of a row block: (token, slot in the [T, SLOTS] output, pair, valid). Routed blocks
    hold sorted pairs; shared-expert blocks (expert -2) hold consecutive tokens."""
    lanes = tl.arange(0, BLOCK_M)
    is_shared = expert == -2
    routed_rows = tl.where(expert >= 0, BLOCK_M, 0)  # shared blocks lie past the sorted pairs
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + lanes, mask=lanes < routed_rows, other=0)
    shared_tokens = (pid_m - num_routed_blocks) * BLOCK_M + lanes
    tokens = tl.where(is_shared, shared_tokens, pairs // TOP_K)
    row_ok = tl.where(is_shared, shared_tokens < num_tokens, pairs < num_pairs)
    slots = tl.where(is_shared, tokens * SLOTS + TOP_K, tokens * SLOTS + pairs % TOP_K)
    return tokens, slots, pairs, row_ok


@triton.jit
def _block_ids(N_FASTEST: tl.constexpr):
    """(row block, column tile) of this program. N_FASTEST: the grid is [column tiles, row blocks],
    so the programs that run together share their row blocks (each gathered activation block is read
    from DRAM once, the other tiles find it in L2); else [row blocks, column tiles]."""
    if N_FASTEST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _block_weights(expert, w_ptr, shared_w_ptr, stride_we, stride_wn, stride_swn):
    """The weight matrix a row block multiplies with (its expert's, or the shared expert's for
    expert -2) and that matrix's row stride."""
    is_shared = expert == -2
    w_base = tl.where(is_shared, shared_w_ptr, w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we)
    return w_base, tl.where(is_shared, stride_swn, stride_wn)


@triton.jit
def _block_scale_rows(offs_n, k0, expert, s_ptr, shared_s_ptr, stride_se, stride_sn, stride_ssn,
                      BN: tl.constexpr, BK: tl.constexpr):
    """FP8 weights: the scales `[N]` of output rows `offs_n` over the K tile starting at `k0` (the
    tile lies in one block column: BLOCK_K divides BK), of the block's expert or the shared one."""
    is_shared = expert == -2
    base = tl.where(is_shared, shared_s_ptr, s_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_se)
    return tl.load(base + (offs_n // BN) * tl.where(is_shared, stride_ssn, stride_sn) + k0 // BK)


@triton.jit(do_not_specialize=COUNT_ARGS)
def _gate_up_kernel(
    x_ptr, w_ptr, shared_w_ptr, sorted_pairs_ptr, block_expert_ptr, act_ptr, s_ptr, shared_s_ptr,
    num_pairs, num_tokens, num_routed_blocks, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_swn, stride_ap, stride_se, stride_sn, stride_ssn,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, N_FASTEST: tl.constexpr,
    FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALE_B: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    pid_m, pid_n = _block_ids(N_FASTEST)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert == -1:
        return
    tokens, slots, pairs, row_ok = _rows_of_block(
        pid_m, expert, sorted_pairs_ptr, num_pairs, num_tokens, num_routed_blocks, TOP_K, SLOTS, BLOCK_M
    )
    w_base, stride_n = _block_weights(expert, w_ptr, shared_w_ptr, stride_we, stride_wn, stride_swn)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate_w = tl.load(w_base + offs_n[None, :] * stride_n + k[:, None], mask=w_mask, other=0.0)  # [K, N]
        up_w = tl.load(w_base + (offs_n[None, :] + inter) * stride_n + k[:, None], mask=w_mask, other=0.0)
        if FP8:
            gate_s = _block_scale_rows(tl.where(n_ok, offs_n, 0), k0, expert, s_ptr, shared_s_ptr, stride_se,
                                       stride_sn, stride_ssn, BN, BK)
            up_s = _block_scale_rows(tl.where(n_ok, offs_n + inter, 0), k0, expert, s_ptr, shared_s_ptr, stride_se,
                                     stride_sn, stride_ssn, BN, BK)
            if SCALE_B:  # the tile dequantized into a's dtype, then one dot into the accumulator
                acc_gate = tl.dot(a, (gate_w.to(tl.float32) * gate_s[None, :]).to(a.dtype), acc_gate,
                                  input_precision=PRECISION)
                acc_up = tl.dot(a, (up_w.to(tl.float32) * up_s[None, :]).to(a.dtype), acc_up, input_precision=PRECISION)
            else:  # float8 values are exact in a's dtype; the tile's block scales multiply its products
                acc_gate += tl.dot(a, gate_w.to(a.dtype), input_precision=PRECISION) * gate_s[None, :]
                acc_up += tl.dot(a, up_w.to(a.dtype), input_precision=PRECISION) * up_s[None, :]
        else:
            acc_gate += tl.dot(a, gate_w, input_precision=PRECISION)
            acc_up += tl.dot(a, up_w, input_precision=PRECISION)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(act_ptr + slots[:, None] * stride_ap + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=COUNT_ARGS)
def _down_kernel(
    act_ptr, w_ptr, shared_w_ptr, sorted_pairs_ptr, block_expert_ptr, out_ptr, s_ptr, shared_s_ptr,
    num_pairs, num_tokens, num_routed_blocks, hidden, inter,
    stride_ap, stride_we, stride_wn, stride_swn, stride_op, stride_se, stride_sn, stride_ssn,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, N_FASTEST: tl.constexpr,
    FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALE_B: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    pid_m, pid_n = _block_ids(N_FASTEST)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert == -1:
        return
    tokens, slots, pairs, row_ok = _rows_of_block(
        pid_m, expert, sorted_pairs_ptr, num_pairs, num_tokens, num_routed_blocks, TOP_K, SLOTS, BLOCK_M
    )
    w_base, stride_n = _block_weights(expert, w_ptr, shared_w_ptr, stride_we, stride_wn, stride_swn)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < inter
        a = tl.load(act_ptr + slots[:, None] * stride_ap + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_n + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            w_s = _block_scale_rows(tl.where(n_ok, offs_n, 0), k0, expert, s_ptr, shared_s_ptr, stride_se,
                                    stride_sn, stride_ssn, BN, BK)
            if SCALE_B:
                acc = tl.dot(a, (w.to(tl.float32) * w_s[None, :]).to(a.dtype), acc, input_precision=PRECISION)
            else:
                acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * w_s[None, :]
        else:
            acc += tl.dot(a, w, input_precision=PRECISION)
    # unweighted, in the parts' dtype (x's): the slot sum applies the weights in float32
    tl.store(out_ptr + slots[:, None] * stride_op + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    config: dict | None = None,
    gemv_max_tokens: int = GEMV_MAX_TOKENS,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """Same contract as `grouped_experts`: x `[T, H]`; w13 `[E_local, 2I, H]` (gate rows then up
    rows); w2 `[E_local, H, I]`; topk_weights `[T, k]`; topk_ids `[T, k]` global ids (experts of
    other ranks contribute nothing). Returns `[T, H]` in x's dtype.

    `shared = (w13_shared [2I, H], w2_shared [H, I], gate_logit [T])` adds the shared expert in the
    same two launches: every token's extra row, weighted by sigmoid(gate_logit) (its intermediate
    size must be the routed experts' I; with experts on other ranks too, it is added whole here).

    Up to `gemv_max_tokens` tokens (decode; at most GEMV_MAX_TOKENS, 0 = never) the two GEMV kernels of `triton_moe_gemv` run instead
    (no sort, the k-slot sum in registers); a `config` (grouped-GEMM tile sizes, for tuning)
    keeps the grouped path. With `LAMINA_MOE_PREFILL=grouped_mm`, calls beyond DECODE_MAX_PAIRS
    pairs outside CUDA-graph capture (prefill chunks, eager steps) run `lamina.kernels.grouped_mm_moe`
    instead (bf16 on sm90+). A config's keys: block_m, up_n, up_k, down_n, down_k, warps, stages, and
    optionally down_warps / down_stages (the down kernel's, default warps / stages) and n_fastest
    (launch order, see `_block_ids`; the same sums either way). Without a config, tiles the GPU
    lacks the shared memory for are narrowed until they launch (`lamina.kernels.tile_fit`).

    `scales`: the experts' weights (and the shared expert's) are block FP8 with these scales
    (`lamina.kernels.expert_scales`); the grouped kernels' K tiles are cut to the block width, and
    the CUTLASS grouped GEMM is not used, and prefill chunks take their own tiles (`default_config`).
    Config key `fp8_scale_b` (default 1): see `scale_b` below."""
    num_tokens, top_k = topk_ids.shape
    num_local_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return x.new_zeros(num_tokens, hidden)
    if num_tokens <= min(gemv_max_tokens, GEMV_MAX_TOKENS) and inter <= GEMV_MAX_INTER and config is None:  # decode: triton_moe_gemv
        return fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, expert_start, shared, scales=scales)
    if num_pairs > DECODE_MAX_PAIRS and config is None and scales is None and _prefill_on_grouped_mm(x, w13, w2):
        return grouped_mm_moe(x, w13, w2, topk_weights, topk_ids, expert_start, shared)
    if shared is not None and shared[0].shape != (two_inter, hidden):
        raise ValueError(f"shared expert gate_up {tuple(shared[0].shape)} does not match the experts' {(two_inter, hidden)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    cfg = dict(default_config(num_pairs, x.dtype, fp8=scales is not None))
    cfg.update(config or {})
    if scales is not None:  # a K tile within one block column
        scales.check(w13, w2, shared)
        cfg.update(up_k=min(cfg["up_k"], scales.block[1]), down_k=min(cfg["down_k"], scales.block[1]))
    s13, s2, shared_s13, shared_s2 = scales.pointers() if scales is not None else (x, x, x, x)  # (unused without FP8)
    bn, bk = scales.block if scales is not None else (1, 1)
    # FP8: each weight tile dequantized into x's dtype before its dot, one accumulator (the default:
    # at the 35B-A3B shape, 8k tokens took 2.12 ms against 5.50 ms for the other form and 1.28 ms on
    # bf16 weights on an H200, session 33), or (`fp8_scale_b` 0) the tile's products scaled after its
    # dot into a second accumulator (benchmarks/bench_moe_prefill_fp8.py times both)
    scale_b = bool(cfg.get("fp8_scale_b", 1))
    block_m = cfg["block_m"]
    sorted_pairs, block_expert = align_pairs(topk_ids, num_local_experts, expert_start, block_m)
    num_routed_blocks = block_expert.shape[0]
    slots = top_k + (shared is not None)
    if shared is not None:
        shared_blocks = torch.full((-(-num_tokens // block_m),), -2, dtype=torch.int32, device=x.device)
        block_expert = torch.cat([block_expert, shared_blocks])
        shared_w13, shared_w2, shared_logit = shared
    else:
        shared_w13, shared_w2, shared_logit = w13, w2, None  # the kernels' shared pointers: unused
    num_blocks = block_expert.shape[0]
    n_fastest = bool(cfg.get("n_fastest")) and num_blocks <= MAX_GRID_Y

    def grid(num_tiles: int) -> tuple[int, int]:
        return (num_tiles, num_blocks) if n_fastest else (num_blocks, num_tiles)

    act = torch.empty(num_tokens * slots, inter, dtype=x.dtype, device=x.device)  # [T*slots, I]
    # what besides the tiles sets the kernels' shared memory (tile_fit keeps a fit per variant)
    variant = (x.dtype, w13.dtype, block_m, n_fastest, scale_b, bn, bk)

    def launch(name: str, kernel, inp, w, shared_w, out, s, shared_s, out_features: int, tiles: dict,
               n_key: str, k_key: str, stages_key: str, warps_key: str) -> None:
        """One grouped kernel (gate/up or down: the same arguments, in the same order) on `tiles`,
        fitted to the GPU's shared memory unless a config was given (tuning: launched as given)."""
        def run(t: dict) -> None:
            kernel[grid(triton.cdiv(out_features, t[n_key]))](
                inp, w, shared_w, sorted_pairs, block_expert, out, s, shared_s,
                num_pairs, num_tokens, num_routed_blocks, hidden, inter,
                inp.stride(0), w.stride(0), w.stride(1), shared_w.stride(-2), out.stride(0),
                s.stride(0), s.stride(-2), shared_s.stride(-2),
                TOP_K=top_k, SLOTS=slots, BLOCK_M=block_m, BLOCK_N=t[n_key], BLOCK_K=t[k_key], PRECISION=precision,
                N_FASTEST=n_fastest, FP8=scales is not None, BN=bn, BK=bk, SCALE_B=scale_b,
                **pdl_kwargs(x.device), num_warps=t[warps_key], num_stages=t[stages_key], **FP_FUSION,
            )

        if config is None:
            launch_fitted(name, x.device, tiles, run, n_key, k_key, stages_key, variant)
        else:
            run(tiles)

    launch("fused_moe gate/up", _gate_up_kernel, x, w13, shared_w13, act, s13, shared_s13, inter,
           dict(up_n=cfg["up_n"], up_k=cfg["up_k"], stages=cfg["stages"], warps=cfg["warps"]),
           "up_n", "up_k", "stages", "warps")
    # Slots of other ranks' experts are never written: the slot sum skips them (by their ids).
    parts = torch.empty(num_tokens * slots, hidden, dtype=x.dtype, device=x.device)  # [T*slots, H]
    launch("fused_moe down", _down_kernel, act, w2, shared_w2, parts, s2, shared_s2, hidden,
           dict(down_n=cfg["down_n"], down_k=cfg["down_k"], down_stages=cfg.get("down_stages", cfg["stages"]),
                down_warps=cfg.get("down_warps", cfg["warps"])),
           "down_n", "down_k", "down_stages", "down_warps")
    return sum_slots(parts.view(num_tokens, slots, hidden), topk_weights, shared_logit,
                     local_ids=(topk_ids, expert_start, num_local_experts))  # [T, H] in x's dtype


def _prefill_on_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """LAMINA_MOE_PREFILL=grouped_mm applies (bf16 on sm90+), outside CUDA graphs' forwards (their
    warm-ups and static-buffer stand-ins included, `in_graph_forward`): decode steps of more than 64
    tokens and prefill / mixed steps are captured too, and the grouped GEMM path is not checked there."""
    return (moe_prefill_grouped_mm() and x.dtype == torch.bfloat16 and x.is_cuda
            and torch.cuda.get_device_capability(x.device)[0] >= 9 and grouped_mm_usable(x, w13, w2)
            and not in_graph_forward())


@triton.jit
def _sum_slots_kernel(parts_ptr, weights_ptr, shared_logit_ptr, ids_ptr, out_ptr, hidden, stride_wt, stride_sl,
                      stride_it, expert_start, num_local_experts, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                      LOCAL_ONLY: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    slots: tl.constexpr = TOP_K + SHARED
    total = tl.zeros([BLOCK], tl.float32)
    for slot in range(0, TOP_K):  # in slot order: deterministic
        weight = tl.load(weights_ptr + token * stride_wt + slot).to(tl.float32)
        read = ok
        if LOCAL_ONLY:  # another rank's expert: its part was never written (not read; a zero weight and part)
            local = tl.load(ids_ptr + token * stride_it + slot + tl.zeros([BLOCK], tl.int32)).to(tl.int64)  # [BLOCK]
            local -= expert_start
            in_range = (local >= 0) & (local < num_local_experts)
            read = ok & in_range
            weight = tl.where(in_range, weight, 0.0)  # [BLOCK]
        part = tl.load(parts_ptr + (token * slots + slot) * hidden + offs, mask=read, other=0.0).to(tl.float32)
        total += weight * part  # the same product and add as without ids: the same bits where every slot is local
    if SHARED:  # the shared expert's part, gated by the sigmoid of its logit in float32
        logit = tl.load(shared_logit_ptr + token * stride_sl).to(tl.float32)
        part = tl.load(parts_ptr + (token * slots + TOP_K) * hidden + offs, mask=ok, other=0.0).to(tl.float32)
        total += (1.0 / (1.0 + tl.exp(-logit))) * part
    tl.store(out_ptr + token * hidden + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def sum_slots(parts: torch.Tensor, weights: torch.Tensor, shared_logit: torch.Tensor | None = None,
              local_ids: tuple[torch.Tensor, int, int] | None = None) -> torch.Tensor:
    """parts `[T, S, H]` (contiguous; S = k, or k + 1 with the shared expert's part last), weights
    `[T, k]` (routing weights), shared_logit `[T]` or None -> sum over the slots in slot order of
    weight * part, the shared part weighted by sigmoid(shared_logit), all in float32, rounded once
    to the parts' dtype: `[T, H]`.

    `local_ids = (topk_ids [T, k], expert_start, num_local_experts)`: routed slots whose expert lies
    outside [expert_start, expert_start + num_local_experts) (other EP ranks') are skipped
    unread, so their parts may hold anything."""
    num_tokens, slots, hidden = parts.shape
    top_k = weights.shape[1]
    if not parts.is_contiguous():
        raise ValueError(f"parts must be contiguous, got strides {parts.stride()}")
    if slots != top_k + (shared_logit is not None):
        raise ValueError(f"parts hold {slots} slots, weights {top_k}, shared expert {shared_logit is not None}")
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    out = torch.empty(num_tokens, hidden, dtype=parts.dtype, device=parts.device)  # [T, H]
    if num_tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        logit = weights if shared_logit is None else shared_logit  # unused without the shared expert
        ids, expert_start, num_local = local_ids if local_ids is not None else (weights, 0, 0)  # unused without
        if local_ids is not None and ids.shape != weights.shape:
            raise ValueError(f"topk_ids {tuple(ids.shape)} do not match the weights {tuple(weights.shape)}")
        _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, block))](
            parts, weights, logit, ids, out, hidden, weights.stride(0), logit.stride(0), ids.stride(0),
            expert_start, num_local, TOP_K=top_k, SHARED=shared_logit is not None,
            LOCAL_ONLY=local_ids is not None, BLOCK=block, **pdl_kwargs(parts.device), **FP_FUSION
        )
    return out


# Tile sizes: the GEMV regime (few pairs, e.g. batch 1: 8 pairs) wants many narrow tiles so every
# SM streams weights; larger batches wider ones.
# Chosen by benchmarks/tune_moe.py on an H200 (benchmarks/results/tune_moe_h200.json).
DEFAULT_CONFIG_SMALL = dict(block_m=16, up_n=64, up_k=256, down_n=32, down_k=128, warps=4, stages=3)
DEFAULT_CONFIG_LARGE = dict(block_m=16, up_n=32, up_k=256, down_n=64, down_k=128, warps=4, stages=3)
DEFAULT_CONFIG_FP32 = dict(block_m=16, up_n=32, up_k=64, down_n=32, down_k=64, warps=4, stages=2)
# Prefill chunks: compute-bound, so row blocks of 64 / 128 pairs reuse each weight tile that often
# (`benchmarks/tune_moe.py --prefill`, benchmarks/results/tune_moe_prefill_h200.json: at 8,192
# tokens 1.76 ms per layer against the decode tiles' 4.34, 264 against 107 TFLOP/s; at 1,024
# tokens 0.67 against 0.85 ms).
# Both launch column tiles first (`n_fastest`, see `_block_ids`): on an H100 at 2,048 / 8,192 tokens
# 0.925 -> 0.806 / 1.938 -> 1.622 ms a call, bitwise the same sums (bench_moe_prefill_h100_s27.json),
# an 8k prompt's TTFT 169.6 -> 156.3 ms (ttft8k_moe_order_h100_s27.json).
DEFAULT_CONFIG_PREFILL = dict(block_m=64, up_n=64, up_k=64, down_n=64, down_k=64, warps=4, stages=4, n_fastest=True)
DEFAULT_CONFIG_LONG_PREFILL = dict(block_m=128, up_n=128, up_k=64, down_n=128, down_k=64, warps=8, stages=3,
                                   n_fastest=True)
# FP8 experts (weight tiles dequantized before their dots): `python benchmarks/bench_moe_prefill_fp8.py
# --sweep` on an H100 (bench_moe_prefill_fp8_sweep_h100_s33.json): 2,048 tokens 0.741 -> 0.709 ms
# (bf16 weights on their tiles: 0.718), 8,192 tokens 2.204 -> 1.950 ms (bf16: 1.408).
DEFAULT_CONFIG_PREFILL_FP8 = dict(block_m=64, up_n=128, up_k=64, down_n=128, down_k=64, warps=4, stages=4,
                                  n_fastest=True)
DEFAULT_CONFIG_LONG_PREFILL_FP8 = dict(block_m=128, up_n=128, up_k=128, down_n=128, down_k=128, warps=8, stages=3,
                                       n_fastest=True)
DECODE_MAX_PAIRS = 512  # 64 tokens of top-8: the decode tiles' tuned range
PREFILL_MAX_PAIRS = 16384  # 2,048 tokens of top-8; longer chunks take the long-prefill tiles


def default_config(num_pairs: int, dtype: torch.dtype, fp8: bool = False) -> dict:
    """The grouped kernels' tiles for a call of `num_pairs` (token, expert) pairs (`fp8`: on block
    FP8 experts). The tiles (and so the K-summation order) follow the call's size: on the GPU a
    token's bf16 result may round differently with the size of its step (docs/ARCHITECTURE.md,
    "Batch invariance")."""
    if dtype == torch.float32:  # 4-byte tiles: the bf16 tiles would overflow shared memory
        return DEFAULT_CONFIG_FP32
    if num_pairs <= 64:
        return DEFAULT_CONFIG_SMALL
    if num_pairs <= DECODE_MAX_PAIRS:
        return DEFAULT_CONFIG_LARGE
    if num_pairs <= PREFILL_MAX_PAIRS:
        return DEFAULT_CONFIG_PREFILL_FP8 if fp8 else DEFAULT_CONFIG_PREFILL
    return DEFAULT_CONFIG_LONG_PREFILL_FP8 if fp8 else DEFAULT_CONFIG_LONG_PREFILL


@triton.jit
def softmax_topk(logits, experts, ok, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                 RENORMALIZE: tl.constexpr):
    """`SparseMoE.route`'s math on one token's expert logits `[E_PAD]` (float32, `ok` marks the
    real experts): softmax, k rounds of argmax (ties to the lower expert id), optionally
    renormalised. Returns (weights `[K_PAD]` float32, ids `[K_PAD]` int32); slots >= TOP_K unused."""
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    slots = tl.arange(0, K_PAD)  # tl.arange needs a power of 2 (Qwen4-Exp routes to 10 experts)
    # k rounds of one max each over key = (probability bits << 32) | (E_PAD - 1 - expert): non-negative
    # floats order as their bits, so a round takes the highest probability and, among equal ones, the
    # lower expert id, as k rounds of argmax would, with one reduction a round instead of two.
    key = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (E_PAD - 1 - experts).to(tl.int64)
    key = tl.where(ok, key, -1)  # padding experts never win (real keys are >= 0)
    top = tl.zeros([K_PAD], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        top = tl.where(slots == j, best, top)
        key = tl.where(key == best, -1, key)  # keys are distinct: removes exactly one
    top_p = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)  # slots >= TOP_K hold 0.0
    top_i = ((E_PAD - 1) - (top & (E_PAD - 1))).to(tl.int32)
    if RENORMALIZE:
        top_p = top_p / tl.sum(top_p, axis=0)
    return top_p, top_i


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_producer(PDL)
    row = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    ok = experts < num_experts
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=ok, other=float("-inf")).to(tl.float32)
    top_p, top_i = softmax_topk(logits, experts, ok, TOP_K, K_PAD, E_PAD, RENORMALIZE)
    slots = tl.arange(0, K_PAD)
    tl.store(weights_ptr + row * TOP_K + slots, top_p.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, top_i.to(tl.int64), mask=slots < TOP_K)


# Warps of the routing kernel's programs (one token each; a constant, so a token's sums never depend
# on the batch): in one warp the reductions stay in shuffles. benchmarks/tune_decode_warps.py at
# batch 1 on an H200, 256 experts, top-8 (tune_decode_warps_h200.json): 2.39 / 2.50 / 2.59 / 2.86 us
# per call for 1 / 2 / 4 / 8 warps.
ROUTE_WARPS = 1


def route_softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype,
                       num_warps: int | None = None):
    """Softmax over experts (float32), the top-k, optionally renormalised, in one launch per
    step: `SparseMoE.route`'s math. Ties between equal probabilities go to the lower expert id.
    `num_warps` overrides ROUTE_WARPS (benchmarks). Returns (weights `[T, k]` out_dtype, ids
    `[T, k]` int64)."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.long, device=logits.device)
    if num_tokens:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _route_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0),
            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize, **pdl_kwargs(logits.device), num_warps=num_warps or ROUTE_WARPS, **FP_FUSION,
        )
    return weights, ids

"""Sparse MoE block (top-k softmax router, routed experts, sigmoid-gated shared expert) and dense MLP.

Expert placement comes from the parallel context: without EP every rank holds all experts with
their intermediate dim split over TP; with EP each rank of the stage's DP x TP group holds a
contiguous range of whole experts. Dispatch to remote experts starts with an all-gather and ends
with a reduce-scatter, padded to the largest token count taken from step metadata.

Layouts (see lamina.parallel.layout):
- no EP: input R [T, H] -> output P (caller all-reduces, or reduce-scatters under SP).
- EP without SP: input R -> gather over DP -> local experts -> reduce-scatter over DP -> output P
  over TP (each TP rank held different experts), plus the TP-split shared expert (P).
- EP with SP: input S [ceil(T/tp), H] -> gather over EP -> local experts -> reduce-scatter over EP
  -> complete S rows, plus the shared expert with replicated weights on the shard -> output S.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from lamina.kernels.expert_scales import ExpertScales
from lamina.kernels.moe import grouped_experts
from lamina.kernels.selection import fp8_experts_enabled, fused_router_max_tokens, gemv_route_enabled, kernel_set
from lamina.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    check_shape,
    decode_linear,
    share_weight_storage,
)
from lamina.layers.metadata import ForwardMetadata
from lamina.quantization import BlockFp8, Fp8Weight
from lamina.parallel import layout
from lamina.parallel.context import ParallelContext, divide_exact


def fp8_experts_for(options: dict | None, device) -> BlockFp8 | None:
    """The block FP8 format to keep a model's experts in: the checkpoint's (`options["quantization"]`)
    when its MoE layers run on lamina's Triton kernels (`options["kernel_set"]`, else the device's
    kernel set) on a GPU that has float8 e4m3 (sm89+: Triton refuses the type below), every
    expert tensor of the checkpoint is FP8 (`options["fp8_experts"]`, from the shard headers:
    lamina.quantization.unquantized_experts), and `LAMINA_FP8_EXPERTS` is not 0 (prefill-heavy
    work may prefer bf16 experts: docs/PERFORMANCE.md, session 32); None: every weight is
    dequantized as it loads."""
    options = options or {}
    quantization = options.get("quantization")
    if quantization is None or options.get("fp8_experts") is False or not fp8_experts_enabled():
        return None
    kernels = options.get("kernel_set") or kernel_set(device)
    if kernels != "triton":
        return None
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return None
    return quantization


def fp8_block_fits(fp8: BlockFp8, intermediate_per_rank: int) -> bool:
    """Whether the Triton MoE kernels can keep experts FP8: power-of-two blocks (columns >= 16, a
    tl.dot tile) whose rows and columns both tile this rank's intermediate slice (so a rank's
    slice, and the gate / up boundary, fall on block bounds)."""
    bn, bk = fp8.block_rows, fp8.block_cols
    return (bn & (bn - 1) == 0 and bk & (bk - 1) == 0 and bk >= 16
            and intermediate_per_rank % bn == 0 and intermediate_per_rank % bk == 0)


def _scale_param(shape: torch.Size, fp8: BlockFp8, device) -> nn.Parameter:
    """float32 block scales of an FP8 weight of `shape`, one per block of its last two dims."""
    return nn.Parameter(torch.empty(fp8.scale_grid(tuple(shape)), dtype=torch.float32, device=device),
                        requires_grad=False)


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel (output Partial)."""

    def __init__(self, hidden_size: int, total_intermediate_size: int, ctx: ParallelContext, *, dtype, device=None):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [total_intermediate_size, total_intermediate_size], ctx, dtype=dtype, device=device
        )
        self.down_proj = RowParallelLinear(total_intermediate_size, hidden_size, ctx, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        shared_expert_intermediate_size: int,
        norm_topk_prob: bool,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device=None,
        fp8: BlockFp8 | None = None,
    ):
        """`fp8`: the checkpoint's block FP8 format, for a model on lamina's Triton kernels: the
        experts (and the shared expert riding in their launches) stay float8 with their block
        scales when the blocks tile this rank's intermediate slice (`fp8_block_fits`); else the experts
        are dequantized as they load."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok = {top_k} must be in [1, num_experts = {num_experts}]")
        self.ctx = ctx
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.total_intermediate = moe_intermediate_size
        self.ep = ctx.ep_enabled
        # Experts are TP-split (intermediate dim) without EP; whole and spread over EP with it.
        split = 1 if self.ep else ctx.tp_size
        self.intermediate_per_rank = divide_exact(moe_intermediate_size, split, "moe_intermediate_size vs tensor_parallel_size")
        self.intermediate_shard = 0 if self.ep else ctx.tp_rank
        start, end = ctx.expert_range if ctx.expert_range is not None else (0, num_experts)
        self.expert_start, self.num_local_experts = start, end - start
        self.gate = ReplicatedLinear(hidden_size, num_experts, dtype=dtype, device=device)
        self.fp8 = fp8 if fp8 is not None and fp8_block_fits(fp8, self.intermediate_per_rank) else None
        expert_dtype = torch.float8_e4m3fn if self.fp8 else dtype
        self.w13 = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * self.intermediate_per_rank, hidden_size, dtype=expert_dtype,
                        device=device),
            requires_grad=False,
        )  # [E_local, 2I_local, H]
        self.w2 = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, self.intermediate_per_rank, dtype=expert_dtype,
                        device=device),
            requires_grad=False,
        )  # [E_local, H, I_local]
        if self.fp8:
            self.w13_scale_inv = _scale_param(self.w13.shape, self.fp8, device)  # [E_local, 2I_local/bn, H/bk]
            self.w2_scale_inv = _scale_param(self.w2.shape, self.fp8, device)  # [E_local, H/bn, I_local/bk]
        # (FP8 experts are only asked for on the Triton kernel set: `lamina plan` builds on the meta device)
        self.kernels = "triton" if fp8 is not None else kernel_set(device if device is not None else ctx.device)
        # Up to this many tokens (decode) the router GEMV and the top-k are one Triton launch; 0: never.
        self.fused_router_max_tokens = fused_router_max_tokens(self.kernels)
        if self.kernels == "triton":
            from lamina.kernels.selection import moe_gemv_max_tokens
            from lamina.kernels.triton_moe import fused_moe

            self.experts_kernel = functools.partial(fused_moe, gemv_max_tokens=moe_gemv_max_tokens())
        else:
            self.experts_kernel = grouped_experts
        self.has_shared_expert = shared_expert_intermediate_size > 0
        # Under SP with EP every rank holds different tokens: the shared expert must be whole.
        self.shared_replicated = ctx.sp and self.ep
        # The Triton path runs the shared expert inside the fused MoE launches when its shape is the
        # routed experts' and every routed expert is local (no EP).
        self.fuse_shared_expert = (
            self.kernels == "triton" and self.has_shared_expert and not self.ep
            and shared_expert_intermediate_size == moe_intermediate_size
        )
        # FP8 experts with the shared expert in their launches: it stays FP8 too, in these parameters
        self.shared_fp8 = self.fp8 is not None and self.fuse_shared_expert
        if self.has_shared_expert:
            shared_ctx = ParallelContext.single(ctx.device) if self.shared_replicated else ctx
            if self.shared_fp8:
                self.shared_w13 = nn.Parameter(torch.empty(self.w13.shape[1:], dtype=expert_dtype, device=device),
                                               requires_grad=False)  # [2I_local, H]
                self.shared_w2 = nn.Parameter(torch.empty(self.w2.shape[1:], dtype=expert_dtype, device=device),
                                              requires_grad=False)  # [H, I_local]
                self.shared_w13_scale_inv = _scale_param(self.shared_w13.shape, self.fp8, device)
                self.shared_w2_scale_inv = _scale_param(self.shared_w2.shape, self.fp8, device)
            else:
                self.shared_expert = DenseMLP(hidden_size, shared_expert_intermediate_size, shared_ctx, dtype=dtype,
                                              device=device)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype=dtype, device=device)
            # Router and shared-expert gate rows in one tensor: the fused path computes both logits in one GEMV
            # (zero rows up to a multiple of 8: a GEMM over 257 rows runs cuBLAS's unaligned kernels).
            self.router_rows = share_weight_storage(self.gate, self.shared_expert_gate, row_multiple=8)  # [E+1 padded, H]
        self._router_linear = decode_linear(device if device is not None else ctx.device)
        # With LAMINA_GEMV_ROUTE=1, up to GEMV_MAX_ROWS tokens (decode) the router GEMV routes in its last program.
        self.gemv_route_max_tokens = 0
        if gemv_route_enabled(self.kernels):
            from lamina.kernels.triton_gemv import GEMV_MAX_ROWS

            self.gemv_route_max_tokens = GEMV_MAX_ROWS
        self.expert_scales = None  # the FP8 kernels' view of the scale parameters
        if self.fp8:
            self.expert_scales = ExpertScales(
                self.w13_scale_inv, self.w2_scale_inv, (self.fp8.block_rows, self.fp8.block_cols),
                self.shared_w13_scale_inv if self.shared_fp8 else None, self.shared_w2_scale_inv if self.shared_fp8 else None,
            )

    @property
    def input_layout(self) -> str:
        return layout.S if self.shared_replicated else layout.R

    @property
    def output_layout(self) -> str:
        return layout.S if self.shared_replicated else layout.P

    # ---- loading: per-expert and fused 3-D checkpoint layouts ----------------------------
    def _fp8_parts(self, name: str, loaded) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values, block scales) of a checkpoint tensor: the scales only when the experts stay FP8."""
        if self.fp8 is None:
            return loaded, None
        if not isinstance(loaded, Fp8Weight):
            raise ValueError(f"checkpoint tensor {name!r} is not block FP8, but this block FP8 checkpoint's experts "
                             "are kept in FP8: every expert tensor must have its *_scale_inv")
        return loaded.values, loaded.scale_inv

    def _slice_into(self, target: torch.Tensor, scale: torch.Tensor | None, values: torch.Tensor,
                    scale_inv: torch.Tensor | None, dim: int, start: int, size: int, offset: int = 0) -> None:
        """Copy rows (dim -2) or columns (dim -1) [start, start + size) of `values` into `target` at
        `offset` along that dim, and, for FP8, the blocks covering them from `scale_inv` into `scale`
        (`fp8_block_fits` made every bound a block boundary)."""
        target.narrow(dim, offset, size).copy_(values.narrow(dim, start, size))
        if scale is not None:
            block = self.fp8.block_rows if dim in (-2, values.dim() - 2) else self.fp8.block_cols
            scale.narrow(dim, offset // block, size // block).copy_(scale_inv.narrow(dim, start // block, size // block))

    def load_expert(self, name: str, loaded, expert: int, proj: str) -> None:
        """One expert's `gate_proj`/`up_proj` [I, H] or `down_proj` [H, I]; other ranks' experts are
        skipped. With FP8 experts, `loaded` is an `Fp8Weight` (values and block scales)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor {name!r}: expert {expert} out of range [0, {self.num_experts})")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        values, scale_inv = self._fp8_parts(name, loaded)
        i_local = self.intermediate_per_rank
        start = self.intermediate_shard * i_local
        if proj == "down_proj":
            check_shape(name, values, (self.hidden_size, self.total_intermediate))
            self._slice_into(self.w2.data[local], self.fp8 and self.w2_scale_inv.data[local], values, scale_inv,
                             -1, start, i_local)
        else:
            check_shape(name, values, (self.total_intermediate, self.hidden_size))
            self._slice_into(self.w13.data[local], self.fp8 and self.w13_scale_inv.data[local], values, scale_inv,
                             -2, start, i_local, 0 if proj == "gate_proj" else i_local)

    def load_fused(self, name: str, loaded, proj: str) -> None:
        """Fused `gate_up_proj` [E, 2I, H] or `down_proj` [E, H, I] (with FP8 experts an `Fp8Weight`)."""
        values, scale_inv = self._fp8_parts(name, loaded)
        i_local, total = self.intermediate_per_rank, self.total_intermediate
        if proj == "down_proj":
            check_shape(name, values, (self.num_experts, self.hidden_size, total))
        else:
            check_shape(name, values, (self.num_experts, 2 * total, self.hidden_size))
        local = slice(self.expert_start, self.expert_start + self.num_local_experts)
        values, scale_inv = values[local], scale_inv[local] if scale_inv is not None else None
        start = self.intermediate_shard * i_local
        if proj == "down_proj":
            self._slice_into(self.w2.data, self.fp8 and self.w2_scale_inv.data, values, scale_inv, -1, start, i_local)
        else:
            for part, offset in ((0, 0), (total, i_local)):  # gate rows, then up rows
                self._slice_into(self.w13.data, self.fp8 and self.w13_scale_inv.data, values, scale_inv, -2,
                                 part + start, i_local, offset)

    def load_shared_fp8(self, name: str, loaded, proj: str) -> None:
        """The shared expert's `gate_proj`/`up_proj` [I, H] / `down_proj` [H, I] when it stays FP8
        (`shared_fp8`): this rank's intermediate slice, as a column / row-parallel layer would hold it."""
        values, scale_inv = self._fp8_parts(name, loaded)
        i_local = self.intermediate_per_rank
        start = self.ctx.tp_rank * i_local
        if proj == "down_proj":
            check_shape(name, values, (self.hidden_size, self.total_intermediate))
            self._slice_into(self.shared_w2.data, self.shared_w2_scale_inv.data, values, scale_inv, -1, start, i_local)
        else:
            check_shape(name, values, (self.total_intermediate, self.hidden_size))
            self._slice_into(self.shared_w13.data, self.shared_w13_scale_inv.data, values, scale_inv, -2, start,
                             i_local, 0 if proj == "gate_proj" else i_local)

    # ---- forward -------------------------------------------------------------------------
    def _route_in_one_launch(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """On the Triton set, for a decode-sized input: the router GEMV over `rows` (the experts'
        rows, then any extra gate rows) and the top-k in one launch, returning (weights [T, k],
        ids [T, k], logits [T, rows]); None otherwise (the caller runs two launches). Up to
        `fused_router_max_tokens` tokens the opt-in fused router, else up to
        `gemv_route_max_tokens` the split-K GEMV with its routing epilogue."""
        if 0 < x.shape[0] <= self.fused_router_max_tokens:
            from lamina.kernels.triton_router import fused_router

            return fused_router(x, rows, self.num_experts, self.top_k, self.norm_topk_prob)
        if 0 < x.shape[0] <= self.gemv_route_max_tokens:
            from lamina.kernels.triton_gemv import gemv_route

            logits, weights, ids = gemv_route(x, rows, self.num_experts, self.top_k, self.norm_topk_prob)
            return weights, ids, logits
        return None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (fused := self._route_in_one_launch(x, self.gate.weight)) is not None:
            return fused[:2]
        logits = self.gate(x)  # [N, E]
        if self.kernels == "triton":
            from lamina.kernels.triton_moe import route_softmax_topk

            return route_softmax_topk(logits, self.top_k, self.norm_topk_prob, x.dtype)
        probs = torch.softmax(logits.float(), dim=-1)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights.to(x.dtype), topk_ids

    def _experts_with_shared(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts and the gated shared expert in the fused Triton launches."""
        if (fused := self._route_in_one_launch(x, self.router_rows)) is not None:
            topk_weights, topk_ids, logits = fused  # logits [T, E+1 padded]
        else:
            from lamina.kernels.triton_moe import route_softmax_topk

            logits = self._router_linear(x, self.router_rows)  # [T, E+1 padded]: router logits, the shared-expert gate logit, zeros
            topk_weights, topk_ids = route_softmax_topk(
                logits[:, : self.num_experts], self.top_k, self.norm_topk_prob, x.dtype
            )
        if self.shared_fp8:
            shared = (self.shared_w13, self.shared_w2, logits[:, self.num_experts])
        else:
            shared = (self.shared_expert.gate_up_proj.weight, self.shared_expert.down_proj.weight,
                      logits[:, self.num_experts])
        return self.experts_kernel(x, self.w13, self.w2, topk_weights, topk_ids, self.expert_start, shared=shared,
                                   **self._scales_kwargs())

    def _scales_kwargs(self) -> dict:
        return {} if self.expert_scales is None else {"scales": self.expert_scales}

    def _local_experts(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.route(x)
        return self.experts_kernel(x, self.w13, self.w2, topk_weights, topk_ids, self.expert_start,
                                   **self._scales_kwargs())

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def forward(self, x: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        ctx = self.ctx
        layout.expect(x, self.input_layout, ctx, "SparseMoE input")
        num_tokens = meta.num_tokens
        if self.fuse_shared_expert:
            return layout.tag(self._experts_with_shared(x), self.output_layout, ctx)
        if not self.ep:
            out = self._local_experts(x)
        elif self.shared_replicated:
            # EP + SP: x is this rank's shard; gather every EP rank's shard, padded to the largest.
            rows = layout.shard_rows(num_tokens, ctx.tp_size)
            max_rows = max(layout.shard_rows(t, ctx.tp_size) for t in (meta.dp_num_tokens or (num_tokens,)))
            padded = F.pad(x, (0, 0, 0, max_rows - rows))  # [S_max, H]
            gathered = ctx.ep.all_gather(padded, dim=0)  # [ep*S_max, H]
            out = ctx.ep.reduce_scatter(self._local_experts(gathered), dim=0)[:rows]  # [S, H]
        else:
            # EP without SP: tokens are replicated over TP; gather across replicas only.
            max_tokens = max(meta.dp_num_tokens or (num_tokens,))
            padded = F.pad(x, (0, 0, 0, max_tokens - num_tokens))  # [T_max, H]
            gathered = ctx.dp.all_gather(padded, dim=0)  # [dp*T_max, H]
            out = ctx.dp.reduce_scatter(self._local_experts(gathered), dim=0)[:num_tokens]  # [T, H], P over TP
        if self.has_shared_expert:
            out = out + self._shared(x)
        return layout.tag(out, self.output_layout, ctx)

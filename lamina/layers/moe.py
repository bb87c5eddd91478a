"""Sparse MoE block (top-k softmax router, routed experts, sigmoid-gated shared expert) and dense MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lamina.kernels.moe import grouped_experts
from lamina.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, check_shape
from lamina.parallel.context import ParallelContext, divide_exact


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
    """Routed experts (intermediate dim split over TP) plus a shared expert with a sigmoid gate.

    Output is Partial over TP: every term (routed and shared) is a row-parallel partial sum.
    """

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
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok = {top_k} must be in [1, num_experts = {num_experts}]")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.total_intermediate = moe_intermediate_size
        self.intermediate_per_rank = divide_exact(moe_intermediate_size, ctx.tp_size, "moe_intermediate_size vs tensor_parallel_size")
        self.tp_rank = ctx.tp_rank
        self.expert_start = 0
        self.num_local_experts = num_experts
        self.gate = ReplicatedLinear(hidden_size, num_experts, dtype=dtype, device=device)
        self.w13 = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * self.intermediate_per_rank, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )  # [E_local, 2I_local, H]
        self.w2 = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, self.intermediate_per_rank, dtype=dtype, device=device),
            requires_grad=False,
        )  # [E_local, H, I_local]
        self.has_shared_expert = shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = DenseMLP(hidden_size, shared_expert_intermediate_size, ctx, dtype=dtype, device=device)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype=dtype, device=device)

    # ---- loading: per-expert and fused 3-D checkpoint layouts ----------------------------
    def _rows(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.narrow(dim, self.tp_rank * self.intermediate_per_rank, self.intermediate_per_rank)

    def load_expert(self, name: str, loaded: torch.Tensor, expert: int, proj: str) -> None:
        """One expert's `gate_proj`/`up_proj` [I, H] or `down_proj` [H, I]."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor {name!r}: expert {expert} out of range [0, {self.num_experts})")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        i_local = self.intermediate_per_rank
        if proj == "down_proj":
            check_shape(name, loaded, (self.hidden_size, self.total_intermediate))
            self.w2.data[local].copy_(self._rows(loaded, 1))
        else:
            check_shape(name, loaded, (self.total_intermediate, self.hidden_size))
            offset = 0 if proj == "gate_proj" else i_local
            self.w13.data[local, offset : offset + i_local].copy_(self._rows(loaded, 0))

    def load_fused(self, name: str, loaded: torch.Tensor, proj: str) -> None:
        """Fused `gate_up_proj` [E, 2I, H] or `down_proj` [E, H, I]."""
        local = slice(self.expert_start, self.expert_start + self.num_local_experts)
        if proj == "down_proj":
            check_shape(name, loaded, (self.num_experts, self.hidden_size, self.total_intermediate))
            self.w2.data.copy_(self._rows(loaded[local], 2))
        else:
            check_shape(name, loaded, (self.num_experts, 2 * self.total_intermediate, self.hidden_size))
            gate, up = loaded[local].split(self.total_intermediate, dim=1)
            self.w13.data.copy_(torch.cat([self._rows(gate, 1), self._rows(up, 1)], dim=1))

    # ---- forward -------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights.to(x.dtype), topk_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] (Partial over TP)."""
        topk_weights, topk_ids = self.route(x)
        out = grouped_experts(x, self.w13, self.w2, topk_weights, topk_ids, self.expert_start)
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

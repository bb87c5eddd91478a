"""Gated delta net (linear attention) of the Qwen hybrid family, with per-request state slots.

Internal weight layout (independent of the checkpoint family): `in_proj_qkvz` with sub-outputs
[q (Hk*Dk), k (Hk*Dk), v (Hv*Dv), z (Hv*Dv)] and `in_proj_ba` with [b (Hv), a (Hv)], each split
by heads over TP. Qwen3-Next's per-key-head interleaved `in_proj_qkvz`/`in_proj_ba` and
Qwen3.5's separate `in_proj_qkv/z/b/a` are both converted into it by the model's loader.

Recurrent state lives in two per-layer tensors indexed by the request's state slot:
`conv_state [num_slots, conv_dim_per_rank, K-1]` and `ssm_state [num_slots, Hv_per_rank, Dk, Dv]`
(float32 unless `mamba_ssm_cache_dtype` says otherwise: every kernel reads it into float32 and
rounds what it stores). A request whose first chunk is in this step starts from zeros. Under speculative
verification the states after chosen tokens are kept too (lamina.layers.spec_state).

Kernels (chosen when the layer is built, lamina.kernels.selection): a one-token decode step on the
Triton set runs `triton_decode`'s conv and delta rule, then the Triton gated norm, on the pools in
place (with `LAMINA_FUSED_GDN_DECODE=1` all three in one launch, `triton_gdn_decode`: slower on the
H200, see lamina.kernels.selection); an MTP verification step (Q = K + 1 tokens per request) runs
`triton_verify`'s Q-token conv and delta rule. Other steps (prefill chunks, mixed prefill +
decode) run the conv on `triton_conv` and the delta rule on fla-core (`fla_prefill`) where
`gdn_prefill_kernels` picked them, else on the torch references, which also take every
speculative verification step (fla cannot report the states after inner tokens); steps whose
chunks are all short (`gdn_short_prefill_max_tokens`, 256 tokens; `gdn_short_prefill_alone_tokens`,
512, in a step of at most 1,024 tokens: `short_chunk_limit`) run the delta rule token by token in one
launch instead (`triton_gdn_varlen`: fla's ~10 launches cost more host time than they save).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lamina.kernels.gated_delta_rule import gated_delta_rule_varlen
from lamina.kernels.selection import (
    decode_query_len, gdn_prefill_kernels, gdn_short_prefill_alone_tokens, gdn_short_prefill_max_tokens, kernel_set,
)
from lamina.layers.linear import ColumnParallelLinear, RowParallelLinear, check_shape, decode_linear, share_weight_storage
from lamina.layers.metadata import ForwardMetadata
from lamina.layers.norm import GatedRMSNorm
from lamina.layers.spec_state import capture_tokens, conv_with_capture
from lamina.kernels.selection import fused_gdn_decode_enabled
from lamina.parallel import layout
from lamina.parallel.context import ParallelContext, divide_exact


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        total_num_k_heads: int,
        total_num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        rms_norm_eps: float,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device=None,
        output_gate_activation: str = "silu",
    ):
        super().__init__()
        tp, rank = ctx.tp_size, ctx.tp_rank
        self.ctx = ctx
        if total_num_v_heads % total_num_k_heads != 0:
            raise ValueError(
                f"linear_num_value_heads = {total_num_v_heads} must be a multiple of "
                f"linear_num_key_heads = {total_num_k_heads}"
            )
        self.num_k_heads = divide_exact(total_num_k_heads, tp, "linear_num_key_heads vs tensor_parallel_size")
        self.num_v_heads = divide_exact(total_num_v_heads, tp, "linear_num_value_heads vs tensor_parallel_size")
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim = self.num_k_heads * head_k_dim  # per rank
        self.value_dim = self.num_v_heads * head_v_dim  # per rank
        self.conv_dim = 2 * self.key_dim + self.value_dim  # per rank
        self.conv_kernel_size = conv_kernel_size
        self.total_key_dim = total_num_k_heads * head_k_dim
        self.total_value_dim = total_num_v_heads * head_v_dim
        self.total_num_v_heads = total_num_v_heads
        self.tp_rank = rank

        self.in_proj_qkvz = ColumnParallelLinear(
            hidden_size,
            [self.total_key_dim, self.total_key_dim, self.total_value_dim, self.total_value_dim],
            ctx, shard_units=[head_k_dim, head_k_dim, head_v_dim, head_v_dim], dtype=dtype, device=device,
        )
        self.in_proj_ba = ColumnParallelLinear(
            hidden_size, [total_num_v_heads, total_num_v_heads], ctx, dtype=dtype, device=device
        )
        self.conv_weight = nn.Parameter(
            torch.empty(self.conv_dim, conv_kernel_size, dtype=dtype, device=device), requires_grad=False
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype, device=device), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype, device=device), requires_grad=False)
        self.norm = GatedRMSNorm(head_v_dim, rms_norm_eps, activation=output_gate_activation, dtype=dtype, device=device)
        self.out_proj = RowParallelLinear(self.total_value_dim, hidden_size, ctx, dtype=dtype, device=device)
        self.conv_state: torch.Tensor | None = None  # bound by the runner
        self.ssm_state: torch.Tensor | None = None
        self.kernels = kernel_set(device if device is not None else ctx.device)
        self.fused_decode = fused_gdn_decode_enabled(self.kernels)  # one-token decode in one launch
        self.prefill_kernels = gdn_prefill_kernels(device if device is not None else ctx.device, self.kernels, dtype)
        self.short_prefill_tokens = gdn_short_prefill_max_tokens(self.kernels)  # delta rule token by token up to here
        self.short_prefill_alone_tokens = gdn_short_prefill_alone_tokens(self.kernels)  # ... or this, in small steps
        self.in_proj_rows = share_weight_storage(self.in_proj_qkvz, self.in_proj_ba)  # [qkvz + ba rows, H]
        self._decode_linear = decode_linear(device if device is not None else ctx.device)

    # ---- loading -------------------------------------------------------------------------
    def load_conv_weight(self, name: str, loaded: torch.Tensor) -> None:
        """Checkpoint conv1d.weight [total_conv_dim, 1, K]: take this rank's q, k and v rows."""
        total_conv = 2 * self.total_key_dim + self.total_value_dim
        check_shape(name, loaded, (total_conv, 1, self.conv_kernel_size))
        weight = loaded[:, 0, :]  # [total_conv_dim, K]
        q_all, k_all, v_all = weight.split([self.total_key_dim, self.total_key_dim, self.total_value_dim])
        parts = (
            q_all.narrow(0, self.tp_rank * self.key_dim, self.key_dim),
            k_all.narrow(0, self.tp_rank * self.key_dim, self.key_dim),
            v_all.narrow(0, self.tp_rank * self.value_dim, self.value_dim),
        )
        self.conv_weight.data.copy_(torch.cat(parts, dim=0))

    def load_head_vector(self, name: str, loaded: torch.Tensor) -> None:
        """`A_log` / `dt_bias` [total Hv]: this rank's heads."""
        check_shape(name, loaded, (self.total_num_v_heads,))
        target = self.A_log if name.endswith("A_log") else self.dt_bias
        target.data.copy_(loaded.narrow(0, self.tp_rank * self.num_v_heads, self.num_v_heads))

    # ---- state ---------------------------------------------------------------------------
    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (
            (num_slots, self.conv_dim, self.conv_kernel_size - 1),
            (num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )

    def bind_state(self, num_slots: int, dtype: torch.dtype, device, ssm_dtype: torch.dtype = torch.float32) -> int:
        """Allocate the per-slot conv state (in `dtype`, the activations') and recurrent state (in
        `ssm_dtype`: every kernel computes in float32 and rounds the state when it stores it); returns
        their bytes."""
        conv_shape, ssm_shape = self.state_shapes(num_slots)
        self.conv_state = torch.zeros(conv_shape, dtype=dtype, device=device)
        self.ssm_state = torch.zeros(ssm_shape, dtype=ssm_dtype, device=device)
        return self.conv_state.numel() * dtype.itemsize + self.ssm_state.numel() * ssm_dtype.itemsize

    def state_tensors(self) -> list[torch.Tensor]:
        """Every per-slot state tensor (slot-major), for slot-to-slot copies."""
        return [self.conv_state, self.ssm_state]

    # ---- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        """x [T, hidden] (Replicate) -> [T, hidden] (Partial)."""
        assert self.conv_state is not None and self.ssm_state is not None, "recurrent state not bound"
        layout.expect(x, layout.R, self.ctx, "GatedDeltaNet input")
        num_tokens = meta.num_tokens
        queries = decode_query_len(meta) if self.kernels == "triton" else None
        if queries is not None:
            projected = self._decode_linear(x, self.in_proj_rows)  # [T, conv_dim + value_dim + 2*Hv]: one GEMV
            mixed_qkv, z, b, a = projected.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
            return self._decode_in_place(mixed_qkv, z, b, a, meta, queries)
        qkvz = self.in_proj_qkvz(x)  # [T, 2*key_dim + 2*value_dim]
        mixed_qkv, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split(self.num_v_heads, dim=-1)  # [T, Hv] each

        slots = meta.state_slots
        keep = meta.has_initial_state
        fast = meta.state_capture is None  # verification steps keep per-token states: references only
        if fast and self.prefill_kernels.conv == "triton":
            from lamina.kernels.triton_conv import causal_conv1d_prefill

            query, key, value = causal_conv1d_prefill(
                mixed_qkv, self.conv_weight, self.conv_state, slots, keep, meta.query_start_loc,
                meta.token_request_index, split=(self.key_dim, self.key_dim, self.value_dim),
            )  # [T, Dq], [T, Dq], [T, Dv], each contiguous (fla-core copies strided inputs); pool updated in place
        else:
            conv_in = torch.where(keep[:, None, None], self.conv_state[slots], 0.0)  # [B, C, K-1]
            mixed_qkv, conv_out = conv_with_capture(self.conv_state, mixed_qkv, self.conv_weight, conv_in, meta)
            self.conv_state.index_copy_(0, slots, conv_out.to(self.conv_state.dtype))
            query, key, value = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)

        query = query.reshape(num_tokens, self.num_k_heads, self.head_k_dim)  # [T, Hk, Dk]
        key = key.reshape(num_tokens, self.num_k_heads, self.head_k_dim)  # [T, Hk, Dk]
        value = value.reshape(num_tokens, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]
        if fast and 0 < meta.max_query_len <= self.short_chunk_limit(meta.num_tokens):
            from lamina.kernels.triton_gdn_varlen import gated_delta_rule_short_prefill

            core = gated_delta_rule_short_prefill(
                query, key, value, a, b, self.ssm_state, slots, keep, meta.query_start_loc,
                a_log=self.A_log, dt_bias=self.dt_bias,
            )  # [T, Hv, Dv]: l2 norms and gates in the kernel; the pool's recurrent states updated
            return self._output(core, z, num_tokens)
        g, beta = self._gates(b, a)

        if fast and self.prefill_kernels.delta_rule == "fla":
            from lamina.kernels.fla_prefill import FLA_CHUNK_SIZE, gated_delta_rule_prefill_fla

            core = gated_delta_rule_prefill_fla(
                query, key, value, g, beta, self.ssm_state, slots, keep, meta.query_start_loc,
                chunk_indices=meta.chunk_indices(FLA_CHUNK_SIZE),
            )  # [T, Hv, Dv]; the pool's recurrent states updated
            return self._output(core, z, num_tokens)
        state_in = torch.where(keep[:, None, None, None], self.ssm_state[slots], 0.0)  # [B, Hv, Dk, Dv]
        core, state_out, *captured = gated_delta_rule_varlen(
            query, key, value, g, beta, state_in, meta.query_start_loc, meta.max_query_len, use_qk_l2norm=True,
            capture=capture_tokens(meta), groups=meta.request_groups(),
        )  # core [T, Hv, Dv]
        if captured:  # speculative verification: the states after the captured tokens
            meta.state_capture.keep(self.ssm_state, captured[0])
        self.ssm_state.index_copy_(0, slots, state_out.to(self.ssm_state.dtype))

        return self._output(core, z, num_tokens)

    def short_chunk_limit(self, num_tokens: int) -> int:
        """The longest chunk a step of `num_tokens` tokens runs on the short-chunk delta rule: the
        longer `short_prefill_alone_tokens` in a step of at most twice that (a prompt or two alone,
        or with decodes: host-bound on fla-core's kernels), `short_prefill_tokens` otherwise (a step
        of many long chunks walks each token by token, slower than fla-core's chunked form)."""
        alone = self.short_prefill_alone_tokens
        if alone > self.short_prefill_tokens and num_tokens <= 2 * alone:
            return alone
        return self.short_prefill_tokens

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        beta = torch.sigmoid(b.float())  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, Hv]
        return g, beta

    def _output(self, core: torch.Tensor, z: torch.Tensor, num_tokens: int) -> torch.Tensor:
        z = z.reshape(num_tokens, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]
        core = self.norm(core, z).reshape(num_tokens, self.value_dim)  # [T, Hv*Dv]
        return self.out_proj(core)

    def _decode_in_place(self, mixed_qkv, z, b, a, meta: ForwardMetadata, queries: int) -> torch.Tensor:
        """Q tokens per request on the Triton kernels (Q = 1: plain decode; Q = K + 1: verification):
        conv and delta rule read and write the state pools at the requests' slots in place (no
        gather / scatter of states); under verification they also write the states after tokens
        0..Q-2 into the step's capture rows (lamina.layers.spec_state). Plain decode runs conv,
        delta rule and gated norm as one kernel (`fused_gdn_decode`) when the layer was built
        with LAMINA_FUSED_GDN_DECODE=1."""
        from lamina.kernels.triton_verify import causal_conv1d_verify, gated_delta_rule_verify

        num_tokens = meta.num_tokens
        slots, keep = meta.state_slots, meta.has_initial_state
        capture = meta.state_capture
        if queries == 1 and capture is None and self.fused_decode:
            from lamina.kernels.triton_gdn_decode import fused_gdn_decode

            core = fused_gdn_decode(
                mixed_qkv, z, b, a, self.conv_weight, self.conv_state, self.ssm_state, slots, keep, self.A_log,
                self.dt_bias, self.norm.weight, num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim,
                norm_eps=self.norm.eps, activation=self.norm.activation,
            )  # [T, Hv*Dv]: conv, delta rule and gated norm in one launch, the pools updated in place
            return self.out_proj(core)
        conv_rows = ssm_rows = None
        if capture is not None:  # decode_query_len: Q - 1 captured tokens per request, request-major
            count = meta.num_reqs * (queries - 1)
            conv_rows, ssm_rows = capture.rows(self.conv_state, count), capture.rows(self.ssm_state, count)
        mixed_qkv = causal_conv1d_verify(
            mixed_qkv, self.conv_weight, self.conv_state, slots, keep, queries, capture=conv_rows,
        )  # [T, C]
        query, key, value = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(num_tokens, self.num_k_heads, self.head_k_dim)  # [T, Hk, Dk]
        key = key.reshape(num_tokens, self.num_k_heads, self.head_k_dim)  # [T, Hk, Dk]
        value = value.reshape(num_tokens, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]
        core = gated_delta_rule_verify(
            query, key, value, a, b, self.ssm_state, slots, keep, queries, a_log=self.A_log, dt_bias=self.dt_bias,
            capture=ssm_rows,
        )  # [T, Hv, Dv]: the gates are computed in the kernel from the raw projections a, b
        if capture is not None:
            capture.keep(self.conv_state, conv_rows)
            capture.keep(self.ssm_state, ssm_rows)
        return self._output(core, z, num_tokens)

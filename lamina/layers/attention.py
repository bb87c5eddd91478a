"""Gated full attention (Qwen3-Next / Qwen3.5-MoE): output gate, q/k norm, partial RoPE, paged KV."""

from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.paged_attention import paged_attention, write_kv_cache
from lamina.kernels.selection import (
    decode_query_len, fresh_prompt_varlen_enabled, kernel_set, triton_prefill_attention_enabled,
)
from lamina.layers.linear import ColumnParallelLinear, RowParallelLinear, decode_linear, share_weight_storage
from lamina.layers.metadata import ForwardMetadata
from lamina.layers.norm import RMSNorm
from lamina.layers.rotary import RotaryEmbedding
from lamina.parallel import layout
from lamina.parallel.context import ParallelContext, divide_exact


class GatedAttention(nn.Module):
    """q_proj yields per head [query D | gate D]; output = o_proj(attn * sigmoid(gate)), Partial over TP."""

    def __init__(
        self,
        *,
        hidden_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        rms_norm_eps: float,
        attention_bias: bool,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device=None,
    ):
        super().__init__()
        tp = ctx.tp_size
        self.ctx = ctx
        self.head_dim = head_dim
        self.num_heads = divide_exact(total_num_heads, tp, "num_attention_heads vs tensor_parallel_size")
        # KV heads are split while there are enough, else replicated across groups of ranks.
        self.num_kv_heads = max(1, total_num_kv_heads // tp)
        if total_num_kv_heads >= tp:
            divide_exact(total_num_kv_heads, tp, "num_key_value_heads vs tensor_parallel_size")
        else:
            divide_exact(tp, total_num_kv_heads, "tensor_parallel_size vs num_key_value_heads")
        self.scale = head_dim**-0.5
        self.rotary = rotary
        self.q_proj = ColumnParallelLinear(
            hidden_size, [total_num_heads * head_dim * 2], ctx, bias=attention_bias,
            shard_units=[2 * head_dim], dtype=dtype, device=device,
        )
        self.k_proj = ColumnParallelLinear(
            hidden_size, [total_num_kv_heads * head_dim], ctx, bias=attention_bias,
            shard_units=[head_dim], dtype=dtype, device=device,
        )
        self.v_proj = ColumnParallelLinear(
            hidden_size, [total_num_kv_heads * head_dim], ctx, bias=attention_bias,
            shard_units=[head_dim], dtype=dtype, device=device,
        )
        self.o_proj = RowParallelLinear(total_num_heads * head_dim, hidden_size, ctx, dtype=dtype, device=device)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(head_dim, rms_norm_eps, dtype=dtype, device=device)
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, D], bound by the runner
        self.v_cache: torch.Tensor | None = None
        self.kernels = kernel_set(device if device is not None else ctx.device)
        self.triton_prefill_attention = triton_prefill_attention_enabled(self.kernels)
        self.fresh_prompt_varlen = fresh_prompt_varlen_enabled(self.kernels)
        self.qkv_rows = None if attention_bias else share_weight_storage(self.q_proj, self.k_proj, self.v_proj)
        self._decode_linear = decode_linear(device if device is not None else ctx.device)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def paged_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def bind_paged_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> int:
        """Allocate this layer's paged K/V cache; returns its bytes."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        return 2 * self.k_cache.numel() * dtype.itemsize

    def paged_cache_tensors(self) -> list[torch.Tensor]:
        """Every paged cache tensor (block-major), for block-to-block copies."""
        return [self.k_cache, self.v_cache]

    def forward(
        self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] (Replicate) -> [T, hidden] (Partial). `key_mask`: optional sparse-attention
        selection in `paged_attention`'s padded layout (see there)."""
        layout.expect(x, layout.R, self.ctx, "GatedAttention input")
        num_tokens = meta.num_tokens
        queries = decode_query_len(meta) if self.kernels == "triton" and key_mask is None else None
        if queries is not None and self.qkv_rows is not None:
            return self._decode_fused(x, meta, cos, sin, queries)
        fast = self.kernels == "triton"
        if fast and self.qkv_rows is not None:  # one GEMM for q/gate, k, v; norms, rotary, cache write in one launch
            query, gate = self._project_and_cache_fused(x, meta, cos, sin)  # [T, H, D] each
        else:
            query, gate = self._project_and_cache(x, meta, cos, sin)  # [T, H, D], [T, H*D]
            gate = gate.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        attn = paged_attention(
            query, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.max_query_len, meta.max_seq_len, self.scale, key_mask=key_mask,
            # with the varlen kernel, groups by kind: decodes, continued chunks, fresh prompts
            groups=meta.request_groups(by_context=True, by_kind=self.triton_prefill_attention and key_mask is None,
                                       fresh_with_continued=self.fresh_prompt_varlen),
            # fresh prompts: the varlen kernel (`fresh_varlen` below) or, with
            # LAMINA_FRESH_PROMPT_ATTENTION=sdpa, SDPA's own causal rule (the whole step, or per group); the
            # paged decode kernel for groups of decodes, on the fast kernel set (CUDA, or Triton's
            # interpreter in CI); the reference set keeps the built mask
            causal_from_start=fast and meta.prompts_from_start, fast_groups=fast,
            # on the fast set the output gate goes in too: a group of decodes gates inside the decode
            # kernel, as decode steps do
            gate=gate if fast else None,  # [T, H, D]
            # chunks that continue cached context: lamina's varlen kernel rather than SDPA's masked call
            varlen=self.triton_prefill_attention,
            decodes_only=meta.max_query_len == 1 and meta.num_tokens == meta.num_reqs,  # one query per request
            fresh_varlen=self.fresh_prompt_varlen,  # fresh prompts on the varlen kernel too (the default)
        )  # [T, H, D]
        attn = attn.reshape(num_tokens, self.num_heads * self.head_dim)  # [T, H*D]
        if not fast:
            attn = attn * torch.sigmoid(gate.reshape(num_tokens, self.num_heads * self.head_dim))  # [T, H*D]
        return self.o_proj(attn)

    def _project_and_cache(
        self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (query [T, H, D] normed and rotated, gate [T, H*D]); this step's keys
        and values (normed, rotated) go to the paged cache."""
        num_tokens = meta.num_tokens
        query_gate = self.q_proj(x).view(num_tokens, self.num_heads, 2 * self.head_dim)  # [T, H, 2D]
        query, gate = query_gate.split(self.head_dim, dim=-1)  # [T, H, D] each
        gate = gate.reshape(num_tokens, self.num_heads * self.head_dim)  # [T, H*D]
        key = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        value = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        query = self.rotary.apply(self.q_norm(query), cos, sin)
        key = self.rotary.apply(self.k_norm(key), cos, sin)
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not bound"
        write_kv_cache(key, value, self.k_cache, self.v_cache, meta.slot_mapping)
        return query, gate

    def _project_and_cache_fused(
        self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_project_and_cache` on the Triton kernels (needs `qkv_rows`), for decode and prefill steps
        alike: one GEMV (or, beyond a few rows, one GEMM) for q/gate, k and v; q/k norm, rotary and
        the cache write in one launch. Returns (query [T, H, D], gate [T, H, D])."""
        from lamina.kernels.triton_qk_prep import qk_norm_rope_cache

        num_tokens, heads, kv_heads, dim = meta.num_tokens, self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._decode_linear(x, self.qkv_rows)  # [T, H*2D + 2*Hkv*D]
        query_gate, key, value = qkv.split([heads * 2 * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        query_gate = query_gate.view(num_tokens, heads, 2 * dim)  # [T, H, 2D]: per head [query D | gate D]
        key = key.view(num_tokens, kv_heads, dim)  # [T, Hkv, D]
        value = value.view(num_tokens, kv_heads, dim)  # [T, Hkv, D]
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not bound"
        query = qk_norm_rope_cache(
            query_gate[..., :dim], key, value, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            self.q_norm.zero_centred, cos, sin, meta.slot_mapping, self.k_cache, self.v_cache,
        )  # [T, H, D]
        return query, query_gate[..., dim:]

    def _decode_fused(
        self, x: torch.Tensor, meta: ForwardMetadata, cos: torch.Tensor, sin: torch.Tensor, queries: int,
    ) -> torch.Tensor:
        """Q tokens per request on the Triton kernels (Q = 1: plain decode; Q = K + 1: MTP
        verification, causal inside the Q): one GEMV for q/gate, k and v; q/k norm, rotary and the
        cache write in one launch; attention with the output gate in another."""
        from lamina.kernels.triton_verify import paged_verify_attention

        num_tokens, heads, dim = meta.num_tokens, self.num_heads, self.head_dim
        query, gate = self._project_and_cache_fused(x, meta, cos, sin)  # [T, H, D] each
        attn = paged_verify_attention(
            query, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale, queries, gate=gate,
        )  # [T, H, D], gated
        return self.o_proj(attn.reshape(num_tokens, heads * dim))

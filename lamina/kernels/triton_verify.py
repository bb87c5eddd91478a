"""Triton kernels of a decode step with a uniform Q tokens per request (MTP verification: the last
accepted token and K drafts, Q = K + 1), reading the caches and state pools in place.

Token t of the flat batch is token `t % Q` of request `t // Q`. With Q = 1 every entry point
here calls the one-token kernels of `lamina.kernels.triton_decode` unchanged.

- `paged_verify_attention`: the Q queries of a request (positions seq_len - Q .. seq_len - 1)
  over its paged K/V, causal inside the Q: the decode kernel with Q query rows per program (its
  key splits, block size and FP8 stages), each row computed as the one-token kernel computes its
  position (bit for bit on an H100 for every Q: past 32 rows a request's rows run in programs of at
  most 32, whole query tokens each). Reference:
  `paged_attention` with `max_query_len == Q`.
- `gated_delta_rule_verify`: Q delta-rule steps per request on the device, from the state at the
  request's slot; the state after the last token is written back to the slot, and with `capture`
  `[B*(Q-1), Hv, Dk, Dv]` the states after tokens 0..Q-2 go to capture rows b*(Q-1) + i, which
  is the layout `lamina.layers.metadata.StateCapture` commits from (rollback of rejected drafts).
  Reference: `recurrent_gated_delta_rule_step`, one token at a time.
- `causal_conv1d_verify`: the depthwise causal conv of Q tokens with the rolling input state,
  the same capture rows for the conv states. Reference: `causal_conv1d_varlen` with `capture`.

Rows with a negative state slot are padding: they read zeros and write no state and no capture.
Nothing here reads a tensor value on the host; launch shapes follow host ints only, so a step
built from these kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.triton_decode import (
    causal_conv1d_decode,
    gated_delta_rule_decode,
    paged_decode_attention,
)

__all__ = ["paged_verify_attention", "gated_delta_rule_verify", "causal_conv1d_verify", "MAX_QUERIES"]

MAX_QUERIES = 8  # Q <= 8: K <= 7 drafts


def _check_queries(num_tokens: int, queries: int) -> int:
    if not 1 <= queries <= MAX_QUERIES:
        raise ValueError(f"queries = {queries} must be in 1..{MAX_QUERIES}")
    if num_tokens % queries:
        raise ValueError(f"{num_tokens} tokens are not a whole number of requests of {queries} tokens")
    return num_tokens // queries


# ---- paged attention, Q queries per request ------------------------------------------------------


def paged_verify_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, queries: int, gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[B*Q, Hq, D]` (request-major, unit last stride); caches `[num_blocks, block_size, Hkv, D]`
    holding this step's keys; block_tables `[B, >= pages]`; seq_lens `[B]` (>= Q): query i of
    request b sits at seq_lens[b] - Q + i; gate: optional `[B*Q, Hq, D]`, the output becomes
    attn * sigmoid(gate). Returns `[B*Q, Hq, D]` in q's dtype."""
    _check_queries(q.shape[0], queries)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, gate=gate, queries=queries)


# ---- gated delta rule, Q tokens per request --------------------------------------------------------


@triton.jit
def _gdr_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, keep_ptr, out_ptr, cap_ptr,
    scale, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh, stride_cr, stride_ch, stride_ck,
    QUERIES: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr, CAPTURE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    k_head = head // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    s_ok = k_ok[:, None] & v_ok[None, :]
    slot = tl.load(slots_ptr + req)
    live = (offs_v * 0 + slot) >= 0  # [V]: padding rows (slot < 0) read zeros and write no state
    keep = tl.load(keep_ptr + req)
    s_ptrs = state_ptr + tl.maximum(slot, 0) * stride_ss + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    state = tl.load(s_ptrs, mask=s_ok & live[None, :], other=0.0).to(tl.float32)  # [K, V]
    state = tl.where(keep != 0, state, 0.0)
    if RAW_GATES:
        neg_a = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    for i in tl.static_range(QUERIES):  # the request's tokens, in order, on the device
        t = req * QUERIES + i
        q = tl.load(q_ptr + t * stride_qt + k_head * stride_qh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + k_head * stride_kh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q) + eps)
            k = k * tl.rsqrt(tl.sum(k * k) + eps)
        q = q * scale
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + head).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + head).to(tl.float32)
        if RAW_GATES:  # g holds `a`, beta holds `b`: the layer's gate math, fused
            a = g + dt_bias
            g = neg_a * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
            beta = 1.0 / (1.0 + tl.exp(-beta))
        state = state * tl.exp(g)
        delta = beta * (v - tl.sum(state * k[:, None], axis=0))  # [V]
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)  # [V]
        tl.store(out_ptr + t * stride_ot + head * stride_oh + offs_v, out.to(out_ptr.dtype.element_ty), mask=v_ok)
        if CAPTURE:
            if i < QUERIES - 1:  # the state after token i: capture row req * (Q-1) + i
                c_ptrs = (cap_ptr + (req * (QUERIES - 1) + i) * stride_cr + head * stride_ch
                          + offs_k[:, None] * stride_ck + offs_v[None, :])
                tl.store(c_ptrs, state, mask=s_ok & live[None, :])
    tl.debug_barrier()  # the whole tile was read before any lane writes it back
    tl.store(s_ptrs, state, mask=s_ok & live[None, :])


def gated_delta_rule_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, queries: int, use_qk_l2norm: bool = True,
    *, a_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, capture: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k `[B*Q, Hk, Dk]`; v `[B*Q, Hv, Dv]` (unit last strides); g, beta `[B*Q, Hv]`;
    state_pool `[num_slots, Hv, Dk, Dv]` (float32, bfloat16 or float16; computed in float32), read at
    `slots [B]` (zeros where `keep[b]` is False or the slot is negative) and updated there with the state after each
    request's last token. capture: optional `[>= B*(Q-1), Hv, Dk, Dv]` in the pool's dtype (unit last stride):
    the states after tokens 0..Q-2 of request b go to rows b*(Q-1)..b*(Q-1)+Q-2. `a_log`, `dt_bias` as in
    `gated_delta_rule_decode`. Returns the output `[B*Q, Hv, Dv]` in v's dtype."""
    if queries == 1 and capture is None:
        return gated_delta_rule_decode(q, k, v, g, beta, state_pool, slots, keep, use_qk_l2norm, a_log=a_log, dt_bias=dt_bias)
    num_tokens, num_v_heads, head_v_dim = v.shape
    bsz = _check_queries(num_tokens, queries)
    num_k_heads, head_k_dim = k.shape[1], k.shape[2]
    out = torch.empty((num_tokens, num_v_heads, head_v_dim), dtype=v.dtype, device=v.device)
    if bsz == 0:
        return out
    raw = a_log is not None
    cap = capture if capture is not None else state_pool
    block_v = min(32, triton.next_power_of_2(head_v_dim))
    grid = (bsz, num_v_heads, triton.cdiv(head_v_dim, block_v))
    _gdr_verify_kernel[grid](
        q, k, v, g, beta, a_log if raw else g, dt_bias if raw else g, state_pool, slots, keep, out, cap,
        head_k_dim**-0.5, 1e-6,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), out.stride(0), out.stride(1),
        cap.stride(0), cap.stride(1), cap.stride(2),
        QUERIES=queries, GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        BLOCK_K=triton.next_power_of_2(head_k_dim), BLOCK_V=block_v, L2NORM=use_qk_l2norm, RAW_GATES=raw,
        CAPTURE=capture is not None, **FP_FUSION,
    )
    return out


# ---- causal conv1d, Q tokens per request -------------------------------------------------------------


@triton.jit
def _seq_window(state_row, x_req, stride_xt, offs_c, c_ok, offs_j, start, width: tl.constexpr,
                STATE_LEN: tl.constexpr, use_state):
    """Entries start .. start+width-1 of the request's sequence [state (STATE_LEN inputs), x tokens],
    as two masked `[C, J]` loads: (from the state, in its dtype; from x, in x's dtype)."""
    p = start + offs_j  # [J]
    want = offs_j < width
    from_state = want & (p < STATE_LEN)
    from_x = want & (p >= STATE_LEN)
    st = tl.load(state_row + p[None, :], mask=(c_ok & use_state)[:, None] & from_state[None, :], other=0.0)
    xv = tl.load(x_req + (p - STATE_LEN)[None, :] * stride_xt + offs_c[:, None],
                 mask=c_ok[:, None] & from_x[None, :], other=0.0)
    return st, xv, from_state


@triton.jit
def _conv_verify_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, keep_ptr, out_ptr, cap_ptr, channels,
    stride_xt, stride_wc, stride_ss, stride_sc, stride_ot, stride_cr, stride_cc,
    QUERIES: tl.constexpr, KERNEL: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr,
    SILU: tl.constexpr, CAPTURE: tl.constexpr,
):
    req = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, BLOCK_J)
    c_ok = offs_c < channels
    slot = tl.load(slots_ptr + req)
    live = (offs_c * 0 + slot) >= 0  # [C]: padding rows (slot < 0) read zeros and write no state
    use_state = live & ((offs_c * 0 + tl.load(keep_ptr + req).to(tl.int32)) != 0)  # [C]
    row = state_ptr + tl.maximum(slot, 0) * stride_ss + offs_c[:, None] * stride_sc  # [C, 1]
    x_req = x_ptr + req * QUERIES * stride_xt
    w = tl.load(w_ptr + offs_c[:, None] * stride_wc + offs_j[None, :],
                mask=c_ok[:, None] & (offs_j[None, :] < KERNEL), other=0.0).to(tl.float32)  # [C, J]
    for i in tl.static_range(QUERIES):  # y_i reads seq[i .. i+K-1]
        st, xv, _ = _seq_window(row, x_req, stride_xt, offs_c, c_ok, offs_j, i, KERNEL, KERNEL - 1, use_state)
        y = tl.sum((st.to(tl.float32) + xv.to(tl.float32)) * w, axis=1)  # [C]
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(out_ptr + (req * QUERIES + i) * stride_ot + offs_c, y.to(out_ptr.dtype.element_ty), mask=c_ok)
        if CAPTURE:
            if i < QUERIES - 1:  # the state after token i: seq[i+1 .. i+K-1], capture row req*(Q-1) + i
                st, xv, from_state = _seq_window(row, x_req, stride_xt, offs_c, c_ok, offs_j, i + 1, KERNEL - 1,
                                                 KERNEL - 1, use_state)
                kept = tl.where(from_state[None, :], st, xv.to(st.dtype))
                tl.store(cap_ptr + (req * (QUERIES - 1) + i) * stride_cr + offs_c[:, None] * stride_cc + offs_j[None, :],
                         kept, mask=(c_ok & live)[:, None] & (offs_j[None, :] < KERNEL - 1))
    st, xv, from_state = _seq_window(row, x_req, stride_xt, offs_c, c_ok, offs_j, QUERIES, KERNEL - 1, KERNEL - 1,
                                     use_state)
    new_state = tl.where(from_state[None, :], st, xv.to(st.dtype))  # [C, J]: seq[Q .. Q+K-2]
    tl.debug_barrier()  # every lane has read the old state before any writes it
    tl.store(row + offs_j[None, :], new_state, mask=(c_ok & live)[:, None] & (offs_j[None, :] < KERNEL - 1))


def causal_conv1d_verify(
    x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
    queries: int, activation: str | None = "silu", capture: torch.Tensor | None = None,
) -> torch.Tensor:
    """x `[B*Q, C]` (request-major, rows may be strided); weight `[C, K]`; state_pool
    `[num_slots, C, K-1]`, read at `slots [B]` (zeros where `keep[b]` is False or the slot is
    negative) and updated there; capture: optional `[>= B*(Q-1), C, K-1]` in the pool's dtype
    (unit last stride), rows as in `gated_delta_rule_verify`. Returns `[B*Q, C]` in x's dtype."""
    if queries == 1 and capture is None:
        return causal_conv1d_decode(x, weight, state_pool, slots, keep, activation)
    num_tokens, channels = x.shape
    bsz = _check_queries(num_tokens, queries)
    kernel = weight.shape[1]
    out = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    if bsz == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    cap = capture if capture is not None else state_pool
    block_c = 256
    _conv_verify_kernel[(bsz, triton.cdiv(channels, block_c))](
        x, weight, state_pool, slots, keep, out, cap, channels,
        x.stride(0), weight.stride(0), state_pool.stride(0), state_pool.stride(1), out.stride(0),
        cap.stride(0), cap.stride(1),
        QUERIES=queries, KERNEL=kernel, BLOCK_J=triton.next_power_of_2(kernel), BLOCK_C=block_c,
        SILU=activation in ("silu", "swish"), CAPTURE=capture is not None, **FP_FUSION,
    )
    return out

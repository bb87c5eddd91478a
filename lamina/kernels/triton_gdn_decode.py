"""The gated delta net's one-token decode in one Triton launch: causal conv update + SiLU, q/k L2
norm, gates from the raw projections, the delta-rule step and the gated RMSNorm, from the joint
in_proj output to the input of out_proj.

It replaces three launches of `lamina.kernels.triton_decode` / `triton_norm`: `causal_conv1d_decode`,
`gated_delta_rule_decode` (raw gates) and `gated_rms_norm`, and computes what they compute,
rounding where they round (the conv output and the delta-rule output are rounded to the
activations' dtype before the next stage reads them), so it agrees with them to float32 reduction
order (bitwise under Triton's interpreter).

Grid (request, v head), one program per pair with the whole `[Dk, Dv]` state tile (BLOCK_V = Dv:
the gated norm needs the head's whole output row). A program runs the conv for the q and k channels
of its key head and the v channels of its value head, so the GROUP = Hv / Hk programs of a key
head all read the same q/k conv state; its new value may be written only after every one of them
has read it. Each program, after its reads (`tl.debug_barrier()`: every thread's), takes a ticket
of its (request, key head) with an acq_rel atomic; the one that draws GROUP - 1 (the last reader)
writes the q/k conv state and resets the ticket to 0 (`tl.atomic_xchg`), so the next call and the
next graph replay start from zero (the pattern of `lamina.kernels.triton_moe_gemv`, whose ticket
buffer this shares: kernels on one stream run one after the other and each leaves it zeroed). The
v conv state and the recurrent state of a (request, v head) belong to its program alone.

Rows: a row whose `keep` is 0 starts from zero conv and recurrent state (nothing is read); a row
with a negative slot is padding (reads zeros, writes no state); padded rows of a captured batch may
instead point at a spare slot with keep = 0 (several such rows write it, nobody reads it). A row's
result depends on its own inputs and slot only (batch invariance). Launch shapes follow host ints
only and nothing syncs: capturable in a CUDA graph (tickets are sized on an eager call first).

Reference: `causal_conv1d_varlen` + `recurrent_gated_delta_rule_step` + `GatedRMSNorm` (torch), and
the three Triton kernels above (tests/test_triton_gdn_decode.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION
from lamina.kernels.triton_moe_gemv import _tickets

__all__ = ["fused_gdn_decode"]


@triton.jit
def _fused_gdn_decode_kernel(
    x_ptr, z_ptr, b_ptr, a_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    conv_state_ptr, ssm_state_ptr, slots_ptr, keep_ptr, ticket_ptr, out_ptr,
    num_k_heads, key_dim, scale, l2_eps, norm_eps,
    stride_xb, stride_zb, stride_bb, stride_ab, stride_wc, stride_cs, stride_cc,
    stride_ss, stride_sh, stride_sk, stride_ob,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    KERNEL: tl.constexpr, BLOCK_J: tl.constexpr, SILU_GATE: tl.constexpr,
):
    # Index math in int64 (what the slot offsets need anyway; it also spares Triton's interpreter
    # its overflow checks of int32 arithmetic, which made up much of this kernel's CPU test time).
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    k_head = head // GROUP
    dtype = out_ptr.dtype.element_ty  # the activations' dtype (x's)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    offs_v = tl.arange(0, BLOCK_V).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_J).to(tl.int64)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    slot = tl.load(slots_ptr + req).to(tl.int64)
    keep = tl.load(keep_ptr + req).to(tl.int64)
    live_k = (offs_k * 0 + slot) >= 0  # [K]: padding rows (slot < 0) read zeros and write no state
    live_v = (offs_v * 0 + slot) >= 0  # [V]
    use_k = live_k & ((offs_k * 0 + keep) != 0)  # [K]: keep = 0: fresh state, nothing read
    use_v = live_v & ((offs_v * 0 + keep) != 0)  # [V]
    slot = tl.maximum(slot, 0)

    # The recurrent state first: the largest load, in flight while the conv runs.
    s_ok = k_ok[:, None] & v_ok[None, :]
    s_ptrs = ssm_state_ptr + slot * stride_ss + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    state = tl.load(s_ptrs, mask=s_ok & use_v[None, :], other=0.0).to(tl.float32)  # [K, V]

    # Causal conv + SiLU of one token, as _conv_decode_kernel: seq = [state (K-1 inputs), x], tap j
    # reads seq[j]; the new state seq[1:K] is read as shifted loads (registers cannot be shifted
    # across lanes). The q and k channels of the key head as one [K, 2] tile (column 0 q, 1 k).
    x_row = x_ptr + req * stride_xb
    conv_row = conv_state_ptr + slot * stride_cs
    taps = offs_j[None, None, :]  # [1, 1, J]
    qk_chans = k_head * DK + offs_k[:, None] + tl.where(tl.arange(0, 2)[None, :] == 0, 0, key_dim)  # [K, 2]
    qk_ok = (qk_chans >= 0) & k_ok[:, None]  # [K, 2]
    qk_use = qk_ok & use_k[:, None]
    x_qk = tl.load(x_row + qk_chans, mask=qk_ok, other=0.0)  # [K, 2]
    qk_at = conv_row + qk_chans[:, :, None] * stride_cc + taps  # [K, 2, J]
    seq = tl.load(qk_at, mask=qk_use[:, :, None] & (taps < KERNEL - 1), other=0.0).to(tl.float32)
    seq = tl.where(taps == KERNEL - 1, x_qk[:, :, None].to(tl.float32), seq)
    w = tl.load(conv_w_ptr + qk_chans[:, :, None] * stride_wc + taps, mask=qk_ok[:, :, None] & (taps < KERNEL),
                other=0.0).to(tl.float32)
    y = tl.sum(seq * w, axis=2)  # [K, 2]
    y = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32)  # rounded as the conv kernel's output
    q, k = tl.split(y)  # [K] each
    qk_state = tl.load(qk_at + 1, mask=qk_use[:, :, None] & (taps + 1 < KERNEL - 1), other=0.0)
    qk_state = tl.where(taps + 1 == KERNEL - 1, x_qk[:, :, None].to(qk_state.dtype), qk_state)
    qk_store = (qk_ok & live_k[:, None])[:, :, None] & (taps < KERNEL - 1)
    # The v channels of this value head, [V, J].
    v_chans = 2 * key_dim + head * DV + offs_v  # [V]
    x_v = tl.load(x_row + v_chans, mask=v_ok, other=0.0)
    v_at = conv_row + v_chans[:, None] * stride_cc + offs_j[None, :]  # [V, J]
    seq = tl.load(v_at, mask=(v_ok & use_v)[:, None] & (offs_j[None, :] < KERNEL - 1), other=0.0).to(tl.float32)
    seq = tl.where(offs_j[None, :] == KERNEL - 1, x_v[:, None].to(tl.float32), seq)
    w = tl.load(conv_w_ptr + v_chans[:, None] * stride_wc + offs_j[None, :],
                mask=v_ok[:, None] & (offs_j[None, :] < KERNEL), other=0.0).to(tl.float32)
    v = tl.sum(seq * w, axis=1)  # [V]
    v = (v / (1.0 + tl.exp(-v))).to(dtype).to(tl.float32)
    v_state = tl.load(v_at + 1, mask=(v_ok & use_v)[:, None] & (offs_j[None, :] + 1 < KERNEL - 1), other=0.0)
    v_state = tl.where(offs_j[None, :] + 1 == KERNEL - 1, x_v[:, None].to(v_state.dtype), v_state)
    v_store = (v_ok & live_v)[:, None] & (offs_j[None, :] < KERNEL - 1)

    tl.debug_barrier()  # every thread has read the old states (conv and recurrent) before any is written
    if GROUP > 1:  # the q/k conv state is shared by the GROUP programs of the key head: the last reader writes it
        ticket = ticket_ptr + req * num_k_heads + k_head
        done = tl.atomic_add(ticket, 1, sem="acq_rel")  # release our reads, acquire the others'

    # Gates from the raw projections, as GatedDeltaNet._gates; the delta-rule step as _gdr_decode_kernel.
    q = q * tl.rsqrt(tl.sum(q * q) + l2_eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + l2_eps)
    a = tl.load(a_ptr + req * stride_ab + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
    g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + req * stride_bb + head).to(tl.float32)))
    state = state * tl.exp(g)
    delta = beta * (v - tl.sum(state * k[:, None], axis=0))  # [V]
    state = state + k[:, None] * delta[None, :]
    core = tl.sum(state * q[:, None], axis=0)  # [V]

    tl.store(s_ptrs, state, mask=s_ok & live_v[None, :])
    tl.store(v_at, v_state, mask=v_store)
    if GROUP > 1:
        if done == GROUP - 1:
            tl.store(qk_at, qk_state, mask=qk_store)
            tl.atomic_xchg(ticket, 0)  # ready for the next call (and the next graph replay)
    else:
        tl.store(qk_at, qk_state, mask=qk_store)

    # Gated RMSNorm of the head's row, as _gated_rms_norm_kernel: round(w * round(normed)) * act(z).
    core = tl.where(v_ok, core.to(dtype).to(tl.float32), 0.0)  # the delta rule's output dtype
    normed = (core * tl.rsqrt(tl.sum(core * core) / DV + norm_eps)).to(dtype)
    w = tl.load(norm_w_ptr + offs_v, mask=v_ok, other=0.0)
    normed = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype).to(tl.float32)
    gate = tl.load(z_ptr + req * stride_zb + head * DV + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    act = 1.0 / (1.0 + tl.exp(-gate))
    if SILU_GATE:
        act = gate * act
    tl.store(out_ptr + req * stride_ob + head * DV + offs_v, (normed * act).to(dtype), mask=v_ok)


def _num_warps(block_k: int, block_v: int) -> int:
    """About 32 state values per thread (fla's fused recurrent kernel: [128, 8] tiles, one warp):
    16 warps for a 128 x 128 tile. Not tuned on a GPU yet."""
    return max(1, min(16, block_k * block_v // 1024))


def fused_gdn_decode(
    x: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
    conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, *, num_k_heads: int,
    head_k_dim: int, norm_eps: float, activation: str = "silu", num_warps: int | None = None,
) -> torch.Tensor:
    """One decode token per request. x `[B, 2*Hk*Dk + Hv*Dv]` (the conv input: q, k, v channels),
    z `[B, Hv*Dv]`, b, a `[B, Hv]` (rows may be strided: slices of the joint in_proj output; unit
    last strides); conv_weight `[C, K]`; conv_state `[num_slots, C, K-1]` and ssm_state
    `[num_slots, Hv, Dk, Dv]` (float32, bfloat16 or float16; computed in float32), read at `slots [B]` (zeros
    where `keep[b]` is 0 or the slot is negative) and updated there in place; a_log, dt_bias `[Hv]`; norm_weight
    `[Dv]`; activation of the norm's gate: "silu" or "sigmoid". Returns `[B, Hv*Dv]` in x's dtype (out_proj's
    input)."""
    bsz, channels = x.shape
    num_v_heads = a.shape[1]
    key_dim = num_k_heads * head_k_dim
    value_dim = channels - 2 * key_dim
    head_v_dim = value_dim // num_v_heads
    kernel = conv_weight.shape[1]
    if num_v_heads % num_k_heads or value_dim != num_v_heads * head_v_dim or z.shape != (bsz, value_dim):
        raise ValueError(f"fused_gdn_decode: x {tuple(x.shape)}, z {tuple(z.shape)} do not fit Hk = {num_k_heads}, "
                         f"Dk = {head_k_dim}, Hv = {num_v_heads}")
    if conv_state.shape[1:] != (channels, kernel - 1) or ssm_state.shape[1:] != (num_v_heads, head_k_dim, head_v_dim):
        raise ValueError(f"fused_gdn_decode: state pools {tuple(conv_state.shape)}, {tuple(ssm_state.shape)} do not "
                         f"fit {channels} channels, kernel {kernel}, Hv = {num_v_heads}, Dk = {head_k_dim}")
    if activation not in ("silu", "sigmoid"):
        raise ValueError(f"fused_gdn_decode: gate activation {activation!r} is not one of 'silu', 'sigmoid'")
    if conv_state.stride(-1) != 1 or ssm_state.stride(-1) != 1:
        raise ValueError("fused_gdn_decode: the state pools need a unit last stride (they are updated in place)")
    out = torch.empty((bsz, value_dim), dtype=x.dtype, device=x.device)
    if bsz == 0:
        return out
    x, z, b, a = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, z, b, a))
    conv_weight = conv_weight.contiguous()
    group = num_v_heads // num_k_heads
    tickets = _tickets(x.device, bsz * num_k_heads) if group > 1 else slots  # (unused when GROUP = 1)
    block_k, block_v = triton.next_power_of_2(head_k_dim), triton.next_power_of_2(head_v_dim)
    _fused_gdn_decode_kernel[(bsz, num_v_heads)](
        x, z, b, a, conv_weight, a_log, dt_bias, norm_weight, conv_state, ssm_state, slots, keep, tickets, out,
        num_k_heads, key_dim, head_k_dim**-0.5, 1e-6, norm_eps,
        x.stride(0), z.stride(0), b.stride(0), a.stride(0), conv_weight.stride(0), conv_state.stride(0),
        conv_state.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), out.stride(0),
        GROUP=group, DK=head_k_dim, DV=head_v_dim, BLOCK_K=block_k, BLOCK_V=block_v, KERNEL=kernel,
        BLOCK_J=triton.next_power_of_2(kernel), SILU_GATE=activation == "silu",
        num_warps=num_warps or _num_warps(block_k, block_v), **FP_FUSION,
    )
    return out

"""The gated delta net's one-token decode in one or two Triton launches: causal conv update + SiLU,
q/k L2 norm, gates from the raw projections, the delta-rule step (and the gated RMSNorm), from the
joint in_proj output to the input of out_proj.

`fused_gdn_decode` replaces three launches of `lamina.kernels.triton_decode` / `triton_norm`:
`causal_conv1d_decode`, `gated_delta_rule_decode` (raw gates) and `gated_rms_norm`;
`conv_delta_rule_decode` the first two (the gated norm stays a launch of its own). Both compute
what those kernels compute, rounding where they round (the conv output and the delta-rule output
are rounded to the activations' dtype before the next stage reads them), so they agree with them
to float32 reduction order (bitwise under Triton's interpreter).

Grid (request, v head, block of the head's Dv values). `fused_gdn_decode` runs one block per head
with the whole `[Dk, Dv]` state tile (the gated norm needs the head's whole output row);
`conv_delta_rule_decode` spreads a head over `Dv / block_v` programs, as the delta-rule kernel
does. A program runs the conv for the q and k channels of its key head and the v channels of its
block, so the READERS = (Hv / Hk) x blocks programs of a key head all read the same q/k conv state;
its new value may be written only after every one of them has read it. Each program, after its
reads (`tl.debug_barrier()`: every thread's), takes a ticket of its (request, key head) with an
acq_rel atomic; the one that draws READERS - 1 (the last reader) writes the q/k conv state and
resets the ticket to 0 (`tl.atomic_xchg`), so the next call and the next graph replay start from
zero (the pattern of `lamina.kernels.triton_moe_gemv`, whose ticket buffer this shares: kernels on
one stream run one after the other and each leaves it zeroed). The v conv state and the recurrent
state of a (request, v head, block) belong to its program alone. With programmatic dependent launch
(lamina.kernels.pdl) both states and the conv weights are read before the wait for the in_proj
GEMV: a layer's states were last written by its previous step.

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

from lamina.kernels.pdl import pdl_kwargs, wait_for_producer
from lamina.kernels.triton_moe_gemv import _tickets

__all__ = ["conv_delta_rule_decode", "fused_gdn_decode"]


@triton.jit
def _fused_gdn_decode_kernel(
    x_ptr, z_ptr, b_ptr, a_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    conv_state_ptr, ssm_state_ptr, slots_ptr, keep_ptr, ticket_ptr, out_ptr,
    num_k_heads, key_dim, scale, l2_eps, norm_eps,
    stride_xb, stride_zb, stride_bb, stride_ab, stride_wc, stride_cs, stride_cc,
    stride_ss, stride_sh, stride_sk, stride_ob,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    V_BLOCKS: tl.constexpr, KERNEL: tl.constexpr, BLOCK_J: tl.constexpr, SILU_GATE: tl.constexpr,
    NORM: tl.constexpr, PDL: tl.constexpr,
):
    # Index math in int64 (what the slot offsets need anyway; it also spares Triton's interpreter
    # its overflow checks of int32 arithmetic, which made up much of this kernel's CPU test time).
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    v_block = tl.program_id(2).to(tl.int64)
    k_head = head // GROUP
    dtype = out_ptr.dtype.element_ty  # the activations' dtype (x's)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
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

    # Read before the wait for the producer of x (lamina.kernels.pdl): the slots are step metadata,
    # the conv weights are weights, and both state pools were last written by this layer's previous
    # step, never by the kernel just before this one (the in_proj GEMV). The recurrent state first:
    # the largest load.
    s_ok = k_ok[:, None] & v_ok[None, :]
    s_ptrs = ssm_state_ptr + slot * stride_ss + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    state = tl.load(s_ptrs, mask=s_ok & use_v[None, :], other=0.0)  # [K, V] float32
    # Causal conv + SiLU of one token, as _conv_decode_kernel: seq = [state (K-1 inputs), x], tap j
    # reads seq[j]; the new state seq[1:K] is read as shifted loads (registers cannot be shifted
    # across lanes). The q and k channels of the key head as one [K, 2] tile (column 0 q, 1 k).
    x_row = x_ptr + req * stride_xb
    conv_row = conv_state_ptr + slot * stride_cs
    taps = offs_j[None, None, :]  # [1, 1, J]
    qk_chans = k_head * DK + offs_k[:, None] + tl.where(tl.arange(0, 2)[None, :] == 0, 0, key_dim)  # [K, 2]
    qk_ok = (qk_chans >= 0) & k_ok[:, None]  # [K, 2]
    qk_use = qk_ok & use_k[:, None]
    qk_at = conv_row + qk_chans[:, :, None] * stride_cc + taps  # [K, 2, J]
    qk_seq = tl.load(qk_at, mask=qk_use[:, :, None] & (taps < KERNEL - 1), other=0.0).to(tl.float32)
    qk_w = tl.load(conv_w_ptr + qk_chans[:, :, None] * stride_wc + taps, mask=qk_ok[:, :, None] & (taps < KERNEL),
                   other=0.0).to(tl.float32)
    qk_state = tl.load(qk_at + 1, mask=qk_use[:, :, None] & (taps + 1 < KERNEL - 1), other=0.0)
    qk_store = (qk_ok & live_k[:, None])[:, :, None] & (taps < KERNEL - 1)
    # The v channels of this program's block of the value head, [V, J].
    v_chans = 2 * key_dim + head * DV + offs_v  # [V]
    v_at = conv_row + v_chans[:, None] * stride_cc + offs_j[None, :]  # [V, J]
    v_seq = tl.load(v_at, mask=(v_ok & use_v)[:, None] & (offs_j[None, :] < KERNEL - 1), other=0.0).to(tl.float32)
    v_w = tl.load(conv_w_ptr + v_chans[:, None] * stride_wc + offs_j[None, :],
                  mask=v_ok[:, None] & (offs_j[None, :] < KERNEL), other=0.0).to(tl.float32)
    v_state = tl.load(v_at + 1, mask=(v_ok & use_v)[:, None] & (offs_j[None, :] + 1 < KERNEL - 1), other=0.0)
    v_store = (v_ok & live_v)[:, None] & (offs_j[None, :] < KERNEL - 1)
    wait_for_producer(PDL)
    x_qk = tl.load(x_row + qk_chans, mask=qk_ok, other=0.0)  # [K, 2]
    seq = tl.where(taps == KERNEL - 1, x_qk[:, :, None].to(tl.float32), qk_seq)
    y = tl.sum(seq * qk_w, axis=2)  # [K, 2]
    y = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32)  # rounded as the conv kernel's output
    q, k = tl.split(y)  # [K] each
    qk_state = tl.where(taps + 1 == KERNEL - 1, x_qk[:, :, None].to(qk_state.dtype), qk_state)
    x_v = tl.load(x_row + v_chans, mask=v_ok, other=0.0)
    seq = tl.where(offs_j[None, :] == KERNEL - 1, x_v[:, None].to(tl.float32), v_seq)
    v = tl.sum(seq * v_w, axis=1)  # [V]
    v = (v / (1.0 + tl.exp(-v))).to(dtype).to(tl.float32)
    v_state = tl.where(offs_j[None, :] + 1 == KERNEL - 1, x_v[:, None].to(v_state.dtype), v_state)

    tl.debug_barrier()  # every thread has read the old states (conv and recurrent) before any is written
    if GROUP * V_BLOCKS > 1:  # the key head's q/k conv state is shared by its programs: the last reader writes it
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
    if GROUP * V_BLOCKS > 1:
        if done == GROUP * V_BLOCKS - 1:
            tl.store(qk_at, qk_state, mask=qk_store)
            tl.atomic_xchg(ticket, 0)  # ready for the next call (and the next graph replay)
    else:
        tl.store(qk_at, qk_state, mask=qk_store)

    if NORM:  # the gated RMSNorm of the head's row, as _gated_rms_norm_kernel: round(w * round(normed)) * act(z)
        core = tl.where(v_ok, core.to(dtype).to(tl.float32), 0.0)  # the delta rule's output dtype
        normed = (core * tl.rsqrt(tl.sum(core * core) / DV + norm_eps)).to(dtype)
        w = tl.load(norm_w_ptr + offs_v, mask=v_ok, other=0.0)
        normed = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype).to(tl.float32)
        gate = tl.load(z_ptr + req * stride_zb + head * DV + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        act = 1.0 / (1.0 + tl.exp(-gate))
        if SILU_GATE:
            act = gate * act
        tl.store(out_ptr + req * stride_ob + head * DV + offs_v, (normed * act).to(dtype), mask=v_ok)
    else:  # this program's block of the head's row: the delta rule's output (the gated norm runs after)
        tl.store(out_ptr + req * stride_ob + head * DV + offs_v, core.to(dtype), mask=v_ok)

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
    `[num_slots, Hv, Dk, Dv]` float32, read at `slots [B]` (zeros where `keep[b]` is 0 or the slot
    is negative) and updated there in place; a_log, dt_bias `[Hv]`; norm_weight `[Dv]`; activation
    of the norm's gate: "silu" or "sigmoid". Returns `[B, Hv*Dv]` in x's dtype (out_proj's input)."""
    if activation not in ("silu", "sigmoid"):
        raise ValueError(f"fused_gdn_decode: gate activation {activation!r} is not one of 'silu', 'sigmoid'")
    bsz, value_dim = z.shape
    if x.shape[0] != bsz:
        raise ValueError(f"fused_gdn_decode: x {tuple(x.shape)} and z {tuple(z.shape)} have different rows")
    return _launch(x, b, a, conv_weight, conv_state, ssm_state, slots, keep, a_log, dt_bias, num_k_heads, head_k_dim,
                   (z, norm_weight, norm_eps, activation), None, num_warps).reshape(bsz, value_dim)


def conv_delta_rule_decode(
    x: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
    ssm_state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
    *, num_k_heads: int, head_k_dim: int, block_v: int = 32, num_warps: int | None = None,
) -> torch.Tensor:
    """`fused_gdn_decode` without the gated norm: causal conv, gates and the delta-rule step of one
    token per request in one launch, each value head over `ceil(Dv / block_v)` programs (as the
    delta-rule kernel spreads it), what `causal_conv1d_decode` then `gated_delta_rule_decode` (raw
    gates) compute. Returns the delta rule's output `[B, Hv, Dv]` in x's dtype."""
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"conv_delta_rule_decode: block_v = {block_v} must be a power of two")
    return _launch(x, b, a, conv_weight, conv_state, ssm_state, slots, keep, a_log, dt_bias, num_k_heads, head_k_dim,
                   None, block_v, num_warps)


def _launch(x, b, a, conv_weight, conv_state, ssm_state, slots, keep, a_log, dt_bias, num_k_heads, head_k_dim,
            norm, block_v, num_warps):
    """The kernel on `[B, Hv, Dv]` output rows: with `norm = (z, weight, eps, activation)` one
    program per head (the norm needs its whole row), else `block_v`-wide blocks of each head."""
    bsz, channels = x.shape
    num_v_heads = a.shape[1]
    key_dim = num_k_heads * head_k_dim
    value_dim = channels - 2 * key_dim
    head_v_dim = value_dim // num_v_heads
    kernel = conv_weight.shape[1]
    if num_v_heads % num_k_heads or value_dim != num_v_heads * head_v_dim or b.shape != a.shape or a.shape[0] != bsz:
        raise ValueError(f"gated delta net decode: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} do "
                         f"not fit Hk = {num_k_heads}, Dk = {head_k_dim}")
    if norm is not None and norm[0].shape != (bsz, value_dim):
        raise ValueError(f"gated delta net decode: z {tuple(norm[0].shape)} is not [{bsz}, {value_dim}]")
    if conv_state.shape[1:] != (channels, kernel - 1) or ssm_state.shape[1:] != (num_v_heads, head_k_dim, head_v_dim):
        raise ValueError(f"gated delta net decode: state pools {tuple(conv_state.shape)}, {tuple(ssm_state.shape)} "
                         f"do not fit {channels} channels, kernel {kernel}, Hv = {num_v_heads}, Dk = {head_k_dim}")
    if conv_state.stride(-1) != 1 or ssm_state.stride(-1) != 1:
        raise ValueError("gated delta net decode: the state pools need a unit last stride (they are updated in place)")
    out = torch.empty((bsz, num_v_heads, head_v_dim), dtype=x.dtype, device=x.device)  # [B, Hv, Dv]
    if bsz == 0:
        return out
    x, b, a = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, b, a))
    z, norm_weight, norm_eps, activation = norm if norm is not None else (x, a_log, 0.0, "silu")  # (unused: no norm)
    z = z if z.stride(-1) == 1 else z.contiguous()
    conv_weight = conv_weight.contiguous()
    block_k = triton.next_power_of_2(head_k_dim)
    block_v = triton.next_power_of_2(head_v_dim) if norm is not None else min(block_v, triton.next_power_of_2(head_v_dim))
    v_blocks = triton.cdiv(head_v_dim, block_v)
    readers = num_v_heads // num_k_heads * v_blocks  # programs reading a key head's q/k conv state
    tickets = _tickets(x.device, bsz * num_k_heads) if readers > 1 else slots  # (unused with one reader)
    _fused_gdn_decode_kernel[(bsz, num_v_heads, v_blocks)](
        x, z, b, a, conv_weight, a_log, dt_bias, norm_weight, conv_state, ssm_state, slots, keep, tickets, out,
        num_k_heads, key_dim, head_k_dim**-0.5, 1e-6, norm_eps,
        x.stride(0), z.stride(0), b.stride(0), a.stride(0), conv_weight.stride(0), conv_state.stride(0),
        conv_state.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), head_v_dim * num_v_heads,
        GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim, BLOCK_K=block_k, BLOCK_V=block_v,
        V_BLOCKS=v_blocks, KERNEL=kernel, BLOCK_J=triton.next_power_of_2(kernel), SILU_GATE=activation == "silu",
        NORM=norm is not None, **pdl_kwargs(x.device), num_warps=num_warps or _num_warps(block_k, block_v),
    )
    return out

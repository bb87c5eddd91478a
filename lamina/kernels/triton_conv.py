"""Triton causal conv1d for prefill and mixed steps: a flat varlen batch, the rolling input state
read from and written back to the conv-state pool at the requests' slots, SiLU fused.

Reference: `lamina.kernels.causal_conv1d.causal_conv1d_varlen` (dilation 1, no capture), whose
docstring defines the operation. Request b's sequence is [state (S = K-1 inputs), its tokens]:

    y_t[c] = sum_{j<K} weight[c, j] * seq[c, i + j]      (i: token t's offset inside its request)
    seq[m] = state[slot_b, c, m] (zero for a fresh request) if m < S, else x[start_b + m - S]

and the new state is seq[n_b : n_b + S] (n_b: the request's token count; part of the old state
survives when n_b < S). Two launches on one stream: the first computes every output from the old
state, the second (one program per request and channel block) writes the new state once every
output has read the old one. Tested against the reference under Triton's CPU interpreter
(`TRITON_INTERPRET=1`) at tiny shapes in CI, and on CUDA on the GPU machine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["causal_conv1d_prefill"]

# (tokens, channels) per program of the output kernel (benchmarks/bench_prefill_kernels.py sweeps it)
CONV_PREFILL_TILE = (32, 128)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for every step size (triton_moe.COUNT_ARGS says why)
def _conv_prefill_out_kernel(
    x_ptr, w_ptr, state_ptr, qsl_ptr, req_ptr, slots_ptr, keep_ptr, out_ptr, num_tokens, channels,
    stride_xt, stride_wc, stride_ss, stride_sc, stride_ot, split_1, split_2,
    KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr,
    SPLIT: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] flat tokens (int64 offsets)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC] channels
    t_ok = offs_t < num_tokens
    c_ok = offs_c < channels
    req = tl.load(req_ptr + offs_t, mask=t_ok, other=0)  # [BT] request of each token
    start = tl.load(qsl_ptr + req, mask=t_ok, other=0)
    slot = tl.load(slots_ptr + req, mask=t_ok, other=0)
    keep = tl.load(keep_ptr + req, mask=t_ok, other=0) != 0
    offset = offs_t - start  # [BT] offset inside the request
    tile_ok = t_ok[:, None] & c_ok[None, :]  # [BT, BC]
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(KERNEL):
        m = offset + j  # [BT] position in [state, tokens]
        from_x = m >= KERNEL - 1
        xv = tl.load(x_ptr + (offs_t + j - (KERNEL - 1))[:, None] * stride_xt + offs_c[None, :],
                     mask=tile_ok & from_x[:, None], other=0.0).to(tl.float32)  # [BT, BC]
        sv = tl.load(state_ptr + slot[:, None] * stride_ss + offs_c[None, :] * stride_sc + m[:, None],
                     mask=tile_ok & (~from_x & keep)[:, None], other=0.0).to(tl.float32)  # [BT, BC]
        w = tl.load(w_ptr + offs_c * stride_wc + j, mask=c_ok, other=0.0).to(tl.float32)  # [BC]
        acc += (xv + sv) * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    if SPLIT:  # three row-major parts [T, split_1], [T, split_2 - split_1], [T, C - split_2], one after the other
        part_start = tl.where(offs_c >= split_2, split_2, tl.where(offs_c >= split_1, split_1, 0))  # [BC]
        part_end = tl.where(offs_c >= split_2, channels, tl.where(offs_c >= split_1, split_2, split_1))  # [BC]
        base = part_start.to(tl.int64) * num_tokens + (offs_c - part_start)  # [BC]
        dest = base[None, :] + offs_t[:, None] * (part_end - part_start).to(tl.int64)[None, :]  # [BT, BC]
    else:
        dest = offs_t[:, None] * stride_ot + offs_c[None, :]
    tl.store(out_ptr + dest, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _conv_prefill_state_kernel(
    x_ptr, state_ptr, qsl_ptr, slots_ptr, keep_ptr, channels,
    stride_xt, stride_ss, stride_sc,
    STATE_LEN: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    req = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    offs_s = tl.arange(0, BLOCK_S)  # [BS] entries of the new state
    start = tl.load(qsl_ptr + req).to(tl.int64)
    length = tl.load(qsl_ptr + req + 1) - start
    slot = tl.load(slots_ptr + req)
    keep = tl.load(keep_ptr + req) != 0
    m = length + offs_s  # [BS] position in [old state, tokens] of new-state entry s
    from_x = m >= STATE_LEN
    tile_ok = (offs_c < channels)[:, None] & (offs_s < STATE_LEN)[None, :]  # [BC, BS]
    row = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc  # [BC, 1]
    xv = tl.load(x_ptr + (start + m - STATE_LEN)[None, :] * stride_xt + offs_c[:, None],
                 mask=tile_ok & from_x[None, :], other=0.0)  # [BC, BS]
    sv = tl.load(row + m[None, :], mask=tile_ok & (~from_x)[None, :], other=0.0)  # [BC, BS]
    sv = tl.where(keep, sv, tl.zeros_like(sv))  # a fresh request starts from zeros
    new = tl.where(from_x[None, :], xv.to(sv.dtype), sv)
    tl.debug_barrier()  # every lane has read the old state before any writes it
    tl.store(row + offs_s[None, :], new, mask=tile_ok)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_request_index: torch.Tensor | None = None,
    activation: str | None = "silu",
    split: tuple[int, int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over a flat varlen batch, conv state in the pool, in place.

    Args:
        x: `[T, C]` (rows may be strided; unit last stride); weight: `[C, K]` (no bias);
        state_pool: `[num_slots, C, K-1]`: request b starts from `state_pool[slots[b]]` (zeros where
            `keep[b]` is False) and its new state (the last K-1 inputs of [state, tokens]) is
            written back there; slots: `[B]` long; keep: `[B]` bool;
        query_start_loc: `[B+1]` cumulative query lengths (requests may have no tokens);
        token_request_index: optional `[T]` request of each token (computed when absent);
        activation: "silu" / "swish" or None;
        split: optional channel counts (C1, C2, C3) summing to C: the output comes as three
            contiguous tensors `[T, C1]`, `[T, C2]`, `[T, C3]` (the delta net's q, k, v, which
            fla-core would otherwise copy to make contiguous) instead of one `[T, C]`.

    Returns:
        `[T, C]` in x's dtype, or the three parts with `split`.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    num_reqs = slots.shape[0]
    if state_pool.stride(-1) != 1:
        raise ValueError("state_pool needs a unit last stride")
    if state_pool.shape[-1] != kernel - 1:
        raise ValueError(f"state_pool holds {state_pool.shape[-1]} inputs per channel, expected K-1 = {kernel - 1}")
    if split is not None and (len(split) != 3 or sum(split) != channels or min(split) < 0):
        raise ValueError(f"split {split} must be three channel counts summing to C = {channels}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    flat = torch.empty(num_tokens * channels, dtype=x.dtype, device=x.device)  # [T*C]: one [T, C], or the parts
    out = flat.view(num_tokens, channels)  # [T, C]
    if num_tokens > 0:
        if token_request_index is None:  # request of each token: the number of request ends <= t
            tokens = torch.arange(num_tokens, device=x.device, dtype=query_start_loc.dtype)  # [T]
            token_request_index = torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)  # [T]
        block_t, block_c = CONV_PREFILL_TILE
        _conv_prefill_out_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))](
            x, weight, state_pool, query_start_loc, token_request_index, slots, keep, out, num_tokens, channels,
            x.stride(0), weight.stride(0), state_pool.stride(0), state_pool.stride(1), out.stride(0),
            *((split[0], split[0] + split[1]) if split is not None else (0, 0)),
            KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c, SILU=activation is not None, SPLIT=split is not None,
        )
    if num_reqs > 0 and kernel > 1:
        block_c = 256
        _conv_prefill_state_kernel[(num_reqs, triton.cdiv(channels, block_c))](
            x, state_pool, query_start_loc, slots, keep, channels,
            x.stride(0), state_pool.stride(0), state_pool.stride(1),
            STATE_LEN=kernel - 1, BLOCK_S=max(2, triton.next_power_of_2(kernel - 1)), BLOCK_C=block_c,
        )
    if split is None:
        return out
    first, second, _ = split
    return (flat[: num_tokens * first].view(num_tokens, first),  # [T, C1]
            flat[num_tokens * first : num_tokens * (first + second)].view(num_tokens, second),  # [T, C2]
            flat[num_tokens * (first + second):].view(num_tokens, channels - first - second))  # [T, C3]

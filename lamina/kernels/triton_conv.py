"""Triton causal conv1d for prefill and mixed steps: a flat varlen batch, the rolling input state
read from and written back to the conv-state pool at the requests' slots, SiLU fused.

Reference: `lamina.kernels.causal_conv1d.causal_conv1d_varlen` (dilation 1, no capture), whose
docstring defines the operation. Request b's sequence is [state (S = K-1 inputs), its tokens]:

    y_t[c] = sum_{j<K} weight[c, j] * seq[c, i + j]      (i: token t's offset inside its request)
    seq[m] = state[slot_b, c, m] (zero for a fresh request) if m < S, else x[start_b + m - S]

and the new state is seq[n_b : n_b + S] (n_b: the request's token count; part of the old state
survives when n_b < S). Two launches on one stream: the body kernel computes the outputs of every
token at offset >= S inside its request, whose K inputs are all tokens of that request (no state
read, no boundary test per input); the edge kernel, one program per request and channel block,
computes the request's first S outputs from the old state and then writes the new state. On an
H200 at 8k tokens and the delta net's 8,192 channels this took 114 us against 336 us for one
kernel that read the state for every tap (session 8's, removed; bitwise-equal outputs,
benchmarks/results/bench_prefill_kernels_session9_h200.json). Tested against the reference under
Triton's CPU interpreter (`TRITON_INTERPRET=1`) at tiny shapes in CI, and on CUDA on the GPU machine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.launch_options import FP_FUSION

__all__ = ["causal_conv1d_prefill"]

# (tokens, channels) and warps per program of the body kernel (benchmarks/bench_prefill_kernels.py sweeps them;
# best of 24 on an H200, bench_prefill_kernels_session9_h200.json)
CONV_PREFILL_TILE = (32, 128)
CONV_PREFILL_WARPS = 4


@triton.jit
def _out_offsets(offs_t, offs_c, num_tokens, channels, stride_ot, split_1, split_2, SPLIT: tl.constexpr):
    """[BT, BC] element offsets of outputs: one row-major [T, C], or (SPLIT) three row-major parts
    [T, split_1], [T, split_2 - split_1], [T, C - split_2] one after the other."""
    if SPLIT:
        part_start = tl.where(offs_c >= split_2, split_2, tl.where(offs_c >= split_1, split_1, 0))  # [BC]
        part_end = tl.where(offs_c >= split_2, channels, tl.where(offs_c >= split_1, split_2, split_1))  # [BC]
        base = part_start.to(tl.int64) * num_tokens + (offs_c - part_start)  # [BC]
        return base[None, :] + offs_t[:, None] * (part_end - part_start).to(tl.int64)[None, :]  # [BT, BC]
    return offs_t[:, None] * stride_ot + offs_c[None, :]


@triton.jit(do_not_specialize=["num_tokens"])
def _conv_prefill_body_kernel(
    x_ptr, w_ptr, qsl_ptr, req_ptr, out_ptr, num_tokens, channels, stride_xt, stride_wc, stride_ot, split_1, split_2,
    KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] flat tokens (int64 offsets)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC] channels
    t_ok = offs_t < num_tokens
    c_ok = offs_c < channels
    req = tl.load(req_ptr + offs_t, mask=t_ok, other=0)  # [BT] request of each token
    start = tl.load(qsl_ptr + req, mask=t_ok, other=0)
    body = t_ok & (offs_t - start >= KERNEL - 1)  # [BT] every input is a token of the same request
    tile_ok = body[:, None] & c_ok[None, :]  # [BT, BC]
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(KERNEL):
        xv = tl.load(x_ptr + (offs_t + j - (KERNEL - 1))[:, None] * stride_xt + offs_c[None, :],
                     mask=tile_ok, other=0.0).to(tl.float32)  # [BT, BC]
        w = tl.load(w_ptr + offs_c * stride_wc + j, mask=c_ok, other=0.0).to(tl.float32)  # [BC]
        acc += xv * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    dest = _out_offsets(offs_t, offs_c, num_tokens, channels, stride_ot, split_1, split_2, SPLIT)  # [BT, BC]
    tl.store(out_ptr + dest, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _conv_prefill_edge_kernel(
    x_ptr, w_ptr, state_ptr, qsl_ptr, slots_ptr, keep_ptr, out_ptr, num_tokens, channels,
    stride_xt, stride_wc, stride_ss, stride_sc, stride_ot, split_1, split_2,
    KERNEL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr,
):
    STATE_LEN: tl.constexpr = KERNEL - 1
    req = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    offs_s = tl.arange(0, BLOCK_S)  # [BS] the request's first tokens; entries of the new state
    c_ok = offs_c < channels
    start = tl.load(qsl_ptr + req).to(tl.int64)
    length = tl.load(qsl_ptr + req + 1) - start
    slot = tl.load(slots_ptr + req).to(tl.int64)
    keep = tl.load(keep_ptr + req) != 0
    row = state_ptr + slot * stride_ss + offs_c[None, :] * stride_sc  # [1, BC]
    # outputs of tokens 0 .. min(S, length) - 1: inputs m = i + j of [old state, tokens]
    head_ok = ((offs_s < STATE_LEN) & (offs_s < length))[:, None] & c_ok[None, :]  # [BS, BC]
    acc = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
    for j in tl.static_range(KERNEL):
        m = offs_s + j  # [BS]
        from_x = (m >= STATE_LEN)[:, None]  # [BS, 1]
        xv = tl.load(x_ptr + (start + m - STATE_LEN)[:, None] * stride_xt + offs_c[None, :],
                     mask=head_ok & from_x, other=0.0).to(tl.float32)  # [BS, BC]
        sv = tl.load(row + m[:, None], mask=head_ok & (~from_x), other=0.0).to(tl.float32)  # [BS, BC]
        sv = tl.where(keep, sv, tl.zeros_like(sv))  # a fresh request starts from zeros
        w = tl.load(w_ptr + offs_c * stride_wc + j, mask=c_ok, other=0.0).to(tl.float32)  # [BC]
        acc += (xv + sv) * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    dest = _out_offsets(start + offs_s, offs_c, num_tokens, channels, stride_ot, split_1, split_2, SPLIT)  # [BS, BC]
    tl.store(out_ptr + dest, acc.to(out_ptr.dtype.element_ty), mask=head_ok)
    # the new state: entry s is input m = length + s of [old state, tokens]
    m = length + offs_s  # [BS]
    from_x = (m >= STATE_LEN)[:, None]  # [BS, 1]
    state_ok = (offs_s < STATE_LEN)[:, None] & c_ok[None, :]  # [BS, BC]
    xv = tl.load(x_ptr + (start + m - STATE_LEN)[:, None] * stride_xt + offs_c[None, :],
                 mask=state_ok & from_x, other=0.0)  # [BS, BC]
    sv = tl.load(row + m[:, None], mask=state_ok & (~from_x), other=0.0)  # [BS, BC]
    sv = tl.where(keep, sv, tl.zeros_like(sv))  # a fresh request starts from zeros
    new = tl.where(from_x, xv.to(sv.dtype), sv)
    tl.debug_barrier()  # every lane has read the old state before any writes it
    tl.store(row + offs_s[:, None], new, mask=state_ok)


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
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over a flat varlen batch, conv state in the pool, in place.

    Args:
        x: `[T, C]` (rows may be strided; unit last stride); weight: `[C, K]` (no bias);
        state_pool: `[num_slots, C, K-1]`: request b starts from `state_pool[slots[b]]` (zeros where
            `keep[b]` is False) and its new state (the last K-1 inputs of [state, tokens]) is
            written back there; slots: `[B]` long, distinct (the edge kernel of one request writes
            its slot while another's could still read it); keep: `[B]` bool;
        query_start_loc: `[B+1]` cumulative query lengths (requests may have no tokens);
        token_request_index: optional `[T]` request of each token (computed when absent);
        activation: "silu" / "swish" or None;
        split: optional channel counts (C1, C2, C3) summing to C: the output comes as three
            contiguous tensors `[T, C1]`, `[T, C2]`, `[T, C3]` (the delta net's q, k, v, which
            fla-core would otherwise copy to make contiguous) instead of one `[T, C]`.
        tile: (tokens, channels, warps) per program of the body kernel (default CONV_PREFILL_TILE,
            CONV_PREFILL_WARPS), for benchmarks/bench_prefill_kernels.py's sweep.

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
    splits = (split[0], split[0] + split[1]) if split is not None else (0, 0)  # the parts' first channels
    if num_tokens > 0:
        if token_request_index is None:  # request of each token: the number of request ends <= t
            tokens = torch.arange(num_tokens, device=x.device, dtype=query_start_loc.dtype)  # [T]
            token_request_index = torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)  # [T]
        block_t, block_c, warps = tile or (*CONV_PREFILL_TILE, CONV_PREFILL_WARPS)
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))
        _conv_prefill_body_kernel[grid](
            x, weight, query_start_loc, token_request_index, out, num_tokens, channels,
            x.stride(0), weight.stride(0), out.stride(0), *splits,
            KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c, SILU=activation is not None,
            SPLIT=split is not None, num_warps=warps, **FP_FUSION,
        )
    if num_reqs > 0 and kernel > 1:  # the first S outputs of every request, then its new state
        block_c = 256
        _conv_prefill_edge_kernel[(num_reqs, triton.cdiv(channels, block_c))](
            x, weight, state_pool, query_start_loc, slots, keep, out, num_tokens, channels,
            x.stride(0), weight.stride(0), state_pool.stride(0), state_pool.stride(1), out.stride(0), *splits,
            KERNEL=kernel, BLOCK_S=max(2, triton.next_power_of_2(kernel - 1)), BLOCK_C=block_c,
            SILU=activation is not None, SPLIT=split is not None, **FP_FUSION,
        )
    if split is None:
        return out
    first, second, _ = split
    return (flat[: num_tokens * first].view(num_tokens, first),  # [T, C1]
            flat[num_tokens * first : num_tokens * (first + second)].view(num_tokens, second),  # [T, C2]
            flat[num_tokens * (first + second):].view(num_tokens, channels - first - second))  # [T, C3]

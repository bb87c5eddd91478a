"""Gated delta rule (the linear-attention core of Qwen3-Next / Qwen3.5 GatedDeltaNet).

Per value head, the state S is a `[Dk, Dv]` matrix. For each token t:

    S   <- exp(g_t) * S
    u_t  = beta_t * (v_t - S^T k_t)          # the correction the state still needs
    S   <- S + k_t u_t^T
    o_t  = S^T q_t

with q (after the optional l2norm) scaled by Dk**-0.5.

Chunked form. Inside a chunk of C tokens starting from state S0, let gam_r be the
cumulative log decay up to position r (inclusive) and D[r, s] = exp(gam_r - gam_s) for
s <= r. Unrolling the recurrence,

    u_r = beta_r (v_r - exp(gam_r) S0^T k_r - sum_{s<r} D[r, s] (k_r . k_s) u_s)

so with A[r, s] = beta_r D[r, s] (k_r . k_s) for s < r (strictly lower triangular),

    (I + A) U = beta*V - (beta*exp(gam)*K) S0
    U = T0 - W S0,   T0 = (I + A)^-1 (beta*V),   W = (I + A)^-1 (beta*exp(gam)*K)

and then

    O   = (exp(gam)*Q) S0 + (tril(Q K^T) * D) U
    S_C = exp(gam_C) S0 + (exp(gam_C - gam)*K)^T U.

T0, W and the intra-chunk scores only depend on the chunk's own tokens, so they are computed
for all chunks at once; only the short scan over chunks is sequential. All exponents are
<= 0 (g <= 0), so nothing overflows.

The state after an inner position c of a chunk (needed to roll back rejected speculative
tokens) follows the same way: S_c = exp(gam_c) S0 + (D[c, :] * K)^T U, which only reads the
chunk's start state and U. `capture=(req [R], offset [R])` returns it for chosen tokens; an
optional third entry, a host int bounding the offsets, keeps only the chunks that hold them
(verification offsets are small, so a long prefill in the same batch costs nothing extra).
"""

from __future__ import annotations

import torch

from lamina.kernels.request_groups import check_group_capture
from lamina.kernels.varlen import flat_positions, from_padded, padded_index, to_padded

__all__ = [
    "chunk_gated_delta_rule_varlen",
    "recurrent_gated_delta_rule_step",
    "gated_delta_rule_varlen",
]

_L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32, optional l2norm, q scaled by Dk**-0.5, heads repeated up to Hv.

    q, k: `[N, Hk, Dk]` -> `[N, Hv, Dk]` (value head h reads key head h // (Hv // Hk)).
    """
    num_k_heads, head_k_dim = k.shape[-2:]
    if num_v_heads % num_k_heads != 0:
        raise ValueError(f"Hv={num_v_heads} is not a multiple of Hk={num_k_heads}")
    q = q.float()
    k = k.float()
    if use_qk_l2norm:
        q = _l2norm(q)
        k = _l2norm(k)
    q = q * head_k_dim**-0.5
    group = num_v_heads // num_k_heads
    if group > 1:
        q = q.repeat_interleave(group, dim=-2)  # [N, Hv, Dk]
        k = k.repeat_interleave(group, dim=-2)  # [N, Hv, Dk]
    return q, k


def recurrent_gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request.

    Args:
        q, k: `[B, Hk, Dk]`; v: `[B, Hv, Dv]`; g, beta: `[B, Hv]`;
        state: `[B, Hv, Dk, Dv]` float32 (not modified).

    Returns:
        out `[B, Hv, Dv]` in v's dtype, new_state `[B, Hv, Dk, Dv]` float32.
    """
    num_v_heads = v.shape[1]
    qf, kf = _prepare_qk(q, k, num_v_heads, use_qk_l2norm)  # [B, Hv, Dk]
    vf = v.float()
    s = state.float() * g.float().exp()[:, :, None, None]  # [B, Hv, Dk, Dv]
    predicted = torch.einsum("bhkv,bhk->bhv", s, kf)  # [B, Hv, Dv]
    delta = beta.float()[:, :, None] * (vf - predicted)  # [B, Hv, Dv]
    s = s + kf[:, :, :, None] * delta[:, :, None, :]  # [B, Hv, Dk, Dv]
    out = torch.einsum("bhkv,bhk->bhv", s, qf)  # [B, Hv, Dv]
    return out.to(v.dtype), s


def _split_chunks(x: torch.Tensor, num_chunks: int, chunk_size: int) -> torch.Tensor:
    """`[B, N*C, H, D]` -> `[B, H, N, C, D]` (or `[B, N*C, H]` -> `[B, H, N, C]`)."""
    bsz, _, heads = x.shape[:3]
    tail = x.shape[3:]
    x = x.reshape(bsz, num_chunks, chunk_size, heads, *tail)  # [B, N, C, H, (D)]
    if tail:
        return x.permute(0, 3, 1, 2, 4)  # [B, H, N, C, D]
    return x.permute(0, 3, 1, 2)  # [B, H, N, C]


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
    capture: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Chunked gated delta rule over a flat varlen batch.

    Args:
        q, k: `[T, Hk, Dk]`; v: `[T, Hv, Dv]`; g (log decay, <= 0), beta: `[T, Hv]`;
        initial_state: `[B, Hv, Dk, Dv]` float32 (zeros for fresh requests; not modified);
        query_start_loc: `[B+1]` cumulative query lengths; max_query_len: host int;
        capture: optional (req `[R]`, offset `[R]`) long: tokens (offset inside request req's
        chunk) after which to report the state as well; optionally a third entry, a host int
        >= every offset.

    Returns:
        out `[T, Hv, Dv]` in v's dtype, final_state `[B, Hv, Dk, Dv]` float32 (the state
        after each request's last token); with `capture`, also `[R, Hv, Dk, Dv]` float32.
    """
    total_tokens = q.shape[0]
    num_v_heads, head_v_dim = v.shape[1:]
    head_k_dim = k.shape[2]
    bsz = query_start_loc.shape[0] - 1
    csz = chunk_size
    num_chunks = max(1, -(-max_query_len // csz))
    padded_len = num_chunks * csz
    device = v.device

    qf, kf = _prepare_qk(q, k, num_v_heads, use_qk_l2norm)  # [T, Hv, Dk]
    # Pad straight to a multiple of the chunk size: pad positions get q = k = v = 0,
    # g = 0 (no decay) and beta = 0 (no write), so they leave the state untouched.
    index, valid = padded_index(query_start_loc, padded_len)  # [B, Lp]
    qc = _split_chunks(to_padded(qf, index, valid), num_chunks, csz)  # [B, Hv, N, C, Dk]
    kc = _split_chunks(to_padded(kf, index, valid), num_chunks, csz)  # [B, Hv, N, C, Dk]
    vc = _split_chunks(to_padded(v.float(), index, valid), num_chunks, csz)  # [B, Hv, N, C, Dv]
    gc = _split_chunks(to_padded(g.float(), index, valid), num_chunks, csz)  # [B, Hv, N, C]
    bc = _split_chunks(to_padded(beta.float(), index, valid), num_chunks, csz)  # [B, Hv, N, C]

    gam = gc.cumsum(dim=-1)  # [B, Hv, N, C]
    lower = torch.ones(csz, csz, dtype=torch.bool, device=device).tril()  # [C, C], s <= r
    log_d = gam[..., :, None] - gam[..., None, :]  # [B, Hv, N, C, C], (r, s)
    dmat = log_d.masked_fill(~lower, float("-inf")).exp()  # [B, Hv, N, C, C]

    kb = kc * bc[..., None]  # [B, Hv, N, C, Dk]
    # Strictly lower part of A; solve_triangular(unitriangular=True) reads only that part
    # and treats the diagonal as ones, i.e. it solves (I + A) X = rhs.
    a_mat = (kb @ kc.transpose(-1, -2)) * dmat  # [B, Hv, N, C, C]
    rhs = torch.cat([vc * bc[..., None], kb * gam.exp()[..., None]], dim=-1)  # [B, Hv, N, C, Dv+Dk]
    sol = torch.linalg.solve_triangular(a_mat, rhs, upper=False, unitriangular=True)
    t0, w = sol.split([head_v_dim, head_k_dim], dim=-1)  # [B, Hv, N, C, Dv], [B, Hv, N, C, Dk]

    scores = (qc @ kc.transpose(-1, -2)) * dmat  # [B, Hv, N, C, C]
    q_dec = qc * gam.exp()[..., None]  # [B, Hv, N, C, Dk]
    k_dec = kc * (gam[..., -1:] - gam).exp()[..., None]  # [B, Hv, N, C, Dk]
    chunk_dec = gam[..., -1].exp()[..., None, None]  # [B, Hv, N, 1, 1]

    state = initial_state.float()  # [B, Hv, Dk, Dv]
    outs, starts, us = [], [], []
    kept_chunks = 0 if capture is None else num_chunks if len(capture) < 3 else capture[2] // csz + 1
    for n in range(num_chunks):
        u = t0[:, :, n] - w[:, :, n] @ state  # [B, Hv, C, Dv]
        outs.append(q_dec[:, :, n] @ state + scores[:, :, n] @ u)  # [B, Hv, C, Dv]
        if n < kept_chunks:  # chunk start states and U of the chunks holding captured tokens
            starts.append(state)
            us.append(u)
        state = state * chunk_dec[:, :, n] + k_dec[:, :, n].transpose(-1, -2) @ u  # [B, Hv, Dk, Dv]

    out = torch.stack(outs, dim=2)  # [B, Hv, N, C, Dv]
    out = out.permute(0, 2, 3, 1, 4).reshape(bsz, padded_len, num_v_heads, head_v_dim)  # [B, Lp, Hv, Dv]
    flat = flat_positions(query_start_loc, padded_len, total_tokens)  # [T]
    out = from_padded(out, valid, flat)  # [T, Hv, Dv]
    if capture is None:
        return out.to(v.dtype), state
    req, offset = capture[0].long(), capture[1].long()
    n_idx, c_idx = offset // csz, offset % csz  # [R] chunk of each captured token, place inside it
    start_state = torch.stack(starts, dim=2)[req, :, n_idx]  # [B, Hv, n, Dk, Dv] -> [R, Hv, Dk, Dv]
    u_sel = torch.stack(us, dim=2)[req, :, n_idx]  # [B, Hv, n, C, Dv] -> [R, Hv, C, Dv]
    k_sel = kc[req, :, n_idx]  # [R, Hv, C, Dk]
    d_row = dmat[req, :, n_idx, c_idx]  # [R, Hv, C]: exp(gam_c - gam_s) for s <= c, 0 after
    captured = start_state * gam[req, :, n_idx, c_idx].exp()[..., None, None]  # [R, Hv, Dk, Dv]
    captured = captured + (k_sel * d_row[..., None]).transpose(-1, -2) @ u_sel  # [R, Hv, Dk, Dv]
    return out.to(v.dtype), state, captured


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
    capture: tuple[torch.Tensor, torch.Tensor] | None = None,
    groups: list | None = None,
):
    """Dispatch: decode-only batches (`max_query_len == 1`, so T == B) take the single-step
    form, everything else the chunked form. Same arguments and results as
    `chunk_gated_delta_rule_varlen`.

    The chunked form pads every request to a whole number of chunks, so its chunk is shrunk to
    the smallest power of two >= `max_query_len` (at most `chunk_size`): a speculative
    verification step (K+1 tokens per request) then works on chunks of 2 or 4 tokens instead of
    padding each request to 64 (on an H200 that padding made a K=1 step at batch 64 cost 2.6x a
    plain decode step).

    `groups` (lamina.kernels.request_groups, from `ForwardMetadata.request_groups()`): run each
    group of similar requests on its own, so a step mixing decodes with a long prompt chunk does
    not pad every request to the chunk's length. Same results."""
    if groups is not None:
        return _grouped(q, k, v, g, beta, initial_state, chunk_size, use_qk_l2norm, capture, groups)
    if max_query_len == 1:
        if q.shape[0] != initial_state.shape[0]:
            raise ValueError("max_query_len == 1 needs exactly one token per request (T == B)")
        out, state = recurrent_gated_delta_rule_step(q, k, v, g, beta, initial_state, use_qk_l2norm)
        if capture is None:
            return out, state
        return out, state, state.index_select(0, capture[0].long())  # one token each: its final state
    chunk = min(chunk_size, 1 << max(0, max_query_len - 1).bit_length())
    return chunk_gated_delta_rule_varlen(
        q, k, v, g, beta, initial_state, query_start_loc, max_query_len, chunk, use_qk_l2norm, capture
    )


def _grouped(q, k, v, g, beta, initial_state, chunk_size, use_qk_l2norm, capture, groups):
    """`gated_delta_rule_varlen` once per request group; outputs scattered back in batch order."""
    num_v_heads, head_v_dim = v.shape[1:]
    out = v.new_empty((q.shape[0], num_v_heads, head_v_dim))  # [T, Hv, Dv]
    final = torch.empty_like(initial_state, dtype=torch.float32)  # [B, Hv, Dk, Dv]
    captured = None
    if capture is not None:
        check_group_capture(capture, groups)
        captured = final.new_empty((capture[0].shape[0], *final.shape[1:]))  # [R, Hv, Dk, Dv]
    for group in groups:
        rows = group.tokens
        # One-token requests grouped with requests that have no token this step (host counts from
        # the plan) are not a decode batch: the chunked form takes them, on chunks of one token.
        with_empty_requests = group.max_query_len <= 1 and group.num_tokens != group.num_reqs
        kernel = chunk_gated_delta_rule_varlen if with_empty_requests else gated_delta_rule_varlen
        result = kernel(
            q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows), g.index_select(0, rows),
            beta.index_select(0, rows), initial_state.index_select(0, group.requests), group.query_start_loc,
            group.max_query_len, 1 if with_empty_requests else chunk_size, use_qk_l2norm,
            capture=group.capture if capture is not None else None,
        )
        out.index_copy_(0, rows, result[0])
        final.index_copy_(0, group.requests, result[1])
        if captured is not None and group.capture is not None:
            captured.index_copy_(0, group.capture_rows, result[2])
    return (out, final) if capture is None else (out, final, captured)

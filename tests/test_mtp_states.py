"""Per-position states for speculative rollback: the kernels' `capture` against per-token loops."""

from __future__ import annotations

import pytest
import torch

from lamina.kernels import causal_conv1d_varlen, chunk_gated_delta_rule_varlen, gated_delta_rule_varlen
from lamina.kernels import recurrent_gated_delta_rule_step
from lamina.layers.metadata import StateCapture

LENS = [5, 70, 1, 3]  # a request longer than two chunks of 32, and a one-token one


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENS)
    qsl = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
    req = torch.tensor([b for b, n in enumerate(LENS) for _ in range(n)])
    off = torch.tensor([i for n in LENS for i in range(n)])
    return gen, total, qsl, (req, off)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_gated_delta_rule_states_after_every_token(chunk_size):
    gen, total, qsl, capture = _batch()
    hk, hv, dk, dv = 2, 4, 8, 8
    q, k = torch.randn(total, hk, dk, generator=gen), torch.randn(total, hk, dk, generator=gen)
    v = torch.randn(total, hv, dv, generator=gen)
    g, beta = -torch.rand(total, hv, generator=gen), torch.rand(total, hv, generator=gen)
    s0 = torch.randn(len(LENS), hv, dk, dv, generator=gen)
    out, final, captured = chunk_gated_delta_rule_varlen(q, k, v, g, beta, s0, qsl, max(LENS), chunk_size, capture=capture)
    plain_out, plain_final = chunk_gated_delta_rule_varlen(q, k, v, g, beta, s0, qsl, max(LENS), chunk_size)
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    torch.testing.assert_close(final, plain_final, rtol=0, atol=0)
    for row, (b, i) in enumerate(zip(*capture)):
        state = s0[b : b + 1]
        for t in range(int(qsl[b]), int(qsl[b]) + int(i) + 1):
            _, state = recurrent_gated_delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state)
        torch.testing.assert_close(captured[row], state[0], atol=1e-5, rtol=1e-5)
    # with a host bound on the offsets only the chunks holding captured tokens are kept
    few = capture[1] < 20
    bounded = (capture[0][few], capture[1][few], 19)
    kept = chunk_gated_delta_rule_varlen(q, k, v, g, beta, s0, qsl, max(LENS), chunk_size, capture=bounded)[2]
    torch.testing.assert_close(kept, captured[few], rtol=0, atol=0)
    # decode-only batches take the single-step form; capturing there gives each final state
    one = torch.arange(len(LENS))
    _, step_final, step_captured = gated_delta_rule_varlen(
        q[:4], k[:4], v[:4], g[:4], beta[:4], s0, torch.arange(5), 1, capture=(one, torch.zeros(4, dtype=torch.long))
    )
    torch.testing.assert_close(step_captured, step_final)


@pytest.mark.parametrize("dilation", [1, 3])
def test_conv_states_after_every_token(dilation):
    gen, total, qsl, capture = _batch(1)
    channels, kernel = 6, 4
    x, weight = torch.randn(total, channels, generator=gen), torch.randn(channels, kernel, generator=gen)
    state = torch.randn(len(LENS), channels, (kernel - 1) * dilation, generator=gen)
    out, final, captured = causal_conv1d_varlen(x, weight, state, qsl, max(LENS), dilation=dilation, capture=capture)
    torch.testing.assert_close(final, causal_conv1d_varlen(x, weight, state, qsl, max(LENS), dilation=dilation)[1])
    for row, (b, i) in enumerate(zip(*capture)):
        seq = torch.cat([state[b], x[int(qsl[b]) : int(qsl[b]) + int(i) + 1].T], dim=1)  # [C, S + i + 1]
        torch.testing.assert_close(captured[row], seq[:, -state.shape[-1] :])


def test_commit_copies_the_chosen_rows_into_the_slots():
    ssm_state = torch.zeros(4, 2)
    conv_state = torch.zeros(4, 3)
    capture = StateCapture.from_host([0, 0, 1, 1, 1], [0, 1, 0, 1, 2], torch.device("cpu"))
    capture.keep(ssm_state, torch.arange(10.0).view(5, 2))  # nothing kept for conv_state
    capture.commit(torch.tensor([3, 0]), torch.tensor([2, 1]))
    assert ssm_state.tolist() == [[0, 0], [0, 1], [6, 7], [0, 0]]
    assert conv_state.abs().sum() == 0


def test_commit_on_the_reference_kernels_needs_no_triton():
    """Triton is an optional dependency (extras test / gpu): MTP's commit on the reference kernels
    must work where it does not import."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import torch
from lamina.layers.metadata import StateCapture
capture = StateCapture.from_host([0, 0, 1], [0, 1, 0], torch.device("cpu"))
pool, captured = torch.zeros(3, 2, 4), torch.arange(24.0).reshape(3, 2, 4)
capture.keep(pool, captured)
capture.commit(torch.tensor([1, 2]), torch.tensor([2, 0]))
assert torch.equal(pool[2], captured[1]) and torch.equal(pool[0], captured[2]) and not pool[1].any()
print("ok")
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]

"""The one-launch MoE router (`lamina.kernels.triton_router`) against `SparseMoE.route`'s math and
the two launches it replaces (router GEMV + `route_softmax_topk`).

Without CUDA the kernel runs under Triton's CPU interpreter (tests/conftest.py turns it on) at
tiny shapes; the test marked gpu runs the compiled kernel at the Qwen3.5-35B-A3B width. Most
inputs are small multiples of 1/4, so every logit is exact in float32, bfloat16 and float16
whatever the summation order: the fused launch must then give the two launches' logits and ids
bit for bit, and their weights bit for bit under the interpreter (to one rounding step compiled).
(The interpreter rounds float32 -> bfloat16 toward zero where GPUs round to nearest, so bfloat16
weights are compared with torch's to one bfloat16 step, and with the interpreted two launches,
which round the same way, exactly.)
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

triton = pytest.importorskip("triton")

from lamina.kernels import triton_router  # noqa: E402
from lamina.kernels.triton_moe import route_softmax_topk  # noqa: E402
from lamina.kernels.triton_router import fused_router  # noqa: E402
from lamina.layers.moe import SparseMoE  # noqa: E402
from lamina.parallel.context import ParallelContext  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Two programs over the 14 router rows below (the second one partial), one masked chunk of 48
# features; TWO_CHUNKS splits them into two.
TINY = dict(block_e=8, block_k=64)
TWO_CHUNKS = dict(block_e=8, block_k=32)


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _quarters(*shape, seed):
    """Values in {-0.5, -0.25, 0, 0.25, 0.5}: sums of up to 48 products are exact in every dtype."""
    return torch.randint(-2, 3, shape, generator=_gen(seed)).float() / 4


def _moe(num_experts, top_k, renormalize, shared=True, hidden=48, dtype=torch.float32):
    """A reference-kernel SparseMoE whose router (and shared-expert gate) rows hold quarters."""
    moe = SparseMoE(hidden_size=hidden, num_experts=num_experts, top_k=top_k, moe_intermediate_size=8,
                    shared_expert_intermediate_size=8 if shared else 0, norm_topk_prob=renormalize,
                    ctx=ParallelContext.single(), dtype=dtype)
    with torch.no_grad():
        moe.gate.weight.copy_(_quarters(num_experts, hidden, seed=1))
        if shared:
            moe.shared_expert_gate.weight.copy_(_quarters(1, hidden, seed=2))
    return moe


def _assert_same_weights(weights, ref_weights):
    """Bit for bit under the interpreter (both kernels' sums run in numpy); compiled, the softmax's
    sum may reduce the probabilities of a [4, E] block and of an [E] row in another order: one
    rounding step of the weights' dtype."""
    if DEVICE == "cpu":
        assert torch.equal(weights, ref_weights)
    else:
        torch.testing.assert_close(weights, ref_weights, atol=0, rtol=torch.finfo(weights.dtype).eps)


def _two_launches(x, rows, num_experts, top_k, renormalize):
    """What `SparseMoE._experts_with_shared` runs without the fused router."""
    logits = F.linear(x, rows)  # [T, R]
    return (*route_softmax_topk(logits[:, :num_experts], top_k, renormalize, x.dtype), logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_router_matches_the_two_launches_and_the_route(dtype):
    """T = 1..4 (2 and 3 in 16 bits), 13 experts (padded to 16), top-3 (padded to 4), renormalised
    (odd T) or not, the shared gate's row after the experts', zero rows up to a multiple of 8."""
    num_experts, top_k = 13, 3
    for num_tokens in (1, 2, 3, 4) if dtype == torch.float32 else (2, 3):
        renormalize = num_tokens % 2 == 1
        moe = _moe(num_experts, top_k, renormalize)
        rows = moe.router_rows.to(DEVICE, dtype)  # [E+1 padded to 16, H]
        assert rows.shape[0] == 16 and not rows[num_experts + 1 :].any()
        x = _quarters(num_tokens, 48, seed=10 + num_tokens).to(DEVICE, dtype)
        weights, ids, logits = fused_router(x, rows, num_experts, top_k, renormalize, config=TINY)
        assert weights.dtype == dtype and ids.dtype == torch.long and logits.shape == (num_tokens, 16)
        ref_weights, ref_ids, ref_logits = _two_launches(x, rows, num_experts, top_k, renormalize)
        assert torch.equal(logits, ref_logits) and torch.equal(ids, ref_ids)
        _assert_same_weights(weights, ref_weights)
        # SparseMoE.route and the shared gate logit on the reference kernels (torch's top-k may order
        # equal probabilities differently: compare the probabilities chosen, slot by slot).
        route_weights, route_ids = moe.to(dtype).route(x.cpu())
        probs = torch.softmax(ref_logits[:, :num_experts].float().cpu(), dim=-1)
        assert torch.equal(probs.gather(1, ids.cpu()), probs.gather(1, route_ids))
        step = 0 if dtype == torch.float32 else 2.0 ** -7  # the interpreter's bfloat16 rounding
        torch.testing.assert_close(weights.cpu(), route_weights, atol=1e-6, rtol=max(step, 1e-6))
        assert torch.equal(logits[:, num_experts].cpu(), moe.shared_expert_gate(x.cpu())[:, 0])


def test_fused_router_ties_go_to_the_lower_expert_id():
    """Equal router rows give equal logits: the top-k takes the lower expert ids first."""
    rows = _quarters(10, 48, seed=3)
    rows[[2, 5, 7, 9]] = 4 * rows[0].abs()  # the largest logits for a positive input, four of them equal
    x = torch.rand(2, 48, generator=_gen(4)).to(DEVICE)
    rows = rows.to(DEVICE)
    weights, ids, _ = fused_router(x, rows, 10, 3, True, config=TINY)
    assert ids.tolist() == [[2, 5, 7], [2, 5, 7]]
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 3), atol=1e-6, rtol=0)
    ref_weights, ref_ids, _ = _two_launches(x, rows, 10, 3, True)
    assert torch.equal(ids, ref_ids)
    _assert_same_weights(weights, ref_weights)


def test_fused_router_is_batch_invariant_deterministic_and_resets_its_ticket():
    """A token's logits, weights and ids are the same bits alone or beside 1-3 others; two runs
    give the same bits; the ticket is back to zero after every call."""
    rows = torch.randn(14, 48, generator=_gen(5)).to(DEVICE)
    x = torch.randn(4, 48, generator=_gen(6)).to(DEVICE)
    together = fused_router(x, rows, 13, 3, True, config=TWO_CHUNKS)
    assert all(torch.equal(a, b) for a, b in zip(together, fused_router(x, rows, 13, 3, True, config=TWO_CHUNKS)))
    for first, count in ((0, 1), (3, 1), (0, 2), (1, 3)):
        part = fused_router(x[first : first + count], rows, 13, 3, True, config=TWO_CHUNKS)
        assert all(torch.equal(a, b[first : first + count]) for a, b in zip(part, together))
    assert int(triton_router._ticket(torch.device(DEVICE))) == 0


def test_fused_router_without_extra_rows_and_top_10():
    """The `SparseMoE.route` case (router rows only, no shared gate), 40 experts, top-10 (slots
    padded to 16), random float32 inputs against the reference route."""
    moe = _moe(40, 10, True, shared=False)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(40, 48, generator=_gen(7)))
    x = torch.randn(3, 48, generator=_gen(8))
    weights, ids, logits = fused_router(x.to(DEVICE), moe.gate.weight.to(DEVICE), 40, 10, True, config=TINY)
    ref_weights, ref_ids = moe.route(x)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logits.cpu(), moe.gate(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at most 4 tokens"):
        fused_router(torch.zeros(5, 48, device=DEVICE), moe.gate.weight.to(DEVICE), 40, 10, True)
    empty = fused_router(torch.zeros(0, 48, device=DEVICE), moe.gate.weight.to(DEVICE), 40, 10, True)
    assert [tuple(t.shape) for t in empty] == [(0, 10), (0, 10), (0, 40)]


def test_router_switches(monkeypatch):
    from lamina.kernels.selection import fused_router_max_tokens

    monkeypatch.delenv("LAMINA_FUSED_ROUTER", raising=False)
    assert fused_router_max_tokens("triton") == 0  # off by default (slower at one token on the H200)
    monkeypatch.setenv("LAMINA_FUSED_ROUTER", "1")
    assert fused_router_max_tokens("triton") == 4 and fused_router_max_tokens("reference") == 0
    from lamina.kernels.selection import gemv_route_enabled

    monkeypatch.delenv("LAMINA_GEMV_ROUTE", raising=False)
    monkeypatch.delenv("LAMINA_TRITON_GEMV", raising=False)
    assert not gemv_route_enabled("triton")  # off by default (slower at one token on the H200)
    monkeypatch.setenv("LAMINA_GEMV_ROUTE", "1")
    assert gemv_route_enabled("triton") and not gemv_route_enabled("reference")
    monkeypatch.setenv("LAMINA_TRITON_GEMV", "0")  # the routing epilogue rides on lamina's GEMV
    assert not gemv_route_enabled("triton")
    monkeypatch.setenv("LAMINA_TRITON_GEMV", "1")
    monkeypatch.setenv("LAMINA_GEMV_ROUTE", "2")
    with pytest.raises(ValueError, match="LAMINA_GEMV_ROUTE = '2' must be 0 or 1"):
        gemv_route_enabled("triton")
    monkeypatch.setenv("LAMINA_FUSED_ROUTER", "0")
    assert fused_router_max_tokens("triton") == 0
    monkeypatch.setenv("LAMINA_FUSED_ROUTER", "on")
    with pytest.raises(ValueError, match="LAMINA_FUSED_ROUTER"):
        fused_router_max_tokens("triton")


@pytest.mark.parametrize("shared", [True, False], ids=["fused-shared", "local-experts"])
def test_sparse_moe_routes_decode_in_one_launch(shared, monkeypatch):
    """On the Triton kernel set a SparseMoE of up to 4 tokens routes through `fused_router` (with
    the shared expert's gate row when the shared expert rides in the MoE launches, the router rows
    alone otherwise) and matches the two-launch routing."""
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    monkeypatch.setenv("LAMINA_FUSED_ROUTER", "1")
    moe = SparseMoE(hidden_size=32, num_experts=6, top_k=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=16 if shared else 0, norm_topk_prob=True,
                    ctx=ParallelContext.single(DEVICE), dtype=torch.float32, device=DEVICE)
    assert moe.fuse_shared_expert == shared and moe.fused_router_max_tokens == 4
    with torch.no_grad():
        for i, p in enumerate(moe.parameters()):
            p.copy_(torch.randn(p.shape, generator=_gen(20 + i)) * 0.3)
    calls = []
    inner = triton_router.fused_router
    monkeypatch.setattr(triton_router, "fused_router", lambda *a, **k: calls.append(a[0].shape[0]) or inner(*a, **k))
    x = torch.randn(3, 32, generator=_gen(9)).to(DEVICE)
    ours = moe(x, SimpleNamespace(num_tokens=3))
    assert calls == [3]
    moe.fused_router_max_tokens = 0  # what LAMINA_FUSED_ROUTER=0 builds
    torch.testing.assert_close(ours, moe(x, SimpleNamespace(num_tokens=3)), atol=1e-5, rtol=1e-5)
    assert calls == [3]


def _same_routing_up_to_near_ties(ids, weights, ref_ids, ref_weights, ref_logits, step):
    """Ids equal token by token, except where the reference's k-th and next logits are within
    `step` (one rounding of the logits apart); weights close where the ids agree."""
    top_k = ids.shape[1]
    for t in range(ids.shape[0]):
        if torch.equal(ids[t], ref_ids[t]):
            torch.testing.assert_close(weights[t].float(), ref_weights[t].float(), atol=1e-3, rtol=1e-2)
            continue
        kth = ref_logits[t].float().topk(top_k).values[-1]
        assert (ref_logits[t].float()[ids[t]] >= kth - step).all(), (t, ids[t], ref_ids[t])


@pytest.mark.gpu
def test_fused_router_bf16_at_real_width():
    """Qwen3.5-35B-A3B: 256 experts + the shared gate row, H = 2048, top-8, bf16, T = 1..4,
    against the two launches (cuBLAS GEMV + route_softmax_topk), batch invariant, and replayed
    from a CUDA graph."""
    hidden, experts, top_k = 2048, 256, 8
    rows = (torch.randn(experts + 1, hidden, device=DEVICE) * 0.02).to(torch.bfloat16)
    x_all = torch.randn(4, hidden, device=DEVICE).to(torch.bfloat16)
    alone = [fused_router(x_all[t : t + 1], rows, experts, top_k, True) for t in range(4)]
    for num_tokens in (1, 2, 3, 4):
        x = x_all[:num_tokens]
        weights, ids, logits = fused_router(x, rows, experts, top_k, True)
        ref_weights, ref_ids, ref_logits = _two_launches(x, rows, experts, top_k, True)
        torch.testing.assert_close(logits.float(), ref_logits.float(), atol=2e-2, rtol=1e-2)  # 1 bf16 step
        _same_routing_up_to_near_ties(ids, weights, ref_ids, ref_weights, ref_logits[:, :experts], step=2e-2)
        for t in range(num_tokens):
            assert all(torch.equal(a[0], b[t]) for a, b in zip(alone[t], (weights, ids, logits)))
    static_x = x_all.clone()
    fused_router(static_x, rows, experts, top_k, True)  # warm-up (the ticket exists)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_router(static_x, rows, experts, top_k, True)
    eager = fused_router(x_all, rows, experts, top_k, True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))
    static_x.copy_(x_all.flip(0))
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(captured, fused_router(x_all.flip(0), rows, experts, top_k, True)))

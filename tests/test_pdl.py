"""Programmatic dependent launch (lamina.kernels.pdl): where it is on, and that a chain of decode
kernels replayed in a CUDA graph with it gives bitwise what it gives without it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

pytest.importorskip("triton")

from lamina.kernels import pdl  # noqa: E402


def test_pdl_is_off_on_the_cpu_and_under_the_interpreter():
    assert not pdl.pdl_launch(torch.device("cpu"))
    if not torch.cuda.is_available():
        assert not pdl.pdl_launch(torch.device("cuda", 0))  # TRITON_INTERPRET=1 here


def test_pdl_switch_values(monkeypatch):
    monkeypatch.setenv("LAMINA_PDL", "yes")
    pdl._switch.cache_clear()
    try:
        with pytest.raises(ValueError, match="LAMINA_PDL = 'yes' must be 0 or 1"):
            pdl._switch()
        monkeypatch.setenv("LAMINA_PDL", "0")
        pdl._switch.cache_clear()
        assert pdl._switch() is False
    finally:
        pdl._switch.cache_clear()


def _decode_chain(x, residual, params):
    """One MoE decode layer's kernel chain: add+RMSNorm, the split-K GEMV (router), routing, the
    MoE GEMVs (shared expert on), then the router GEMV with its routing epilogue and a split-K
    GEMV, both on the MoE output."""
    from lamina.kernels.triton_gemv import gemv, gemv_route
    from lamina.kernels.triton_moe import route_softmax_topk
    from lamina.kernels.triton_moe_gemv import fused_moe_gemv
    from lamina.kernels.triton_norm import add_rms_norm

    norm_w, router_w, w13, w2, sw13, sw2, out_w = params
    total, h = add_rms_norm(x, residual, norm_w, 1e-6, False)
    logits = gemv(h, router_w)  # [T, E + 1]: the last row is the shared expert's gate
    weights, ids = route_softmax_topk(logits[:, :-1], 4, True, h.dtype)
    moe = fused_moe_gemv(h, w13, w2, weights, ids, 0, (sw13, sw2, logits[:, -1]))
    _, weights2, ids2 = gemv_route(moe, router_w, router_w.shape[0] - 1, 4, True)  # the routing epilogue
    return total, gemv(moe, out_w), weights2, ids2


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
def test_graph_of_a_decode_chain_is_bitwise_the_same_with_pdl(rows, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not pdl._device_supports(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 and Triton's gdc_wait")
    gen = torch.Generator().manual_seed(0)
    hidden, inter, experts = 1024, 256, 16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to("cuda", torch.bfloat16)

    params = (rand(hidden), rand(experts + 1, hidden, scale=0.05), rand(experts, 2 * inter, hidden, scale=0.05),
              rand(experts, hidden, inter, scale=0.05), rand(2 * inter, hidden, scale=0.05),
              rand(hidden, inter, scale=0.05), rand(4096, hidden, scale=0.05))
    x, residual = rand(rows, hidden), rand(rows, hidden)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "_switch", lambda on=on: on)
        assert pdl.pdl_launch(x.device) is on
        eager = _decode_chain(x, residual, params)  # compiles, sizes the tickets
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = _decode_chain(x, residual, params)
        replays = []
        for _ in range(3):  # replays reuse the tickets and the pool's buffers
            graph.replay()
            replays.append(tuple(t.clone() for t in static))
        torch.cuda.synchronize()
        for replay in replays:
            for got, want in zip(replay, eager):
                assert torch.equal(got, want)
        results[on] = eager
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)

"""Triton MoE tiles on a GPU with less shared memory than the sm90 they were tuned on: the grouped
kernels retry with fewer stages, then narrower tiles, when Triton refuses a launch, and keep the fit;
the GEMVs size their pipelined tiles to the device's limit. Interpreted on the CPU, where a refusing
kernel stands in for a small GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

triton = pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from lamina.kernels import tile_fit, triton_moe  # noqa: E402
from lamina.kernels.moe import grouped_experts  # noqa: E402
from lamina.kernels.triton_moe_gemv import GEMV_CONFIG, GEMV_CONFIG_ONE_TOKEN, _fit_shared_memory, _shared_memory  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SM89_SHARED_MEMORY = 101376  # an L40S / RTX 4090 block's opt-in shared memory


def test_smaller_tiles_cut_stages_then_halve_the_wider_side():
    tiles = dict(up_n=128, up_k=64, stages=3, warps=8)
    steps = []
    while tiles is not None:
        steps.append((tiles["up_n"], tiles["up_k"], tiles["stages"]))
        tiles = tile_fit.smaller_tiles(tiles, "up_n", "up_k", "stages")
    assert steps == [(128, 64, 3), (128, 64, 2), (64, 64, 2), (32, 64, 2), (32, 32, 2), (16, 32, 2), (16, 16, 2)]


def test_shared_memory_limit_of_the_interpreter_is_sm90s():
    assert tile_fit.shared_memory_limit(torch.device("cpu")) == 227 * 1024
    if torch.cuda.is_available():
        from triton.runtime import driver

        index = torch.cuda.current_device()
        expected = driver.active.utils.get_device_properties(index)["max_shared_mem"]
        assert tile_fit.shared_memory_limit(torch.device("cuda")) == expected


@pytest.mark.parametrize("base", [GEMV_CONFIG, GEMV_CONFIG_ONE_TOKEN])
def test_gemv_tiles_fit_a_smaller_gpu(base):
    """The bf16 GEMV tiles fit sm90 as tuned; on sm89 one token's gate/up tiles (144 KiB) narrow."""
    cfg = dict(base)
    _fit_shared_memory(cfg, 2, 227 * 1024)
    assert cfg == base
    _fit_shared_memory(cfg, 2, SM89_SHARED_MEMORY)
    assert max(_shared_memory(cfg, 2)) <= SM89_SHARED_MEMORY
    assert (cfg == base) == (base is GEMV_CONFIG)  # (80 KiB as tuned)
    assert min(cfg["up_n"], cfg["down_n"]) >= 16 and min(cfg["up_stages"], cfg["down_stages"]) >= 2


class SmallGpu:
    """A grouped MoE kernel on a GPU whose shared memory holds `budget` of a made-up measure
    (stages x N x K): Triton's refusal above it, the real (interpreted) kernel below."""

    def __init__(self, kernel, budget: int, refusal: str = "shared memory"):
        self.kernel, self.budget, self.refusal, self.tried = kernel, budget, refusal, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            tiles = (kwargs["BLOCK_N"], kwargs["BLOCK_K"], kwargs["num_stages"])
            self.tried.append(tiles)
            if tiles[0] * tiles[1] * tiles[2] > self.budget:
                raise OutOfResources(tiles[0] * tiles[1] * tiles[2], self.budget, self.refusal)
            return self.kernel[grid](*args, **kwargs)
        return run


def _moe_case(num_tokens=6, hidden=48, inter=32, num_experts=8, top_k=3):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(DEVICE)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(DEVICE)
    weights, ids = torch.softmax(torch.randn(num_tokens, num_experts, generator=gen), -1).topk(top_k, dim=-1)
    return x, w13, w2, weights.to(DEVICE), ids.to(DEVICE)


TUNED = dict(block_m=16, up_n=32, up_k=32, down_n=32, down_k=32, warps=4, stages=4)


def _tuned(monkeypatch):
    """fused_moe's own tiles are TUNED (a config passed in is taken as given: tuning)."""
    monkeypatch.setattr(triton_moe, "default_config", lambda *args, **kwargs: TUNED)


def test_grouped_moe_launches_on_tiles_that_fit_and_keeps_them(monkeypatch):
    monkeypatch.setattr(tile_fit, "_FITTED", {})
    _tuned(monkeypatch)
    up = SmallGpu(triton_moe._gate_up_kernel, budget=32 * 16 * 2)
    down = SmallGpu(triton_moe._down_kernel, budget=32 * 32 * 2)
    monkeypatch.setattr(triton_moe, "_gate_up_kernel", up)
    monkeypatch.setattr(triton_moe, "_down_kernel", down)
    x, w13, w2, weights, ids = _moe_case()
    ref = grouped_experts(x, w13, w2, weights, ids, 0)
    first = triton_moe.fused_moe(x, w13, w2, weights, ids, gemv_max_tokens=0)
    torch.testing.assert_close(first, ref, atol=1e-5, rtol=1e-5)
    assert up.tried == [(32, 32, 4), (32, 32, 3), (32, 32, 2), (16, 32, 2)]
    assert down.tried == [(32, 32, 4), (32, 32, 3), (32, 32, 2)]
    # The fit is kept: the next call launches once per kernel, with the same sums.
    up.tried.clear(), down.tried.clear()
    assert torch.equal(triton_moe.fused_moe(x, w13, w2, weights, ids, gemv_max_tokens=0), first)
    assert up.tried == [(16, 32, 2)] and down.tried == [(32, 32, 2)]
    # ... which are the sums of those tiles given as the config on a GPU that takes them.
    monkeypatch.setattr(triton_moe, "_gate_up_kernel", up.kernel)
    monkeypatch.setattr(triton_moe, "_down_kernel", down.kernel)
    fitted = dict(TUNED, up_n=16, stages=2)
    assert torch.equal(triton_moe.fused_moe(x, w13, w2, weights, ids, config=fitted), first)


def test_a_fit_is_kept_per_variant(monkeypatch):
    """A fit found for float32 activations is not reused by bf16 ones with the same tuned tiles (their
    shared memory differs): each call launches on the tiles of its own kind."""
    monkeypatch.setattr(tile_fit, "_FITTED", {})
    _tuned(monkeypatch)
    up = SmallGpu(triton_moe._gate_up_kernel, budget=32 * 16 * 2)
    monkeypatch.setattr(triton_moe, "_gate_up_kernel", up)
    x, w13, w2, weights, ids = _moe_case()
    triton_moe.fused_moe(x, w13, w2, weights, ids, gemv_max_tokens=0)
    assert len(tile_fit._FITTED) == 2  # gate/up and down, float32
    up.budget = 10**9  # bf16 tiles: room enough on this "GPU"
    up.tried.clear()
    triton_moe.fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids, gemv_max_tokens=0)
    assert up.tried == [(32, 32, 4)] and len(tile_fit._FITTED) == 4


def test_grouped_moe_raises_when_nothing_fits_or_the_refusal_is_not_shared_memory(monkeypatch):
    x, w13, w2, weights, ids = _moe_case()
    _tuned(monkeypatch)
    for budget, refusal in ((16 * 16 * 2 - 1, "shared memory"), (0, "threads")):
        monkeypatch.setattr(tile_fit, "_FITTED", {})
        up = SmallGpu(triton_moe._gate_up_kernel, budget=budget, refusal=refusal)
        monkeypatch.setattr(triton_moe, "_gate_up_kernel", up)
        with pytest.raises(OutOfResources, match=refusal):
            triton_moe.fused_moe(x, w13, w2, weights, ids, gemv_max_tokens=0)
        assert up.tried[-1] == ((16, 16, 2) if refusal == "shared memory" else (32, 32, 4))
        monkeypatch.setattr(triton_moe, "_gate_up_kernel", up.kernel)
        assert tile_fit._FITTED == {}  # nothing remembered from a launch that never ran
    # A config passed in (tuning) is launched as given: its refusal is the caller's to see.
    monkeypatch.setattr(triton_moe, "_gate_up_kernel", SmallGpu(triton_moe._gate_up_kernel, budget=32 * 32 * 3))
    with pytest.raises(OutOfResources):
        triton_moe.fused_moe(x, w13, w2, weights, ids, config=TUNED)
    assert tile_fit._FITTED == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_moe_tiles_over_the_gpus_shared_memory_launch_narrowed(monkeypatch):
    """On the GPU itself: bf16 tiles pipelined deeper than any card's shared memory holds (8 stages:
    ~570 KiB for gate/up, Triton's real refusal) launch with fewer stages, with the sums of those
    stages given as a config. (Every refused form is compiled first: only moderate tiles here.)"""
    monkeypatch.setattr(tile_fit, "_FITTED", {})
    deep = dict(block_m=64, up_n=128, up_k=128, down_n=128, down_k=128, warps=4, stages=8)
    monkeypatch.setattr(triton_moe, "default_config", lambda *args, **kwargs: deep)
    x, w13, w2, weights, ids = _moe_case(num_tokens=40, hidden=512, inter=256)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    ours = triton_moe.fused_moe(x, w13, w2, weights, ids, gemv_max_tokens=0)
    fitted = {name: tiles for (name, _, _, _), tiles in tile_fit._FITTED.items()}
    up, down = fitted["fused_moe gate/up"], fitted["fused_moe down"]
    assert 2 <= up["stages"] < 8 and 2 <= down["down_stages"] < 8
    given = dict(deep, up_n=up["up_n"], up_k=up["up_k"], stages=up["stages"], down_n=down["down_n"],
                 down_k=down["down_k"], down_stages=down["down_stages"])
    assert torch.equal(triton_moe.fused_moe(x, w13, w2, weights, ids, config=given), ours)
    ref = grouped_experts(x.float(), w13.float(), w2.float(), weights, ids, 0)
    assert ((ours.float() - ref).norm() / ref.norm()).item() < 1e-2

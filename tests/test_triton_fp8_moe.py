"""The Triton MoE kernels on block FP8 expert weights (float8 e4m3 values, one float32 scale per
block) against the float32 reference on the dequantized weights: the decode GEMVs (FMA kernels,
one to four tokens) and the grouped kernels (more tokens, prefill tiles), with the shared expert
riding along in FP8, experts of other EP ranks, blocks that do not divide the hidden size, float32
and bf16 activations; results do not depend on the other tokens of the call. Interpreted on the
CPU (CI), compiled on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

triton = pytest.importorskip("triton")

from lamina.kernels.expert_scales import ExpertScales  # noqa: E402
from lamina.kernels.moe import grouped_experts  # noqa: E402
from lamina.kernels.triton_moe import (  # noqa: E402
    DEFAULT_CONFIG_LONG_PREFILL_FP8,
    DEFAULT_CONFIG_PREFILL_FP8,
    PREFILL_MAX_PAIRS,
    default_config,
    fused_moe,
)
from lamina.kernels.triton_moe_gemv import fused_moe_gemv  # noqa: E402
from lamina.quantization import BlockFp8, dequantize  # noqa: E402
from tests.fp8_checkpoint import quantize_block_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F = torch.nn.functional


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _fp8(shape, seed, block):
    q, s = quantize_block_fp8(torch.randn(*shape, generator=_gen(seed)) * 0.2, block)
    return q.to(DEVICE), s.to(DEVICE), dequantize(q, s, BlockFp8(*block)).to(DEVICE)


def _case(num_tokens, expert_start, num_local, with_shared, dtype, block, hidden=48, inter=None):
    """(x, w13, w2, weights, ids, shared, scales, ref): top-3 of 8 experts in FP8, and the float32
    reference on the dequantized weights."""
    top_k, total_experts = 3, 8
    inter = inter or max(32, *block)
    x = (torch.randn(num_tokens, hidden, generator=_gen(1))).to(DEVICE, dtype)
    w13, s13, d13 = _fp8((num_local, 2 * inter, hidden), 2, block)
    w2, s2, d2 = _fp8((num_local, hidden, inter), 3, block)
    logits = torch.randn(num_tokens, total_experts + 1, generator=_gen(4)).to(DEVICE)
    weights, ids = torch.softmax(logits[:, :total_experts], -1).topk(top_k, dim=-1)
    weights = weights.to(dtype)
    ref = grouped_experts(x.float(), d13, d2, weights.float(), ids, expert_start)
    scales = ExpertScales(s13, s2, block)
    shared = None
    if with_shared:
        sw13, ss13, sd13 = _fp8((2 * inter, hidden), 5, block)
        sw2, ss2, sd2 = _fp8((hidden, inter), 6, block)
        shared = (sw13, sw2, logits[:, total_experts])
        scales = ExpertScales(s13, s2, block, ss13, ss2)
        gate, up = F.linear(x.float(), sd13).chunk(2, dim=-1)
        ref = ref + torch.sigmoid(logits[:, total_experts:]) * F.linear(F.silu(gate) * up, sd2)
    return x, w13, w2, weights, ids, shared, scales, ref


def _check(ours, ref, dtype):
    assert ours.dtype == dtype and ours.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    else:  # activations, output (and in the grouped kernels the dequantized weight tiles) rounded to bf16;
        # Triton's interpreter emulates bf16 loosely (0.85-1.8% here, where a wrong block scale is O(1))
        assert ((ours.float() - ref).norm() / ref.norm()).item() < (1e-2 if DEVICE == "cuda" else 3e-2)


@pytest.mark.parametrize("num_tokens,expert_start,num_local,with_shared,dtype,block", [
    (1, 0, 8, True, torch.float32, (16, 16)),
    (3, 3, 4, True, torch.float32, (16, 32)),  # experts of other EP ranks; 48 columns in blocks of 32
    (2, 0, 8, False, torch.bfloat16, (16, 16)),
    (4, 3, 4, True, torch.bfloat16, (32, 16)),
])
def test_decode_gemv_on_fp8_experts(num_tokens, expert_start, num_local, with_shared, dtype, block):
    x, w13, w2, weights, ids, shared, scales, ref = _case(num_tokens, expert_start, num_local, with_shared, dtype, block)
    ours = fused_moe_gemv(x, w13, w2, weights, ids, expert_start, shared, scales=scales)
    _check(ours, ref, dtype)
    assert torch.equal(ours, fused_moe(x, w13, w2, weights, ids, expert_start, shared, scales=scales))
    # the GPU's relation of tiles to blocks: several programs per block row (4 and 2 of 16 rows), the
    # hidden dim in several K steps
    narrow = fused_moe_gemv(x, w13, w2, weights, ids, expert_start, shared, scales=scales,
                            config=dict(fma=1, up_n=4, up_k=16, down_n=2, down_k=16, up_warps=2, down_warps=2))
    _check(narrow, ref, dtype)
    if num_tokens > 1:  # a token's result does not depend on the others
        alone = shared and (shared[0], shared[1], shared[2][:1])
        assert torch.equal(fused_moe_gemv(x[:1], w13, w2, weights[:1], ids[:1], expert_start, alone, scales=scales),
                           ours[:1])


@pytest.mark.parametrize("num_tokens,expert_start,num_local,with_shared,dtype,block,config", [
    (6, 0, 8, True, torch.float32, (16, 16), None),
    (9, 3, 4, False, torch.float32, (16, 32), None),  # experts of other EP ranks; partial column blocks
    (7, 0, 8, True, torch.bfloat16, (16, 16), None),
    # prefill-like tiles: 64 output rows over 16-row blocks, K tiles cut to the block width
    (12, 0, 8, True, torch.float32, (16, 16), dict(block_m=16, up_n=64, up_k=64, down_n=64, down_k=64, warps=4,
                                                   stages=2, n_fastest=True)),
    # K tiles narrower than a block column (16 of 64: the GPU's 64 of 128), 48 hidden columns in one
    # partial block
    (10, 0, 8, True, torch.float32, (16, 64), dict(block_m=16, up_n=32, up_k=16, down_n=16, down_k=16, warps=4,
                                                   stages=2)),
    # the FP8 prefill tiles as shipped (the GPU's; K tiles cut to the 32-wide block columns here)
    (20, 0, 8, True, torch.bfloat16, (16, 32), DEFAULT_CONFIG_PREFILL_FP8),
    (20, 3, 4, False, torch.bfloat16, (32, 32), DEFAULT_CONFIG_LONG_PREFILL_FP8),
])
def test_grouped_kernels_on_fp8_experts(num_tokens, expert_start, num_local, with_shared, dtype, block, config):
    """Both forms: each weight tile dequantized before its dot (the default) and the tile's products
    scaled after the dot (`fp8_scale_b` 0)."""
    x, w13, w2, weights, ids, shared, scales, ref = _case(num_tokens, expert_start, num_local, with_shared, dtype, block)
    for form in (None, dict(fp8_scale_b=0)):
        cfg = config if form is None else dict(config or default_config(num_tokens * 3, dtype), **form)
        ours = fused_moe(x, w13, w2, weights, ids, expert_start, shared, config=cfg, gemv_max_tokens=0, scales=scales)
        _check(ours, ref, dtype)
        assert torch.equal(ours, fused_moe(x, w13, w2, weights, ids, expert_start, shared, config=cfg,
                                           gemv_max_tokens=0, scales=scales))


def test_fp8_experts_take_their_own_prefill_tiles():
    """Prefill chunks on FP8 experts take the tiles swept for them; decode sizes and bf16 weights keep theirs."""
    assert default_config(2048 * 8, torch.bfloat16, fp8=True) is DEFAULT_CONFIG_PREFILL_FP8
    assert default_config(PREFILL_MAX_PAIRS + 1, torch.bfloat16, fp8=True) is DEFAULT_CONFIG_LONG_PREFILL_FP8
    assert default_config(64 * 8, torch.bfloat16, fp8=True) is default_config(64 * 8, torch.bfloat16)
    assert default_config(PREFILL_MAX_PAIRS + 1, torch.bfloat16) is not DEFAULT_CONFIG_LONG_PREFILL_FP8
    assert default_config(PREFILL_MAX_PAIRS + 1, torch.float32, fp8=True) is default_config(1, torch.float32)


def test_scales_that_do_not_match_are_refused():
    x, w13, w2, weights, ids, shared, scales, _ = _case(2, 0, 8, True, torch.float32, (16, 16))
    with pytest.raises(ValueError, match=r"w13 scales \(8, 4, 3\) torch.float32, expected \(8, 2, 3\)"):
        fused_moe(x, w13, w2, weights, ids, 0, shared, scales=ExpertScales(scales.w13, scales.w2, (32, 16),
                                                                          scales.shared_w13, scales.shared_w2))
    with pytest.raises(ValueError, match="without its scales"):
        fused_moe(x, w13, w2, weights, ids, 0, shared, scales=ExpertScales(scales.w13, scales.w2, (16, 16)))
    with pytest.raises(ValueError, match="w13 is torch.float32, expected float8_e4m3fn"):
        fused_moe(x, w13.float(), w2, weights, ids, 0, None, scales=scales)
    with pytest.raises(ValueError, match="FMA kernels"):
        fused_moe_gemv(x, w13, w2, weights, ids, 0, shared, config=dict(fma=0), scales=scales)

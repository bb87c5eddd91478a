"""`quantization="fp8"` on an unquantized checkpoint (vLLM's `--quantization fp8`): the routed and
shared experts are quantized to block FP8 as they load, and the engine then is the one that loads a
block FP8 checkpoint of exactly those tensors (written here by tests/fp8_checkpoint.py, independently
of lamina): the same weights, kept FP8 on the Triton kernels (Triton's interpreter on the CPU) and
dequantized on the references; every other weight keeps its dtype."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.layers.moe import SparseMoE
from lamina.quantization import ONLINE_FP8, BlockFp8, online_blocks, quantize_block_fp8, dequantize
from tests.fp8_checkpoint import fp8_copy, quantize_block_fp8 as reference_quantize
from tests.reference import lamina_logits

ENGINE = dict(device="cpu", dtype="float32", show_progress=False, enforce_eager=True)
IDS = [(i * 37 + 5) % 990 for i in range(12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(i * 13 + 2) % 990 for i in range(9)]}]
BLOCK = 32  # what the tiny checkpoints' 32 intermediate rows take (online_blocks)


def _experts_only(name: str) -> bool:
    return ".mlp.experts." in name or ".mlp.shared_expert." in name


def _moes(llm) -> list[SparseMoE]:
    return [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, SparseMoE)]


def _run(path, **kw):
    with LLM(str(path), **ENGINE, **kw) as llm:
        dtypes = {m.w13.dtype for m in _moes(llm)}
        return lamina_logits(llm, IDS), [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY,
                                                                                         use_tqdm=False)], dtypes


def test_quantizer_and_blocks():
    """lamina's quantizer gives the test helper's values and scales (absmax / 448 per block, a
    partial last block its own); blocks follow a rank's intermediate slice."""
    w = torch.randn(3, 70, 45) * 3
    ours = quantize_block_fp8(w, BlockFp8(32, 16))
    values, scale = reference_quantize(w, (32, 16))
    assert torch.equal(ours.values.view(torch.uint8), values.view(torch.uint8)) and torch.equal(ours.scale_inv, scale)
    back = dequantize(ours.values, ours.scale_inv, BlockFp8(32, 16))
    assert (back - w).abs().max() <= w.abs().max() / 448 * 16  # within e4m3's step of each block's max
    assert online_blocks(ONLINE_FP8, 512) == BlockFp8(128, 128, online=True)
    assert online_blocks(ONLINE_FP8, 64) == BlockFp8(64, 64, online=True)  # e.g. 512 rows over TP8
    assert online_blocks(ONLINE_FP8, 24) == ONLINE_FP8  # nothing tiles it: 128 (then dequantized again)
    assert online_blocks(BlockFp8(128, 128), 64) == BlockFp8(128, 128)  # a checkpoint's blocks are its own


# the per-expert tensors (Qwen3-Next) on the references only (the interpreted kernels are slow): quantized
# at load, each goes to the loader an FP8 checkpoint's per-expert tensor takes (`Fp8Weight`)
@pytest.mark.parametrize("family,kernels", [("qwen3_5_moe", "reference"), ("qwen3_5_moe", "triton"),
                                            ("qwen3_next", "reference")])
def test_quantized_at_load_equals_an_fp8_checkpoint_of_the_experts(tmp_path, qwen3_5_moe_short_dir,
                                                                    qwen3_next_dir, monkeypatch, kernels, family):
    """Fused (Qwen3.5) and per-expert (Qwen3-Next) expert tensors: logits of a prefill and greedy
    tokens equal the offline FP8 checkpoint's exactly; on the Triton kernels the experts stay FP8,
    on the references both are dequantized; and the result differs from the unquantized model's."""
    source = qwen3_5_moe_short_dir if family == "qwen3_5_moe" else qwen3_next_dir
    offline = fp8_copy(source, tmp_path / "fp8", block=(BLOCK, BLOCK), only=_experts_only)
    monkeypatch.setenv("LAMINA_KERNELS", kernels)
    online_logits, online_tokens, online_dtypes = _run(source, quantization="fp8")
    offline_logits, offline_tokens, offline_dtypes = _run(offline)
    assert online_dtypes == offline_dtypes == {torch.float8_e4m3fn if kernels == "triton" else torch.float32}
    assert torch.equal(online_logits, offline_logits) and online_tokens == offline_tokens
    if kernels == "reference":  # (the interpreted kernels are slow: one more engine only here)
        assert not torch.equal(online_logits, _run(source)[0])


def test_mtp_drafter_experts_are_quantized_too(tmp_path, mtp_short_dir, monkeypatch):
    """With MTP the drafter's experts are quantized at load as well (FP8 on the Triton kernels), and
    greedy output equals plain decoding's on the same quantized model."""
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    with LLM(str(mtp_short_dir), **ENGINE, quantization="fp8", **spec) as llm:
        drafter = [m for m in llm.engine.executor.runner.model.mtp.modules() if isinstance(m, SparseMoE)]
        assert drafter and all(m.w13.dtype == torch.float8_e4m3fn for m in drafter)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == _run(mtp_short_dir, quantization="fp8")[1]


def test_plan_counts_experts_quantized_at_load(qwen3_5_moe_short_dir, capsys):
    """`lamina plan --quantization fp8` of an unquantized checkpoint on a GPU: experts at a byte a
    value plus float32 block scales, as the engine holds them."""
    from lamina.entrypoints.cli import main

    sizes = {}
    for flags in ([], ["--quantization", "fp8"]):
        assert main(["plan", str(qwen3_5_moe_short_dir), "--device", "cuda", "--dtype", "bfloat16", "--json",
                     *flags]) == 0
        sizes[bool(flags)] = json.loads(capsys.readouterr().out)["ranks"][0]["estimate"]["weight_bytes"]
    layers, experts, hidden, inter = 3, 8 + 1, 64, 32  # the short checkpoint; + the shared expert
    values = layers * experts * 3 * inter * hidden
    scales = layers * experts * (2 * inter // BLOCK * hidden // BLOCK + hidden // BLOCK * inter // BLOCK)
    assert sizes[True] == sizes[False] - values + 4 * scales


def test_the_log_says_so(qwen3_5_moe_short_dir, caplog, monkeypatch):
    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    with caplog.at_level("INFO"), LLM(str(qwen3_5_moe_short_dir), **ENGINE, quantization="fp8"):
        pass
    assert "block FP8 (e4m3, 32x32 blocks, quantized at load): the MoE experts stay FP8" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantized_on_the_gpu_as_on_the_cpu(tmp_path, qwen3_5_moe_short_dir):
    """A CUDA engine quantizes the experts on its GPU as they load: the quantizer's bytes there are
    the CPU's (one rounding of each division, round-to-nearest-even to e4m3), and the engine's
    logits and tokens (float32, graphs) are those of the offline FP8 checkpoint on the same GPU."""
    w = torch.randn(3, 70, 45) * 3
    cpu, gpu = quantize_block_fp8(w, BlockFp8(32, 16)), quantize_block_fp8(w.cuda(), BlockFp8(32, 16))
    assert gpu.values.is_cuda and torch.equal(gpu.values.cpu().view(torch.uint8), cpu.values.view(torch.uint8))
    assert torch.equal(gpu.scale_inv.cpu(), cpu.scale_inv)
    offline = fp8_copy(qwen3_5_moe_short_dir, tmp_path / "fp8", block=(BLOCK, BLOCK), only=_experts_only)
    runs = []
    for path, kw in ((qwen3_5_moe_short_dir, dict(quantization="fp8")), (offline, {})):
        with LLM(str(path), **dict(ENGINE, device="cuda", enforce_eager=False), **kw) as llm:
            assert {m.w13.dtype for m in _moes(llm)} == {torch.float8_e4m3fn}
            runs.append((lamina_logits(llm, IDS), [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY,
                                                                                              use_tqdm=False)]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]

"""Block FP8 checkpoints (the Qwen "-FP8" releases' format): lamina reads the float8 weights with
their per-block scales and computes what transformers computes from the same files (it dequantizes
them off a GPU, as lamina does), whole and chunked; the result equals the float32 checkpoint of
the dequantized values bit for bit in every expert layout, block shape (partial blocks too), shard
split, tensor-parallel layout and with the MTP drafter; what lamina does not run is refused,
naming it, before any weight is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.models.loader import CheckpointError
from lamina.quantization import BlockFp8, dequantize
from tests import tiny_checkpoints as tc
from tests.fp8_checkpoint import fp8_copy, quantize_block_fp8
from tests.reference import lamina_logits, load_reference, reference_logits

ENGINE = dict(device="cpu", dtype="float32", show_progress=False)
IDS = [(i * 37 + 5) % 990 for i in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(i * 13 + s) % 990 for i in range(n)]} for s, n in ((1, 3), (2, 17), (3, 26))]


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory, qwen3_next_dir, qwen3_5_moe_dir):
    root = tmp_path_factory.mktemp("fp8")
    return {
        "qwen3_next": fp8_copy(qwen3_next_dir, root / "q3next", twin=root / "q3next_twin"),
        "qwen3_5_moe": fp8_copy(qwen3_5_moe_dir, root / "q35", twin=root / "q35_twin"),
        "qwen4_exp": fp8_copy(tc.make_qwen4_exp(root / "q4src"), root / "q4", twin=root / "q4_twin"),
    }


def _twin(path):
    return path.parent / (path.name + "_twin")


def _logits(path, chunks=None):
    with LLM(str(path), **ENGINE) as llm:
        return lamina_logits(llm, IDS, chunks)


def _weights(llm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in llm.engine.executor.runner.model.state_dict().items()}


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("chunks", [None, [15, 25]])
def test_agrees_with_transformers_on_the_same_files(fp8_dirs, family, chunks, qwen3_next_dir, qwen3_5_moe_dir):
    path = fp8_dirs[family]
    expected = reference_logits(load_reference(path), IDS)  # transformers dequantizes FP8 on the CPU
    ours = _logits(path, chunks)
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    if chunks is None:  # the quantization is really there: the unquantized original computes other logits
        original = {"qwen3_next": qwen3_next_dir, "qwen3_5_moe": qwen3_5_moe_dir}[family]
        assert (ours - _logits(original)).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "qwen4_exp"])
def test_weights_are_the_dequantized_values(fp8_dirs, family):
    """Every parameter equals the float32 checkpoint of the dequantized values (computed by the
    test's own code), bit for bit."""
    with LLM(str(fp8_dirs[family]), **ENGINE) as llm:
        ours = _weights(llm)
    with LLM(str(_twin(fp8_dirs[family])), **ENGINE) as llm:
        expected = _weights(llm)
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[k], expected[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], expected[k])]


@pytest.mark.parametrize("block, scales_apart", [((24, 40), False), ((16, 16), True)])
def test_fused_experts_partial_blocks_and_scales_in_another_shard(tmp_path, qwen3_next_fused_dir, block, scales_apart):
    """Fused 3-D experts (`experts.gate_up_proj` + `_scale_inv`), blocks that do not divide the
    weights (a partial last block has its own scale), scales kept in a shard of their own."""
    path = fp8_copy(qwen3_next_fused_dir, tmp_path / "fp8", block=block, scales_apart=scales_apart,
                    twin=tmp_path / "twin")
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"] if scales_apart else {}
    assert not scales_apart or any(n.endswith("experts.gate_up_proj_scale_inv") for n in names)
    torch.testing.assert_close(_logits(path), _logits(tmp_path / "twin"), atol=0, rtol=0)


def test_tensor_parallel_equals_one_rank(fp8_dirs):
    path = fp8_dirs["qwen3_next"]
    with LLM(str(path), **ENGINE) as llm:
        single = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(str(path), tensor_parallel_size=2, debug_layouts=True, **ENGINE) as llm:
        tp2 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tp2 == single


def test_mtp_drafter_weights_are_dequantized(tmp_path, qwen3_5_moe_dir):
    """A checkpoint's `mtp.*` linears are FP8 too: the drafter holds their dequantized values, and
    speculative decoding gives the twin's tokens and acceptance."""
    src = tc.add_mtp_weights(shutil.copytree(qwen3_5_moe_dir, tmp_path / "src"), fused_experts=True)
    path = fp8_copy(src, tmp_path / "fp8", twin=tmp_path / "twin")
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    runs = {}
    for name in ("fp8", "twin"):
        with LLM(str(tmp_path / name), **ENGINE, **spec) as llm:
            mtp = {k: v.clone() for k, v in llm.engine.executor.runner.model.mtp.state_dict().items()}
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            tokens = [o.outputs[0].token_ids for o in outs]
            runs[name] = (mtp, tokens, [o.spec_decode.accepted_per_position for o in outs])
    (mtp, tokens, accepted), (mtp_twin, tokens_twin, accepted_twin) = runs["fp8"], runs["twin"]
    assert any(k.endswith("fc.weight") for k in mtp)
    assert all(torch.equal(mtp[k], mtp_twin[k]) for k in mtp)
    assert tokens == tokens_twin and accepted == accepted_twin


def test_dequantize_with_partial_blocks_and_leading_dims():
    w = torch.randn(3, 40, 24)
    q, s = quantize_block_fp8(w, (16, 16))
    assert s.shape == (3, 3, 2)
    out = dequantize(q, s, BlockFp8(16, 16))
    expected = q.float().clone()
    for e in range(3):
        for r in range(40):
            for c in range(24):
                expected[e, r, c] *= s[e, r // 16, c // 16]
    assert torch.equal(out, expected)
    assert (out - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits
    with pytest.raises(ValueError, match=r"scale of shape \(3, 2, 2\)"):
        dequantize(q, s[:, :2], BlockFp8(16, 16))


# ---- refusals, before any weight is read ---------------------------------------------------------
def _edit_config(path, **quantization_config):
    config = json.loads((path / "config.json").read_text())
    qc = config.setdefault("quantization_config", {})
    for key, value in quantization_config.items():
        if value is None:
            qc.pop(key, None)
        else:
            qc[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("edit, message", [
    (dict(quant_method="awq"), r"quant_method = 'awq' is not supported; lamina runs quant_method 'fp8'"),
    (dict(weight_block_size=None), "without weight_block_size"),
    (dict(weight_block_size=[128]), r"weight_block_size = \[128\] must be two positive integers"),
    (dict(activation_scheme="static"), "activation_scheme = 'static' is not supported"),
    (dict(fmt="e5m2"), "fmt = 'e5m2' is not supported"),
])
def test_unsupported_quantization_configs_are_refused(fp8_dirs, tmp_path, monkeypatch, edit, message):
    path = _edit_config(shutil.copytree(fp8_dirs["qwen3_next"], tmp_path / "c"), **edit)
    monkeypatch.setattr("lamina.worker.model_loader.load_checkpoint",
                        lambda *a, **k: pytest.fail("weights were read before the refusal"))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), **ENGINE)


def _rewrite(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_a_missing_scale_is_named(fp8_dirs, tmp_path):
    name = "model.layers.0.linear_attn.out_proj.weight_scale_inv"
    path = _rewrite(shutil.copytree(fp8_dirs["qwen3_next"], tmp_path / "c"), lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="'model.layers.0.linear_attn.out_proj.weight' has no scale tensor"):
        LLM(str(path), **ENGINE)


def test_a_scale_grid_of_another_block_size_is_refused(fp8_dirs, tmp_path):
    path = _edit_config(shutil.copytree(fp8_dirs["qwen3_next"], tmp_path / "c"), weight_block_size=[32, 32])
    with pytest.raises(CheckpointError, match=r"in 32x32 blocks \(weight_block_size\) needs"):
        LLM(str(path), **ENGINE)


def test_float8_tensors_without_a_quantization_config_are_refused(fp8_dirs, tmp_path):
    path = shutil.copytree(fp8_dirs["qwen3_next"], tmp_path / "c")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is F8_E4M3 but config.json has no quantization_config"):
        LLM(str(path), **ENGINE)


def test_static_activation_scales_in_the_files_are_refused(fp8_dirs, tmp_path):
    path = _rewrite(shutil.copytree(fp8_dirs["qwen3_next"], tmp_path / "c"),
                    lambda t: t.update({"model.layers.0.linear_attn.out_proj.input_scale": torch.ones(())}))
    with pytest.raises(CheckpointError, match="is a static activation scale"):
        LLM(str(path), **ENGINE)


@pytest.mark.parametrize("option, quantized, message", [
    ("none", True, r"this checkpoint is block FP8 \(e4m3, 16x16 blocks\)"),
    ("awq", True, "quantization = 'awq' is not supported; supported: fp8"),
])
def test_the_quantization_option(fp8_dirs, qwen3_next_dir, option, quantized, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(fp8_dirs["qwen3_next"] if quantized else qwen3_next_dir), quantization=option, **ENGINE)


def test_quantization_fp8_runs_an_fp8_checkpoint(fp8_dirs):
    with LLM(str(fp8_dirs["qwen3_5_moe"]), quantization="fp8", **ENGINE) as llm:
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_serve_flag(fp8_dirs, qwen3_next_dir):
    from lamina.entrypoints.cli import build_parser, engine_kwargs
    from lamina.entrypoints.openai.serve_flags import check_compat_args

    args = build_parser().parse_args(["serve", str(fp8_dirs["qwen3_next"]), "--quantization", "fp8"])
    check_compat_args(args, args.model_tag)
    assert engine_kwargs(args)["quantization"] == "fp8"
    args = build_parser().parse_args(["serve", str(qwen3_next_dir), "-q", "fp8"])
    check_compat_args(args, args.model_tag)  # an unquantized checkpoint: its experts quantized at load
    assert engine_kwargs(args)["quantization"] == "fp8"

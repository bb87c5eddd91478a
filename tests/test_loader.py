"""Checkpoint loading: layouts, side tensors, and clear errors before weights are read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lamina import LLM
from lamina.models.loader import CheckpointError
from tests import tiny_checkpoints as tc
from tests.reference import lamina_logits, load_reference, reference_logits


def _llm(path, **kw):
    return LLM(str(path), device="cpu", dtype="float32", show_progress=False, **kw)


def test_mtp_tensors_are_set_aside(qwen3_next_dir, tmp_path):
    path = shutil.copytree(qwen3_next_dir, tmp_path / "ckpt")
    tc.add_mtp_tensors(path)
    with _llm(path) as llm:
        side = llm.engine.load_report.side_tensors
        assert set(side) == {"mtp.fc.weight", "mtp.norm.weight"}
        assert side["mtp.fc.weight"][1] == (64, 128)


def test_tied_embeddings_match_transformers(tmp_path):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(5)
    common = dict(tc.COMMON, tie_word_embeddings=True)
    config = Qwen3NextConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                             intermediate_size=96, **common)
    path = tc._save(Qwen3NextForCausalLM(config), tmp_path / "tied", 5)
    with load_file(str(path / "model.safetensors")) if False else torch.no_grad():
        names = load_file(str(path / "model.safetensors")).keys()
    assert "lm_head.weight" not in names  # transformers drops the tied copy
    tokens = list(range(3, 40))
    with _llm(path) as llm:
        ours = lamina_logits(llm, tokens)
    torch.testing.assert_close(ours, reference_logits(load_reference(path), tokens), atol=2e-4, rtol=2e-4)


def test_bf16_dtype_conversion(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), device="cpu", dtype="bfloat16", show_progress=False) as llm:
        model = llm.engine.executor.runner.model
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 16


def test_path_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        _llm(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        _llm(tmp_path / "nope")


def test_path_without_weights(qwen3_next_dir, tmp_path):
    shutil.copy(qwen3_next_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no weights"):
        _llm(tmp_path)


def test_truncated_safetensors_named(qwen3_next_dir, tmp_path):
    path = shutil.copytree(qwen3_next_dir, tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated"):
        _llm(path)


def test_missing_tensor_named(qwen3_next_dir, tmp_path):
    path = shutil.copytree(qwen3_next_dir, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        _llm(path)
    message = str(err.value)
    assert "model.layers.1.self_attn.k_norm.weight" in message
    assert "model.layers.2.mlp.experts" in message


def test_misshaped_tensor_named(qwen3_next_dir, tmp_path):
    path = shutil.copytree(qwen3_next_dir, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.linear_attn.out_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.linear_attn\.out_proj\.weight.*\(64, 32\).*\(64, 64\)"):
        _llm(path)


def test_unknown_architecture_lists_supported(qwen3_next_dir, tmp_path):
    path = shutil.copytree(qwen3_next_dir, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*Qwen3NextForCausalLM.*Qwen3_5MoeForCausalLM"):
        _llm(path)


def test_sharded_index_with_missing_shard(qwen3_next_fused_dir, tmp_path):
    path = shutil.copytree(qwen3_next_fused_dir, tmp_path / "ckpt")
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="do not exist"):
        _llm(path)

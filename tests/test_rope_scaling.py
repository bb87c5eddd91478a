"""Scaled RoPE from a checkpoint's `rope_parameters` (the Qwen model cards' way past the native
context: rope_type "yarn" with a factor over `original_max_position_embeddings`): the frequencies
and the cos / sin factor come from transformers' own rope init functions, and the model agrees with
transformers past the original length, whole and chunked. Types whose frequencies follow the
sequence's length (dynamic NTK, longrope) and the others lamina has not checked against transformers
are refused before any weight is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lamina import LLM
from tests.reference import lamina_logits, load_reference, reference_logits
from tests.tiny_checkpoints import COMMON, LAYER_TYPES, _save

ENGINE = dict(device="cpu", dtype="float32", show_progress=False)
IDS = [(i * 37 + 5) % 990 for i in range(300)]  # past the original 128 positions
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25}


def _checkpoint(path, rope_parameters: dict):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(3)
    config = Qwen3_5MoeTextConfig(num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, **COMMON,
                                  rope_parameters=rope_parameters)
    return _save(Qwen3_5MoeForCausalLM(config).float(), path, 3)


@pytest.fixture(scope="module")
def yarn_dir(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("yarn") / "ckpt", YARN)


def _with_rope(src, dst, rope_parameters: dict):
    """The same weights under other rope_parameters."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["rope_parameters"] = rope_parameters
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("chunks", [None, [100, 60, 140]])
def test_yarn_agrees_with_transformers_past_the_original_length(yarn_dir, chunks):
    expected = reference_logits(load_reference(yarn_dir), IDS)
    with LLM(str(yarn_dir), **ENGINE) as llm:
        rotary = llm.engine.executor.runner.model.rotary
        assert rotary.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
        ours = lamina_logits(llm, IDS, chunks)
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_the_scaling_is_not_a_no_op(yarn_dir, tmp_path):
    """The same weights with plain RoPE give other logits past the original length (so the test above
    would see a yarn config read as plain RoPE)."""
    plain = _with_rope(yarn_dir, tmp_path / "plain", {"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.25})
    with LLM(str(yarn_dir), **ENGINE) as llm:
        scaled = lamina_logits(llm, IDS)
    with LLM(str(plain), **ENGINE) as llm:
        unscaled = lamina_logits(llm, IDS)
    assert (scaled[200:] - unscaled[200:]).abs().max() > 1e-2


def test_linear_scaling_agrees_with_transformers(yarn_dir, tmp_path):
    linear = _with_rope(yarn_dir, tmp_path / "linear", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.25})
    expected = reference_logits(load_reference(linear), IDS[:160])
    with LLM(str(linear), **ENGINE) as llm:
        torch.testing.assert_close(lamina_logits(llm, IDS[:160]), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("rope_type", ["dynamic", "llama3"])
def test_other_scalings_are_refused_before_loading(yarn_dir, tmp_path, rope_type):
    extra = {"low_freq_factor": 1.0, "high_freq_factor": 4.0} if rope_type == "llama3" else {}
    path = _with_rope(yarn_dir, tmp_path / rope_type, {**YARN, "rope_type": rope_type, **extra})
    (path / "model.safetensors").write_bytes(b"not read")  # the refusal comes before any weight is read
    with pytest.raises(ValueError, match=rf"rope_type '{rope_type}' is not supported; supported: 'default', 'yarn', "
                                         r"'linear'"):
        LLM(str(path), **ENGINE)


def test_qwen4_exp_refuses_scaled_rope(tmp_path):
    from lamina.models.qwen4_exp_config import parse_qwen4_exp_text_config

    class Config:  # only what the check reads first
        rope_parameters = {"rope_type": "yarn", "factor": 4.0}

    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported for Qwen4-Exp"):
        parse_qwen4_exp_text_config(Config(), "Qwen4ExpForCausalLM")


def test_tp2_with_yarn_equals_one_rank(yarn_dir):
    from lamina import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": IDS[:n]} for n in (150, 220)]
    outs = {}
    for tp in (1, 2):
        with LLM(str(yarn_dir), tensor_parallel_size=tp, max_num_batched_tokens=64, **ENGINE) as llm:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[2] == outs[1]


def test_the_context_limit_follows_the_scaling_as_vllm_derives_it(yarn_dir, tmp_path):
    """The Qwen cards extend the native length by rope_parameters alone: YaRN's factor x
    original_max_position_embeddings is the limit (here 4 x 128 over a config that says 128)."""
    config = json.loads((yarn_dir / "config.json").read_text())
    native = _with_rope(yarn_dir, tmp_path / "native", config["rope_parameters"])
    config["max_position_embeddings"] = 128
    (native / "config.json").write_text(json.dumps(config))
    with LLM(str(native), **ENGINE) as llm:
        assert llm.engine.max_model_len == 512
    with pytest.raises(ValueError, match=r"max_model_len = 600 exceeds the model's context of 512 tokens "
                                         r"\(max_position_embeddings, or what its rope_parameters scale it to\)"):
        LLM(str(native), max_model_len=600, **ENGINE)


@pytest.mark.gpu
def test_yarn_on_the_gpu_agrees_with_the_fp32_reference(yarn_dir):
    """bf16 on CUDA (graphs, the Triton q/k kernel reading the scaled cos / sin) past the original
    length: every greedy token within 0.05 of the reference's best logit (near-tie rule)."""
    from lamina import SamplingParams

    prompt = IDS[:200]
    with LLM(str(yarn_dir), device="cuda", dtype="bfloat16", show_progress=False) as llm:
        assert llm.engine.cuda_graphs
        [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=12,
                                                                          ignore_eos=True), use_tqdm=False)
    tokens = out.outputs[0].token_ids
    logits = reference_logits(load_reference(yarn_dir), prompt + tokens)
    for j, token in enumerate(tokens):
        row = logits[len(prompt) + j - 1]
        assert row[token] >= row.max() - 0.05, f"token {j} is {row.max() - row[token]:.4f} below the max"

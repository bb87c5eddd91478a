"""vLLM's `hf_overrides` / `--hf-overrides`: a JSON object laid over config.json before anything
reads it, nested objects merged key by key. The Qwen model cards extend the context this way
(`{"text_config": {"rope_parameters": {"rope_type": "yarn", ...}}}`): the overridden model equals
the one whose config.json says the same, agrees with transformers on it, and every rank of a
tensor-parallel engine reads the same overridden config."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.config import EngineArgs
from lamina.worker.model_loader import merge_overrides
from tests.reference import lamina_logits, load_reference, reference_logits

ENGINE = dict(device="cpu", dtype="float32", show_progress=False)
IDS = [(i * 37 + 5) % 990 for i in range(200)]  # past the original 128 positions
# the Qwen3.5 cards' override, with this tiny model's original length
CARD = {"text_config": {"rope_parameters": {
    "mrope_interleaved": True, "mrope_section": [1, 1, 0], "rope_type": "yarn", "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25, "factor": 4.0, "original_max_position_embeddings": 128}}}


@pytest.fixture(scope="module")
def edited_dir(tmp_path_factory, qwen3_5_moe_vl_dir):
    """The same checkpoint with the override written into its config.json."""
    path = shutil.copytree(qwen3_5_moe_vl_dir, tmp_path_factory.mktemp("edited") / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(merge_overrides(config, CARD)))
    return path


def _prompt_logprobs(llm) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": IDS}], params, use_tqdm=False)[0]
    return [float(getattr(e[t], "logprob", e[t])) for e, t in zip(out.prompt_logprobs[1:], IDS[1:])]


def test_merge_is_key_by_key():
    config = {"a": 1, "text_config": {"b": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}}
    merged = merge_overrides(config, {"text_config": {"rope_parameters": {"rope_type": "yarn"}}, "c": [1]})
    assert merged == {"a": 1, "c": [1], "text_config": {"b": 2, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5.0}}}
    assert config["text_config"]["rope_parameters"]["rope_type"] == "default"  # not modified in place


def test_the_cards_yarn_override_equals_the_edited_config(qwen3_5_moe_vl_dir, edited_dir):
    with LLM(str(qwen3_5_moe_vl_dir), hf_overrides=CARD, **ENGINE) as llm:
        rotary = llm.engine.executor.runner.model.rotary
        assert rotary.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
        overridden = lamina_logits(llm, IDS)
    with LLM(str(edited_dir), **ENGINE) as llm:
        assert torch.equal(overridden, lamina_logits(llm, IDS))
    expected = reference_logits(load_reference(edited_dir), IDS)
    torch.testing.assert_close(overridden, expected, atol=2e-5, rtol=0)
    with LLM(str(qwen3_5_moe_vl_dir), **ENGINE) as llm:  # the override is not a no-op
        assert (overridden[150:] - lamina_logits(llm, IDS)[150:]).abs().max() > 1e-2


def test_every_rank_reads_the_overridden_config(qwen3_5_moe_vl_dir):
    with LLM(str(qwen3_5_moe_vl_dir), hf_overrides=CARD, **ENGINE) as llm:
        single = _prompt_logprobs(llm)
    with LLM(str(qwen3_5_moe_vl_dir), hf_overrides=CARD, tensor_parallel_size=2, **ENGINE) as llm:
        tp2 = _prompt_logprobs(llm)
    with LLM(str(qwen3_5_moe_vl_dir), tensor_parallel_size=2, **ENGINE) as llm:
        plain = _prompt_logprobs(llm)
    torch.testing.assert_close(torch.tensor(tp2), torch.tensor(single), atol=1e-5, rtol=0)
    assert max(abs(a - b) for a, b in zip(tp2[150:], plain[150:])) > 1e-3


def test_the_context_limit_follows_the_override(qwen3_5_moe_vl_dir):
    """yarn: factor x original_max_position_embeddings (512 x 4 here) is the model's context."""
    override = {"text_config": {"rope_parameters": dict(CARD["text_config"]["rope_parameters"],
                                                        original_max_position_embeddings=512)}}
    with pytest.raises(ValueError, match="exceeds the model's context of 512 tokens"):
        LLM(str(qwen3_5_moe_vl_dir), max_model_len=2048, **ENGINE)
    with LLM(str(qwen3_5_moe_vl_dir), max_model_len=2048, hf_overrides=override, **ENGINE) as llm:
        assert llm.engine.max_model_len == 2048


def test_an_override_lamina_refuses_is_refused(qwen3_5_moe_vl_dir):
    with pytest.raises(ValueError, match="dynamic"):
        LLM(str(qwen3_5_moe_vl_dir), hf_overrides={"text_config": {"rope_parameters": {"rope_type": "dynamic",
                                                                                      "factor": 2.0}}}, **ENGINE)


def test_not_a_dict_is_refused():
    with pytest.raises(ValueError, match="hf_overrides must be a dict of config.json keys"):
        EngineArgs(hf_overrides='{"a": 1}').validate()


def test_cli_flag(capsys):
    from lamina.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "/m", "--hf-overrides", json.dumps(CARD)])
    assert engine_kwargs(args)["hf_overrides"] == CARD
    for bad, message in (("{oops", "not valid JSON"), ("[1, 2]", "must be a JSON object")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "--hf-overrides", bad])
        assert message in capsys.readouterr().err

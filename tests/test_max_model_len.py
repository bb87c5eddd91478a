"""max_model_len as vLLM spells it: human-readable counts ("32k", "32K") and "auto" / -1, the model's
own length if the memory holds it, else the longest that fits (lamina.engine.memory_plan on a GPU,
the KV budget elsewhere)."""

from __future__ import annotations

import argparse
import json

import pytest

from lamina import LLM, SamplingParams
from lamina.config import AUTO, EngineArgs, parse_max_model_len
from lamina.engine.llm_engine import LLMEngine
from lamina.engine.memory_plan import GIB, MIB
from tests.test_memory_plan import BLOCK, STATE, _fake_engine, _plan, h100  # noqa: F401 (h100: a fixture)

ENGINE = dict(device="cpu", dtype="float32", show_progress=False)


@pytest.mark.parametrize("value,expected", [
    (None, None), (4096, 4096), (-1, AUTO), ("auto", AUTO), ("AUTO", AUTO), ("-1", AUTO), ("2048", 2048),
    ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("16.1k", 16_100), ("128.2k", 128_200), ("2.01k", 2_010),
    ("1M", 1 << 20), ("1m", 1_000_000),
])
def test_vllm_spellings(value, expected):
    assert parse_max_model_len(value) == expected


@pytest.mark.parametrize("value", [0, -2, True, 1.5, "0", "-5", "1.5", "abc", "k", "2.5K0", "nan", "infk", "1e3k",
                                   "1.5K", "1.0005k"])
def test_bad_spellings_are_refused(value):
    with pytest.raises(ValueError, match="max_model_len"):
        parse_max_model_len(value)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineArgs(max_model_len=value).validate()


def test_the_cli_parses_them_and_refuses_with_its_usage(capsys):
    from lamina.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--max-model-len", "32K"]))["max_model_len"] == 32_768
    assert engine_kwargs(parser.parse_args(["--max-model-len", "auto"]))["max_model_len"] == AUTO
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", "12x"])
    assert "max_model_len '12x' is not a positive token count" in capsys.readouterr().err


# ---- the memory plan -------------------------------------------------------------------------


def test_auto_keeps_the_models_length_when_it_fits():
    whole = _plan(usable_bytes=60 * GIB, max_num_seqs=64, fit_max_model_len=True)
    assert (whole.max_model_len, whole.max_num_seqs) == (2048, 64)
    assert whole.num_kv_blocks == _plan(usable_bytes=60 * GIB, max_num_seqs=64).num_kv_blocks


def test_auto_keeps_a_length_one_request_fits_at_lowering_the_default_count():
    """vLLM's rule: the model's length if it fits. At 150k tokens on 6 GiB a few requests fit whole:
    auto plans what no max_model_len at all plans (a default max_num_seqs lowered), not a shorter length."""
    auto = _plan(max_model_len=150_000, fit_max_model_len=True)
    given = _plan(max_model_len=150_000)
    assert auto == given and auto.max_model_len == 150_000 and auto.lowered_from == 256


def test_auto_shortens_a_length_the_memory_cannot_hold():
    """A 262,144-token model on 6 GiB: the default max_num_seqs goes to the balanced count (states at
    most half of what the headroom leaves) and max_model_len to the KV cache left beside them."""
    long_model = dict(max_model_len=262_144, fit_max_model_len=True)
    plan = _plan(**long_model)
    n = plan.max_num_seqs
    assert 2 * (n + 1) * STATE <= 6 * GIB - (GIB + n * 16 * MIB) < 2 * (n + 2) * STATE  # the balanced count
    assert plan.lowered_from == 256
    kv_blocks = (6 * GIB - (n + 1) * STATE - GIB - n * 16 * MIB) // BLOCK
    assert plan.max_model_len == kv_blocks * 16 < 262_144 and plan.num_kv_blocks == kv_blocks
    assert plan.state_bytes + plan.activation_bytes + plan.kv_cache_bytes <= 6 * GIB
    # An explicit max_num_seqs keeps its count; the length takes what is left.
    given = _plan(max_num_seqs=8, max_num_seqs_is_default=False, **long_model)
    assert given.max_num_seqs == 8 and given.lowered_from is None
    assert given.max_model_len == (6 * GIB - 9 * STATE - GIB - 8 * 16 * MIB) // BLOCK * 16
    # Without auto the same model is refused, naming max_model_len and the length that would fit
    with pytest.raises(ValueError, match=rf"max_model_len = 262144 .* lower max_model_len \(max_model_len = "
                                         rf"{given.max_model_len} fits beside 8 requests; max_model_len='auto' takes"):
        _plan(max_num_seqs=8, max_num_seqs_is_default=False, max_model_len=262_144)
    with pytest.raises(ValueError, match=r"lower max_model_len \(max_model_len = \d+ fits beside 1 request; "
                                         r"max_model_len='auto' takes the longest that fits\), and max_num_seqs or"):
        _plan(max_num_seqs=100, max_num_seqs_is_default=False, max_model_len=262_144)  # 100 leave no room: 1 does


def test_auto_refuses_a_max_num_seqs_that_leaves_no_kv_block():
    with pytest.raises(ValueError, match=r"max_model_len auto: max_num_seqs = 200 leaves no room for even one KV "
                                         r"block.*At most max_num_seqs = \d+ fit"):
        _plan(max_num_seqs=200, max_num_seqs_is_default=False, max_model_len=262_144, fit_max_model_len=True)


def test_the_engine_fits_max_model_len_on_an_h100(h100, caplog):
    engine = _fake_engine(max_model_len="auto")
    engine.max_model_len = 262_144  # the released Qwen3.5-35B-A3B's max_position_embeddings
    with caplog.at_level("WARNING"):
        num_blocks, seqs = LLMEngine._num_kv_blocks(engine, 256, 8192)
    assert 16 <= seqs < 64 and 2048 < engine.max_model_len < 262_144
    assert engine.max_model_len == engine.memory_plan.max_model_len == num_blocks * 16
    assert f"max_model_len auto: {engine.max_model_len} tokens" in caplog.text
    explicit = _fake_engine(max_model_len=262_144)
    explicit.max_model_len = 262_144
    with pytest.raises(ValueError, match="max_model_len = 262144"):
        LLMEngine._num_kv_blocks(explicit, 256, 8192)


def test_lamina_plan_previews_the_fitted_length(capsys):
    from lamina.entrypoints.cli import main as cli_main
    from lamina.entrypoints.presets import DEFAULT_PRESET, preset_dir

    def memory(*flags):
        assert cli_main(["plan", str(preset_dir(DEFAULT_PRESET)), "--dtype", "bfloat16", "--json",
                         "--gpu-memory-gib", "79.4", *flags]) == 0  # an 80 GB card; tight at 60 requests
        return json.loads(capsys.readouterr().out)["ranks"][0]["gpu_memory"]

    whole = memory("--max-model-len", "auto")  # the preset's 32,768 tokens fit beside the balanced count
    assert whole["fits"] and whole["max_model_len"] == 32_768
    tight = memory("--max-model-len", "auto", "--max-num-seqs", "60")
    assert tight["fits"] and tight["max_num_seqs"] == 60 and tight["max_model_len"] < 32_768
    assert not memory("--max-model-len", "32K", "--max-num-seqs", "60")["fits"]
    # several ranks: one engine plans for the tightest (PP2 stages of 18 and 22 layers: the second holds more)
    assert cli_main(["plan", str(preset_dir(DEFAULT_PRESET)), "--dtype", "bfloat16", "--json", "-pp", "2",
                     "--pp-layer-partition", "18,22", "--gpu-memory-gib", "45.3", "--max-model-len", "auto",
                     "--max-num-seqs", "64"]) == 0
    data = json.loads(capsys.readouterr().out)
    first, second = (r["gpu_memory"] for r in data["ranks"])
    assert first["max_model_len"] == 32_768 > second["max_model_len"]
    assert data["gpu_memory"] == {"max_num_seqs": 64, "max_model_len": second["max_model_len"],
                                  "kv_cache_tokens": second["kv_cache_tokens"]}


# ---- off a GPU: the KV budget ------------------------------------------------------------------


def test_auto_on_the_cpu_fits_the_kv_budget(qwen3_5_moe_dir):
    block_bytes = None
    with LLM(str(qwen3_5_moe_dir), max_model_len="auto", **ENGINE) as llm:
        model_len = llm.engine.max_model_len
        block_bytes = llm.engine.executor.bytes_per_block(16)
    budget_blocks = 20  # 320 tokens, under the tiny model's 512
    with LLM(str(qwen3_5_moe_dir), max_model_len="auto", kv_cache_memory_bytes=budget_blocks * block_bytes,
             **ENGINE) as llm:
        assert llm.engine.max_model_len == budget_blocks * 16 < model_len  # shortened to the budget
        [out] = llm.generate({"prompt_token_ids": list(range(1, 30))}, SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate({"prompt_token_ids": list(range(1, budget_blocks * 16 + 5))}, SamplingParams(max_tokens=1),
                         use_tqdm=False)
    with LLM(str(qwen3_5_moe_dir), max_model_len=-1, num_gpu_blocks_override=24, **ENGINE) as llm:
        assert llm.engine.max_model_len == 24 * 16
    with pytest.raises(ValueError, match=r"max_model_len auto: the KV budget \(100 bytes .* holds no block"):
        LLM(str(qwen3_5_moe_dir), max_model_len="auto", kv_cache_memory_bytes=100, **ENGINE)

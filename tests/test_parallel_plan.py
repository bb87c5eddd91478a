"""ParallelPlan: stage split, validation before weights, SP and expert placement, `lamina plan`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import Qwen3NextConfig

from lamina.entrypoints.cli import main as cli_main
from lamina.models.qwen3_next import Qwen3NextForCausalLM
from lamina.parallel.config import ParallelConfig
from lamina.parallel.plan import ParallelConfigError, build_plan, default_partition


def real_qwen3_next(num_layers=48):
    hf = Qwen3NextConfig(num_hidden_layers=num_layers, vocab_size=151936, hidden_size=2048, num_attention_heads=16,
                         num_key_value_heads=2, num_experts=512, num_experts_per_tok=10)
    hf.architectures = ["Qwen3NextForCausalLM"]
    return hf, Qwen3NextForCausalLM.parse_config(hf, "Qwen3NextForCausalLM")


@pytest.mark.parametrize("layers, pp, expected", [
    (48, 5, [9, 10, 10, 10, 9]), (48, 4, [12, 12, 12, 12]), (5, 2, [3, 2]), (7, 3, [2, 3, 2]), (10, 4, [2, 3, 3, 2]),
    (3, 3, [1, 1, 1]),
])
def test_default_partition(layers, pp, expected):
    assert default_partition(layers, pp) == expected
    assert expected[-1] == layers // pp  # the last stage never gets an extra layer


def test_partition_flag_wins_over_env(monkeypatch):
    _, cfg = real_qwen3_next()
    monkeypatch.setenv("LAMINA_PP_LAYER_PARTITION", "10,10,10,18")
    plan = build_plan(cfg, ParallelConfig(pipeline_parallel_size=4))
    assert plan.stage_sizes == (10, 10, 10, 18) and plan.partition_source == "LAMINA_PP_LAYER_PARTITION"
    plan = build_plan(cfg, ParallelConfig(pipeline_parallel_size=4, pp_layer_partition="2,16,16,14"))
    assert plan.stage_sizes == (2, 16, 16, 14) and plan.partition_source == "--pp-layer-partition"
    assert plan.stage_of_layer(1) == 0 and plan.stage_of_layer(2) == 1 and plan.stage_of_layer(47) == 3


def test_vllm_partition_env_is_an_alias(monkeypatch, caplog):
    _, cfg = real_qwen3_next()
    monkeypatch.delenv("LAMINA_PP_LAYER_PARTITION", raising=False)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "11,12,12,13")
    with caplog.at_level("INFO", logger="lamina.parallel.config"):
        plan = build_plan(cfg, ParallelConfig(pipeline_parallel_size=4))
    assert plan.stage_sizes == (11, 12, 12, 13) and plan.partition_source == "VLLM_PP_LAYER_PARTITION"
    assert "read from VLLM_PP_LAYER_PARTITION" in caplog.text
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,2")
    with pytest.raises(ParallelConfigError, match="VLLM_PP_LAYER_PARTITION = '1,2' sums to 3"):  # same checks
        build_plan(cfg, ParallelConfig(pipeline_parallel_size=2))
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "10,10,10,18")
    monkeypatch.setenv("LAMINA_PP_LAYER_PARTITION", "10, 10, 10, 18")  # the same value: fine
    assert build_plan(cfg, ParallelConfig(pipeline_parallel_size=4)).partition_source == "LAMINA_PP_LAYER_PARTITION"
    monkeypatch.setenv("LAMINA_PP_LAYER_PARTITION", "12,12,12,12")
    with pytest.raises(ValueError, match="LAMINA_PP_LAYER_PARTITION = '12,12,12,12' and VLLM_PP_LAYER_PARTITION = "
                                         "'10,10,10,18' disagree"):
        build_plan(cfg, ParallelConfig(pipeline_parallel_size=4))
    plan = build_plan(cfg, ParallelConfig(pipeline_parallel_size=4, pp_layer_partition="2,16,16,14"))
    assert plan.partition_source == "--pp-layer-partition"  # the flag still wins


@pytest.mark.parametrize("spec, match", [
    ("0,48", "at least one layer"), ("1,2", "sums to 3 but the model has 48"), ("a,47", "'a' is not an integer"),
    ("24,24,0", "has 3 entries but pipeline_parallel_size = 2"), ("-1,49", "at least one layer"),
])
def test_partition_refusals(spec, match):
    _, cfg = real_qwen3_next()
    with pytest.raises(ParallelConfigError, match=match):
        build_plan(cfg, ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=spec))


def test_validation_names_value_and_valid_choices():
    _, cfg = real_qwen3_next()
    with pytest.raises(ParallelConfigError, match=r"num_attention_heads = 16 is not divisible by tensor_parallel_size = 3; valid"):
        build_plan(cfg, ParallelConfig(tensor_parallel_size=3))
    with pytest.raises(ParallelConfigError, match=r"num_experts = 512 is not divisible by EP size .* = 6"):
        build_plan(cfg, ParallelConfig(tensor_parallel_size=2, data_parallel_size=3, enable_expert_parallel=True))
    with pytest.raises(ParallelConfigError, match="needs 8 GPUs per node .* but 2 are available"):
        build_plan(cfg, ParallelConfig(tensor_parallel_size=8), num_devices=2, device_type="cuda")
    with pytest.raises(ParallelConfigError, match="exceeds the model's 48 layers"):
        build_plan(cfg, ParallelConfig(pipeline_parallel_size=49))
    with pytest.raises(ParallelConfigError, match="sequence_parallel_moe = on needs tensor_parallel_size > 1"):
        build_plan(cfg, ParallelConfig(sequence_parallel_moe="on"))
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        ParallelConfig(tensor_parallel_size=0)
    hf, _ = real_qwen3_next()
    hf.vocab_size = 151937
    cfg = Qwen3NextForCausalLM.parse_config(hf, "Qwen3NextForCausalLM")
    with pytest.raises(ParallelConfigError, match="vocab_size = 151937 is not divisible by tensor_parallel_size = 2"):
        build_plan(cfg, ParallelConfig(tensor_parallel_size=2))


def test_kv_heads_replicated_beyond_their_count():
    _, cfg = real_qwen3_next()
    plan = build_plan(cfg, ParallelConfig(tensor_parallel_size=4))
    assert plan.kv_heads_replicated


def test_sp_auto_rule_and_expert_placement():
    _, cfg = real_qwen3_next()
    off = build_plan(cfg, ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True))
    assert not off.sp and "DP > 1" in off.sp_reason
    on = build_plan(cfg, ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True))
    assert on.sp and on.ep_size == 4
    assert [r.experts for r in on.ranks] == [(0, 128), (128, 256), (256, 384), (384, 512)]
    assert [(r.dp, r.tp, r.ep) for r in on.ranks] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    forced = build_plan(cfg, ParallelConfig(tensor_parallel_size=2, sequence_parallel_moe="on"))
    assert forced.sp and not forced.ep_enabled


def _write_real_config(tmp_path):
    hf, _ = real_qwen3_next()
    hf.save_pretrained(tmp_path)
    return tmp_path


def test_plan_command_text_and_json(tmp_path, capsys):
    path = _write_real_config(tmp_path)
    assert cli_main(["plan", str(path), "-pp", "5", "-tp", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "stages (default): 9, 10, 10, 10, 9" in out
    assert "rank 9 (node 0, cpu): dp 0 pp 4 tp 1" in out and "layers 39-47 (9)" in out
    assert "pipeline boundary: hidden states [T, 2048]" in out
    assert cli_main(["plan", str(path), "-pp", "2", "-tp", "2", "-dp", "2", "--enable-expert-parallel", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["sp"] and data["world_size"] == 8 and len(data["ranks"]) == 8
    rank0 = data["ranks"][0]
    assert rank0["coords"]["experts"] == [0, 128] and rank0["estimate"]["weight_bytes"] > 0
    assert rank0["estimate"]["kv_bytes_per_token"] > 0 and rank0["estimate"]["state_bytes_per_request"] > 0
    assert data["boundary"]["shape"] == "[ceil(T/2), 2048]"


@pytest.mark.parametrize("partition", ["0,4", "1,2", "a,3"])
def test_plan_command_refusals_exit_2(tmp_path, partition, capsys):
    """In process (`lamina.entrypoints.cli.main`, whose return value the module's `__main__` passes
    to `sys.exit`); test_plan_command_refusal_exit_status_of_the_process runs one as a process."""
    path = _write_real_config(tmp_path)
    assert cli_main(["plan", str(path), "-pp", "2", "--pp-layer-partition", partition]) == 2
    err = capsys.readouterr().err
    assert "--pp-layer-partition" in err and partition in err


def test_plan_command_refusal_exit_status_of_the_process(tmp_path):
    path = _write_real_config(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "lamina.entrypoints.cli", "plan", str(path), "-pp", "2", "--pp-layer-partition", "1,2"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--pp-layer-partition" in proc.stderr and "1,2" in proc.stderr


def test_plan_qwen4_exp_real_size_pp5_ple_on_a_later_stage(tmp_path, capsys):
    from transformers import Qwen4ExpTextConfig

    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12
    hf = Qwen4ExpTextConfig(
        num_hidden_layers=48, layer_types=layer_types, hidden_size=2560, vocab_size=248320, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=640, hc_count=4, ple_layer_ids=[2], ple_embed_dim=2560,
        ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000, split_ngram_parts=512,
        indexer_n_heads=64, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        eos_token_id=248044,
    )
    hf.architectures = ["Qwen4ExpForCausalLM"]
    hf.save_pretrained(tmp_path)
    assert cli_main(["plan", str(tmp_path), "-pp", "5", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "stages (default): 9, 10, 10, 10, 9" in out
    assert "pipeline boundary: hyper-connection streams [T, 10240]" in out
    assert "      1 linear/MoE/PLE" in out and "      3 indexed/MoE" in out
    assert "PLE table 95.37 GiB" in out
    # the PLE layer on stage 1: accepted, and the plan shows it there
    assert cli_main(["plan", str(tmp_path), "-pp", "2", "--pp-layer-partition", "1,47", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"][1]["coords"]["layer_range"] == [1, 48] and data["layer_kinds"][1] == "linear/MoE/PLE"
    assert data["ranks"][1]["estimate"]["ple_table_bytes"] > 0 and data["ranks"][0]["estimate"]["ple_table_bytes"] == 0
    full = data["ranks"][1]["estimate"]["ple_table_bytes"]
    # TP shards the table along its embedding dim: each rank holds half
    assert cli_main(["plan", str(tmp_path), "-tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["estimate"]["ple_table_bytes"] for r in data["ranks"]] == [full // 2, full // 2]

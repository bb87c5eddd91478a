"""`lamina bench latency | throughput` on the CPU with a tiny checkpoint: the records and the table
(the roofline fields need a GPU: they are measured on the device machine, docs/PERFORMANCE.md)."""

from __future__ import annotations

import json

from lamina.entrypoints.bench import SHARED_KEYS
from lamina.entrypoints.cli import main

COMMON = ["--device", "cpu", "--dtype", "float32", "--input-len", "6", "--output-len", "4"]


def test_bench_latency_writes_a_record_per_batch_size(qwen3_next_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(qwen3_next_dir), *COMMON, "--batch-size", "1", "2",
                 "--output-json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["batch_size"] for r in records] == [1, 2]
    for r in records:
        assert set(SHARED_KEYS) <= set(r) and r["concurrency"] == r["num_prompts"] == r["batch_size"]
        assert r["kind"] == "latency" and r["gpu"] == "cpu" and r["dtype"] == "float32"
        assert r["decode_steps"] == 3 and r["tpot_ms"] > 0 and r["ttft_ms"] > 0
        assert r["prefill_graph_steps"] == 0  # the CPU: no graphs
        # the steps up to the first token: their wall times sum to at most the TTFT
        assert r["first_token_steps_ms"] and 0 < sum(r["first_token_steps_ms"]) <= r["ttft_ms"] + 1e-3
        assert abs(r["output_tok_per_s"] - r["batch_size"] / (r["tpot_ms"] / 1e3)) < 1e-6
    assert "| batch_size |" in capsys.readouterr().out


def test_roofline_only_where_the_bench_reads_the_model(qwen3_next_dir):
    """The roofline needs the model in the bench's process (routed experts, weight bytes): one GPU.
    With several ranks the records carry TPOT and tok/s only (reading the ranks' models crashed a
    tensor-parallel latency run on GPUs after its first batch size)."""
    import torch

    from lamina.entrypoints.bench import _engine_kwargs, measures_roofline
    from lamina.entrypoints.cli import build_parser

    def kwargs(*flags):
        return _engine_kwargs(build_parser().parse_args(["bench", "latency", "--model", str(qwen3_next_dir), *flags]))

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert measures_roofline(cuda, kwargs()) and not measures_roofline(cpu, kwargs())
    for flags in (["-tp", "2"], ["-pp", "2"], ["-dp", "2"]):
        assert not measures_roofline(cuda, kwargs(*flags)), flags


def test_bench_latency_with_tensor_parallel_ranks(qwen3_next_dir, tmp_path):
    out = tmp_path / "latency_tp2.json"
    assert main(["bench", "latency", "--model", str(qwen3_next_dir), *COMMON, "--batch-size", "2", "-tp", "2",
                 "--output-json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["decode_steps"] == 3 and record["tpot_ms"] > 0 and "-tp 2" in record["command"]


def test_bench_throughput(qwen3_next_dir, tmp_path):
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(qwen3_next_dir), *COMMON, "--num-prompts", "3",
            "--output-json", str(out)]
    assert main(argv) == 0
    [record] = json.loads(out.read_text())
    assert set(SHARED_KEYS) <= set(record) and record["command"] == "lamina " + " ".join(argv)
    assert record["kind"] == "throughput" and record["num_prompts"] == 3 and record["output_tokens"] == 3 * 4
    assert record["gpu"] == "cpu" and record["dtype"] == "float32" and record["tpot_ms"] is None
    assert abs(record["output_tok_per_s"] - 12 / record["elapsed_s"]) < 1e-6
    assert abs(record["total_tok_per_s"] - (12 + 3 * 6) / record["elapsed_s"]) < 1e-6


def test_bench_latency_compared_with_transformers(qwen3_next_dir, tmp_path):
    out = tmp_path / "compare.json"
    assert main(["bench", "latency", "--model", str(qwen3_next_dir), *COMMON, "--batch-size", "2",
                 "--compare", "transformers", "--output-json", str(out)]) == 0
    [record] = json.loads(out.read_text())
    assert record["baseline"]["engine"].startswith("transformers") and record["baseline"]["output_tok_per_s"] > 0
    assert abs(record["speedup_vs_baseline"] - record["output_tok_per_s"] / record["baseline"]["output_tok_per_s"]) < 1e-9


def test_transformers_baseline_loads_after_lamina_is_gone(qwen3_next_dir, tmp_path, monkeypatch):
    """Both engines hold the whole model: the baseline loads only after lamina's engine (weights,
    caches, graphs) is freed, or the 35B preset would not fit one 80 GB GPU twice."""
    import gc

    import torch

    from lamina.entrypoints import bench

    alive_at_baseline = []

    def baseline(model_path, batch, input_len, output_len, device, dtype, hf_overrides=None):
        alive_at_baseline.extend(type(o).__name__ for o in gc.get_objects()
                                 if isinstance(o, torch.nn.Module) and type(o).__module__.startswith("lamina."))
        return {"engine": "stub", "output_tok_per_s": 1.0, "tpot_ms": 1000.0}

    monkeypatch.setattr(bench, "transformers_decode", baseline)
    assert main(["bench", "latency", "--model", str(qwen3_next_dir), *COMMON, "--batch-size", "1",
                 "--compare", "transformers", "--output-json", str(tmp_path / "c.json")]) == 0
    assert alive_at_baseline == []


def test_transformers_baseline_of_a_config_only_checkpoint_is_built_in_the_dtype(qwen3_next_dir, tmp_path):
    """A dummy preset is a config without weights: transformers' random init is built in the
    requested dtype, never first in float32 (twice the bytes)."""
    import shutil

    import torch

    from lamina.entrypoints.bench import transformers_model

    config_only = tmp_path / "cfg"
    config_only.mkdir()
    shutil.copy(qwen3_next_dir / "config.json", config_only / "config.json")
    built = []
    real_init = torch.nn.Linear.reset_parameters
    torch.nn.Linear.reset_parameters = lambda self: (built.append(self.weight.dtype), real_init(self))[1]
    try:
        model = transformers_model(str(config_only), torch.device("cpu"), torch.bfloat16)
    finally:
        torch.nn.Linear.reset_parameters = real_init
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert built and set(built) == {torch.bfloat16}
    # --hf-overrides reach the baseline's config as they reach lamina's
    overridden = transformers_model(str(config_only), torch.device("cpu"), torch.bfloat16,
                                    {"rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    assert overridden.config.rope_parameters["rope_type"] == "linear"
    assert overridden.config.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]


def test_distinct_experts_are_counted_in_real_decode_steps(qwen3_next_dir):
    """The roofline's expert bytes: per MoE layer, the distinct experts of the batch's own decode
    steps (prefill calls not counted), in an untimed rerun that leaves the engine idle."""
    from lamina import LLM
    from lamina.entrypoints.bench import distinct_experts_per_layer
    from lamina.layers.moe import SparseMoE

    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32") as llm:
        moes = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, SparseMoE)]
        top_k, experts = moes[0].top_k, moes[0].num_experts
        seen = []
        for m in moes:  # what the counting hook wraps stays the kernel after the call
            seen.append(m.experts_kernel)
        distinct = distinct_experts_per_layer(llm, [[5, 6, 7, 8], [9, 10, 11, 12, 13]], 20, decode_steps=2)
        assert len(distinct) == len(moes) > 0
        assert all(top_k <= d <= min(experts, 2 * top_k) for d in distinct)
        assert [m.experts_kernel for m in moes] == seen and not llm.engine.has_unfinished_requests()
        assert not any("forward" in m.__dict__ for m in moes)  # the metadata watch is removed too

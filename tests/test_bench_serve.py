"""`lamina bench serve` against a real `lamina serve` app on loopback (tiny checkpoint, CPU)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from lamina import LLM
from lamina.entrypoints.bench import SHARED_KEYS
from lamina.entrypoints.cli import main
from tests.server_harness import MODEL_NAME, RunningServer

SMALL = ["--num-prompts", "6", "--input-len", "8", "--output-len", "4"]


@pytest.fixture(scope="module")
def server(qwen3_next_dir):
    # model_root as `lamina serve` sets it: the bench finds the tokenizer through /v1/models
    with LLM(str(qwen3_next_dir), device="cpu", max_model_len=64, max_num_seqs=4, show_progress=False) as llm:
        with RunningServer(llm.engine, model_root=str(qwen3_next_dir)) as running:
            yield running


def _ordered(stats: dict) -> bool:
    return stats["median"] <= stats["p90"] <= stats["p99"]


def test_bench_serve_sweeps_concurrency(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server.url, *SMALL, "--max-concurrency", "1", "3",
            "--output-json", str(out)]
    assert main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["concurrency"] for r in records] == [1, 3]
    for r in records:
        assert set(SHARED_KEYS) <= set(r)
        assert r["kind"] == "serve" and r["command"] == "lamina " + " ".join(argv)
        assert r["model"] == MODEL_NAME and r["gpu"] == "cpu" and r["dtype"] == "float32"  # from /v1/models
        assert r["prompt_source"].startswith("tokenizer ")
        assert r["hbm_roofline_fraction"] is None and r["baseline"] is None and r["speedup_vs_baseline"] is None
        assert r["num_prompts"] == r["completed"] == 6 and r["failed"] == 0 and r["request_rate"] == "inf"
        assert r["output_tokens"] == 4 * 6 and r["input_tokens"] == 8 * 6  # ignore_eos; token-id prompts are exact
        assert 0 < r["ttft_ms"] < r["e2e_ms"] and r["tpot_ms"] > 0 and r["itl_ms"] > 0
        for name in ("ttft", "tpot", "itl", "e2e"):
            assert _ordered(r[f"{name}_ms_percentiles"])
        assert r["ttft_ms_percentiles"]["p99"] < r["e2e_ms_percentiles"]["p99"]
        assert abs(r["output_tok_per_s"] - 24 / r["duration_s"]) < 1e-6
        assert abs(r["total_tok_per_s"] - 72 / r["duration_s"]) < 1e-6
        assert abs(r["request_throughput"] - 6 / r["duration_s"]) < 1e-6
    printed = capsys.readouterr().out
    assert "| concurrency | request_rate | num_prompts | completed | failed |" in printed
    assert "\n| 1 | inf | 6 | 6 | 0 | 8 | 4 |" in printed and "\n| 3 | inf | 6 | 6 | 0 | 8 | 4 |" in printed


def test_bench_serve_chat_with_poisson_arrivals(server, qwen3_next_dir, tmp_path):
    out = tmp_path / "chat.json"
    assert main(["bench", "serve", "--base-url", server.url, "--endpoint", "/v1/chat/completions",
                 "--model", MODEL_NAME, "--tokenizer", str(qwen3_next_dir), "--num-prompts", "3", "--input-len", "8",
                 "--output-len", "3", "--request-rate", "20", "--seed", "1", "--output-json", str(out)]) == 0
    [r] = json.loads(out.read_text())
    assert r["endpoint"] == "/v1/chat/completions" and r["request_rate"] == 20.0 and r["concurrency"] is None
    assert r["completed"] == 3 and r["output_tokens"] == 9
    assert r["input_tokens"] >= 3 * 8  # text prompts in a chat template: the server's count, not exact
    assert r["ttft_ms"] < r["e2e_ms"]


def test_bench_serve_stops_early_on_a_bad_model_name_or_length(server, capsys):
    assert main(["bench", "serve", "--base-url", server.url, "--model", "no-such-model", *SMALL]) == 2
    assert "does not serve 'no-such-model'" in capsys.readouterr().err
    # longer than the server's max_model_len (64): refused before anything is sent
    assert main(["bench", "serve", "--base-url", server.url, "--input-len", "60", "--output-len", "10"]) == 2
    assert "max_model_len 64" in capsys.readouterr().err


def test_bench_serve_counts_refused_requests_as_failed(qwen3_next_dir, tmp_path, capsys):
    out = tmp_path / "overloaded.json"
    with LLM(str(qwen3_next_dir), device="cpu", max_model_len=64, max_num_seqs=1, show_progress=False) as llm:
        with RunningServer(llm.engine, model_root=str(qwen3_next_dir), max_waiting_requests=1) as overloaded:
            assert main(["bench", "serve", "--base-url", overloaded.url, *SMALL, "--output-json", str(out)]) == 0
    [r] = json.loads(out.read_text())
    assert r["failed"] > 0 and r["completed"] >= 1 and r["completed"] + r["failed"] == 6
    assert r["output_tokens"] == 4 * r["completed"] and r["errors"]
    assert f"{r['failed']} of 6 requests failed" in capsys.readouterr().err


def test_bench_serve_unreachable_server_is_a_clear_error(capsys):
    with socket.socket() as s:  # a free port with nothing listening on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--connect-timeout", "2", *SMALL]) == 2
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert f"cannot reach the server at http://127.0.0.1:{port}" in err and "lamina serve" in err

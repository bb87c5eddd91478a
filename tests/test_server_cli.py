"""`lamina serve` as users run it: a separate process, SIGTERM drains and exits 0, and the
LAMINA_TEST_FAIL_AFTER_STEPS hook kills the engine loop inside it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from lamina.entrypoints.cli import build_parser
from lamina.entrypoints.cli import main as cli_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir, *extra, env=None):
    port = _free_port()
    cmd = [sys.executable, "-m", "lamina.entrypoints.cli", "serve", str(model_dir), "--device", "cpu",
           "--port", str(port), "--max-model-len", "256", "--served-model-name", "tiny", "--no-access-log", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"lamina serve exited early ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("lamina serve did not come up")
        time.sleep(0.2)


def _stop(proc, timeout=30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("lamina serve did not exit after SIGTERM")


def test_serve_parser_defaults():
    args = build_parser().parse_args(["serve"])
    assert args.model_tag is None and args.host is None and args.port == 8000  # None: 0.0.0.0, as vLLM
    assert args.max_waiting_requests is None and args.served_model_name is None
    args = build_parser().parse_args(["serve", "/m", "--api-key", "k", "--max-waiting-requests", "4",
                                      "--served-model-name", "a", "b", "--dtype", "float32", "--max-num-seqs", "3"])
    assert (args.model_tag, args.api_key, args.max_waiting_requests, args.served_model_name) == ("/m", ["k"], 4, ["a", "b"])
    assert args.dtype == "float32" and args.max_num_seqs == 3
    assert args.disable_log_stats is False and args.log_stats_interval == 10.0  # vLLM's default interval
    assert args.max_logprobs == 20  # vLLM's default
    args = build_parser().parse_args(["serve", "--max-logprobs", "-1"])
    from lamina.entrypoints.cli import engine_kwargs

    assert engine_kwargs(args)["max_logprobs"] == -1


def test_serve_config_errors_exit_2(capsys):
    assert cli_main(["serve", "--device", "cpu", "--max-waiting-requests", "0"]) == 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli_main(["serve", "--device", "cpu", "--port", str(taken.getsockname()[1])]) == 2
    assert cli_main(["serve", "--device", "cpu", "--log-stats-interval", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-waiting-requests must be >= 1" in err and "cannot listen on 0.0.0.0" in err  # every interface
    assert "--log-stats-interval must be > 0 seconds, got 0.0" in err


def test_sigterm_drains_in_flight_stream_then_exits_0(qwen3_next_dir):
    proc, url = _start(qwen3_next_dir, "--drain-timeout", "20")
    try:
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 150, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(line[5:].strip())
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        final = json.loads(events[-2])
        assert final["choices"][0]["finish_reason"] == "length"
        assert _stop(proc) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_fail_after_steps_hook_kills_the_engine_loop(qwen3_next_dir):
    proc, url = _start(qwen3_next_dir, env={"LAMINA_TEST_FAIL_AFTER_STEPS": "3"})
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=30,
                       json={"prompt": "Hello", "max_tokens": 50, "ignore_eos": True})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
        assert httpx.get(f"{url}/health").status_code == 503
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hello"}).status_code == 503
        assert _stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "injected engine failure" in proc.stdout.read()

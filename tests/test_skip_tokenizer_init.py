"""`skip_tokenizer_init` (vLLM's name): the engine, `lamina generate`, `lamina serve` and `lamina bench
serve` without a tokenizer, and `lamina serve --preset` (a model shape with dummy weights, no tokenizer)."""

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

from lamina import LLM, SamplingParams
from lamina.entrypoints.bench import SHARED_KEYS
from lamina.entrypoints.cli import main
from lamina.entrypoints.presets import PRESETS, check_preset, preset_dir, preset_names
from tests.server_harness import MODEL_NAME, RunningServer

PROMPTS = [[5, 17, 300, 42, 9], [700, 3, 3, 81], [11, 12, 13, 14, 15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SMALL = ["--num-prompts", "6", "--input-len", "8", "--output-len", "4"]


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=4, show_progress=False, **kwargs)


@pytest.fixture(scope="module")
def reference(qwen3_next_dir) -> list[list[int]]:
    """Greedy token ids of PROMPTS with the tokenizer loaded."""
    with _llm(qwen3_next_dir) as llm:
        assert llm.get_tokenizer() is not None
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                              use_tqdm=False)]


@pytest.fixture(scope="module")
def bare_server(qwen3_next_dir):
    with _llm(qwen3_next_dir, skip_tokenizer_init=True) as llm:
        with RunningServer(llm.engine, model_root=str(qwen3_next_dir)) as running:
            yield running


def test_llm_without_tokenizer_gives_the_same_token_ids(qwen3_next_dir, reference):
    with _llm(qwen3_next_dir, skip_tokenizer_init=True) as llm:
        assert llm.get_tokenizer() is None
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert all(o.outputs[0].text == "" for o in outs)
        assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference[0]  # bare ids
        with pytest.raises(ValueError, match="skip_tokenizer_init.*token ids"):
            llm.generate("Hello", GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="stop strings need a tokenizer.*stop_token_ids"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)
        with pytest.raises(ValueError, match="tokenizer"):
            llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)


def test_generate_prompt_token_ids(qwen3_next_dir, reference, capsys):
    argv = ["generate", "--model", str(qwen3_next_dir), "--device", "cpu", "--max-model-len", "64",
            "--max-tokens", "6", "--prompt-token-ids", ",".join(map(str, PROMPTS[0]))]
    assert main([*argv, "--skip-tokenizer-init", "--json"]) == 0
    [line] = capsys.readouterr().out.strip().splitlines()
    record = json.loads(line)
    assert record["prompt"] == PROMPTS[0] and record["token_ids"] == reference[0] and record["text"] == ""
    assert main([*argv, "--skip-tokenizer-init"]) == 0
    assert capsys.readouterr().out.strip() == " ".join(map(str, reference[0]))
    assert main([*argv, "--prompt-token-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_models_card_reports_vocab_dtype_device(bare_server):
    [card] = httpx.get(f"{bare_server.base_url}/models").json()["data"]
    assert card["id"] == MODEL_NAME and card["max_model_len"] == 64
    assert card["vocab_size"] == 1024 and card["dtype"] == "float32" and card["device_name"] == "cpu"


def test_completions_return_token_ids_without_tokenizer(bare_server, reference):
    url = f"{bare_server.base_url}/completions"
    r = httpx.post(url, json={"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["text"] == "" and choice["token_ids"] == reference[1] and choice["prompt_token_ids"] == PROMPTS[1]
    assert r.json()["usage"]["completion_tokens"] == 6
    # streamed: every chunk carries its new ids, the first one also the prompt's
    chunks = []
    with httpx.stream("POST", url, timeout=60, json={"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0,
                                                     "stream": True, "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(json.loads(line[5:]))
    firsts = [c["choices"][0] for c in chunks if c["choices"]]
    assert firsts[0]["prompt_token_ids"] == PROMPTS[2] and all("prompt_token_ids" not in c for c in firsts[1:])
    assert [t for c in firsts for t in c["token_ids"]] == reference[2] and len(firsts) >= 2
    assert chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stop": ["x"]}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
])
def test_requests_that_need_text_are_400_no_tokenizer(bare_server, path, body, param):
    r = httpx.post(f"{bare_server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "no_tokenizer" and error["param"] == param and error["type"] == "invalid_request_error"
    assert "needs a tokenizer" in error["message"] and "skip_tokenizer_init" in error["message"]


def test_tokenizer_routes_name_the_flag(bare_server):
    r = httpx.post(f"{bare_server.url}/tokenize", json={"prompt": "x"})
    assert r.status_code == 400 and "--skip-tokenizer-init" in r.json()["error"]["message"]


def test_return_token_ids_with_a_tokenizer(qwen3_next_dir, reference):
    with _llm(qwen3_next_dir) as llm, RunningServer(llm.engine) as srv:
        url = f"{srv.base_url}/completions"
        body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
        [plain] = httpx.post(url, json=body, timeout=60).json()["choices"]
        assert "token_ids" not in plain and plain["text"]
        [choice] = httpx.post(url, json={**body, "return_token_ids": True}, timeout=60).json()["choices"]
        assert choice["token_ids"] == reference[0] and choice["text"] == plain["text"]


def test_bench_serve_without_tokenizer(bare_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", bare_server.url, *SMALL, "--max-concurrency", "1", "3",
            "--output-json", str(out)]
    assert main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["concurrency"] for r in records] == [1, 3]
    for r in records:
        assert set(SHARED_KEYS) <= set(r) and r["kind"] == "serve" and r["command"] == "lamina " + " ".join(argv)
        assert r["gpu"] == "cpu" and r["dtype"] == "float32"
        assert r["prompt_source"] == "random ids of [0, 1024) (no tokenizer)"
        assert r["completed"] == 6 and r["failed"] == 0 and r["output_tokens"] == 24 and r["input_tokens"] == 48
        assert 0 < r["ttft_ms"] < r["e2e_ms"] and r["tpot_ms"] > 0 and r["itl_ms"] > 0
    assert "random ids of [0, 1024)" in capsys.readouterr().err
    # chat needs text prompts
    assert main(["bench", "serve", "--base-url", bare_server.url, *SMALL, "--endpoint", "/v1/chat/completions"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_bench_serve_tokenizer_none_against_a_server_with_one(qwen3_next_dir, tmp_path):
    out = tmp_path / "none.json"
    with _llm(qwen3_next_dir) as llm, RunningServer(llm.engine) as srv:
        assert main(["bench", "serve", "--base-url", srv.url, *SMALL, "--tokenizer", "none", "--vocab-size", "900",
                     "--output-json", str(out)]) == 0
    [r] = json.loads(out.read_text())
    assert r["prompt_source"] == "random ids of [0, 900) (no tokenizer)" and r["completed"] == 6


def test_presets():
    assert "qwen3.5-35b-a3b" in preset_names() and PRESETS["qwen3.5-35b-a3b"]["num_hidden_layers"] == 40
    with pytest.raises(ValueError, match=r"unknown preset 'nope'; valid presets: .*qwen3.5-35b-a3b"):
        check_preset("nope")
    config = json.loads((preset_dir("qwen3.5-35b-a3b", num_layers=8) / "config.json").read_text())
    assert config["num_hidden_layers"] == 8 and config["layer_types"].count("full_attention") == 2
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"] and config["vocab_size"] == 248320
    with pytest.raises(ValueError, match="--num-layers must be a positive integer"):
        preset_dir("qwen3.5-moe-tiny", num_layers=0)


def test_serve_preset_errors(qwen3_next_dir, capsys):
    assert main(["serve", "--preset", "nope", "--device", "cpu"]) == 2
    assert "valid presets: qwen3.5-35b-a3b, qwen3.5-moe-tiny" in capsys.readouterr().err
    assert main(["serve", str(qwen3_next_dir), "--preset", "qwen3.5-moe-tiny", "--device", "cpu"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["serve", "--num-layers", "2", "--device", "cpu"]) == 2
    assert "--num-layers goes with --preset" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_preset_then_bench_serve(tmp_path):
    """What benchmarks/gpu_serve.sh does, at toy size: `lamina serve --preset`, then `lamina bench serve`."""
    port = _free_port()
    cmd = [sys.executable, "-m", "lamina.entrypoints.cli", "serve", "--preset", "qwen3.5-moe-tiny", "--num-layers",
           "2", "--device", "cpu", "--port", str(port), "--max-model-len", "128", "--no-access-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"lamina serve exited early:\n{proc.stdout.read()}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "lamina serve --preset did not come up"
            time.sleep(0.2)
        [card] = httpx.get(f"{url}/v1/models").json()["data"]
        assert card["id"] == "qwen3.5-moe-tiny" and card["vocab_size"] == 1024 and card["max_model_len"] == 128
        out = tmp_path / "preset.json"
        assert main(["bench", "serve", "--base-url", url, *SMALL, "--max-concurrency", "2",
                     "--output-json", str(out)]) == 0
        [r] = json.loads(out.read_text())
        assert r["model"] == "qwen3.5-moe-tiny" and r["completed"] == 6 and r["output_tokens"] == 24
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "preset qwen3.5-moe-tiny (2 layers, dummy)" in proc.stdout.read()

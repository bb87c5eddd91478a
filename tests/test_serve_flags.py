"""`lamina serve` with the flags of a vLLM launch line: accepted when they ask for what lamina does,
refused with exit 2 and a message naming the flag otherwise; the serve usage on argument errors;
`lamina --version`; `--served-model-name NAME MODEL`; and a real launch with the openai client."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

import lamina
from lamina.entrypoints.cli import build_parser, engine_kwargs
from lamina.entrypoints.cli import main as cli_main
from lamina.entrypoints.openai.chat_tools import load_chat_template
from lamina.entrypoints.openai.serve_flags import check_compat_args, repair_trailing_model
from tests.scripted_checkpoint import make_scripted_checkpoint
from tests.test_server_cli import _free_port, _stop
from tests.test_server_tools import HERMES_PIECES, OPEN_THINK_TEMPLATE, TOOLS, TOOLS_TEMPLATE


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"lamina {lamina.__version__}"


def test_unknown_flag_prints_the_serve_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--device", "cpu", "--bogus-flag", "--max-num-seqs", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "usage: lamina serve" in err and "lamina serve: error: unrecognized arguments: --bogus-flag" in err
    assert "COMMAND ..." not in err
    with pytest.raises(SystemExit):
        cli_main(["serve", "--tool-call-parser", "mistral"])
    err = capsys.readouterr().err
    assert "usage: lamina serve" in err and "invalid choice: 'mistral'" in err
    with pytest.raises(SystemExit):
        cli_main(["serve", "--kv-cache-dtype", "int8"])
    err = capsys.readouterr().err
    assert "usage: lamina serve" in err and "invalid choice: 'int8'" in err and "fp8_e5m2" in err


def test_vllm_flags_are_accepted():
    args = build_parser().parse_args([
        "serve", "/m", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3",
        "--trust-remote-code", "--disable-log-requests", "--quantization", "none", "--kv-cache-dtype", "auto",
        "--no-enable-prefix-caching", "--chat-template", "{{ x }}", "--device", "cpu"])
    assert (args.tool_call_parser, args.reasoning_parser, args.enable_prefix_caching) == ("qwen3_coder", "qwen3", False)
    check_compat_args(args, None)
    check_compat_args(build_parser().parse_args(["serve", "--device", "cpu", "-q", "fp8"]), None)  # quantized at load
    for dtype, kv in (("auto", "float32"), ("bfloat16", "bf16"), ("float16", "float16"), ("auto", "fp8"),
                      ("bfloat16", "fp8_e4m3"), ("bfloat16", "fp8_e5m2")):  # the model's dtype, or FP8
        parsed = build_parser().parse_args(["serve", "--device", "cpu", "--dtype", dtype, "--kv-cache-dtype", kv])
        check_compat_args(parsed, None)
        assert engine_kwargs(parsed)["kv_cache_dtype"] == kv


def test_the_qwen_model_cards_launch_lines_parse():
    """The vLLM commands the Qwen3.5 / Qwen3.6 model cards give (MTP, text only), lamina's spelling aside."""
    from lamina.engine.spec_decode import SpeculativeConfig

    args = build_parser().parse_args([
        "serve", "/m", "--port", "8000", "--tensor-parallel-size", "8", "--max-model-len", "262144",
        "--reasoning-parser", "qwen3", "--language-model-only", "--enable-chunked-prefill", "--tokenizer-mode", "auto",
        "--speculative-config", '{"method":"qwen3_next_mtp","num_speculative_tokens":2}', "--device", "cpu"])
    check_compat_args(args, None)
    assert args.language_model_only and args.max_model_len == 262144
    spec = SpeculativeConfig.parse(args.speculative_config)
    assert (spec.method, spec.num_speculative_tokens) == ("mtp", 2)


@pytest.mark.parametrize("flags, named, supported", [
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill", "--max-num-batched-tokens to at least"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral", "Supported: auto (or hf)"),
])
def test_refused_vllm_modes_exit_2(capsys, flags, named, supported):
    assert cli_main(["serve", "--device", "cpu", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and supported in err


@pytest.mark.parametrize("flags, named, supported", [
    (["--prefix-cache-min-tokens", "0"], "prefix_cache_min_tokens", "positive integer"),
    (["--quantization", "awq"], "--quantization awq", "supported: fp8 (a block-wise FP8 checkpoint, or an "
                                                        "unquantized one's experts quantized at load), none"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser", "hermes or qwen3_coder"),
])
def test_unsupported_values_exit_2_naming_the_flag(capsys, flags, named, supported):
    assert cli_main(["serve", "--device", "cpu", "--port", "0", *flags]) == 2  # before any model is loaded
    err = capsys.readouterr().err
    assert named in err and supported in err and "usage:" not in err


def test_served_model_name_followed_by_model(tmp_path):
    model = tmp_path / "ckpt"
    model.mkdir()
    args = build_parser().parse_args(["serve", "--served-model-name", "foo", str(model)])
    repair_trailing_model(args)
    assert args.model_tag == str(model) and args.served_model_name == ["foo"]
    args = build_parser().parse_args(["serve", "--served-model-name", "foo", "bar"])  # two names, no path
    repair_trailing_model(args)
    assert args.model_tag is None and args.served_model_name == ["foo", "bar"]
    args = build_parser().parse_args(["serve", "--served-model-name", "foo", "Qwen/Qwen3.5-35B-A3B"])  # a Hub id
    repair_trailing_model(args)
    assert args.model_tag == "Qwen/Qwen3.5-35B-A3B" and args.served_model_name == ["foo"]
    args = build_parser().parse_args(["serve", "/m", "--served-model-name", "foo", "Qwen/Qwen3.5"])  # MODEL given
    repair_trailing_model(args)
    assert args.model_tag == "/m" and args.served_model_name == ["foo", "Qwen/Qwen3.5"]
    args = build_parser().parse_args(["serve", "--served-model-name", "foo", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="looks like a MODEL path but does not exist"):
        repair_trailing_model(args)


def test_api_key_followed_by_model(tmp_path, capsys):
    model = tmp_path / "ckpt"
    model.mkdir()
    args = build_parser().parse_args(["serve", "--api-key", "k1", "k2", str(model)])
    repair_trailing_model(args)
    assert args.model_tag == str(model) and args.api_key == ["k1", "k2"]
    assert "k1" not in capsys.readouterr().err  # keys are never printed
    args = build_parser().parse_args(["serve", "--api-key", "k1", "sk-ab/cd"])  # a key with a slash stays a key
    repair_trailing_model(args)
    assert args.model_tag is None and args.api_key == ["k1", "sk-ab/cd"]
    args = build_parser().parse_args(["serve", "--api-key", "k1", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="put MODEL before --api-key") as err:
        repair_trailing_model(args)
    assert "k1" not in str(err.value)


def test_chat_template_file_or_string(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_vllm_launch_line_serves_tools_and_reasoning(qwen3_next_dir, tmp_path):
    """A vLLM-style launch line, MODEL after --served-model-name, with the openai client's tool flow."""
    model = make_scripted_checkpoint(qwen3_next_dir, tmp_path / "ckpt", HERMES_PIECES, chat_template=TOOLS_TEMPLATE)
    template = tmp_path / "open_think.jinja"
    template.write_text(OPEN_THINK_TEMPLATE)
    port = _free_port()
    cmd = [sys.executable, "-m", "lamina.entrypoints.cli", "serve", "--device", "cpu", "--port", str(port),
           "--max-model-len", "512", "--no-access-log", "--served-model-name", "tiny", str(model),
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
           "--chat-template", str(template), "--trust-remote-code", "--disable-log-requests",
           "--kv-cache-dtype", "auto", "--quantization", "none", "--no-enable-prefix-caching"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"lamina serve exited early:\n{proc.stdout.read()}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "lamina serve did not come up"
            time.sleep(0.2)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            [card] = client.models.list().data
            assert card.id == "tiny" and card.model_extra["root"] == str(model)  # the path is served
            out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                                 tools=TOOLS, temperature=0, max_tokens=40)
            choice = out.choices[0]
            assert out.usage.completion_tokens == len(HERMES_PIECES)  # --chat-template opened the think block
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert choice.message.model_extra["reasoning_content"] == "Checking the weather."
            assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
        assert _stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "was given after --served-model-name" in proc.stdout.read()


def test_vllm_only_options_accepted_where_they_ask_nothing(caplog):
    """vLLM's options for what lamina lacks (lamina.vllm_compat): harmless values accepted (a non-default
    one logged with what lamina does), values asking for a missing feature refused naming the flag;
    vLLM's frontend flags parse."""
    import logging

    args = build_parser().parse_args([
        "serve", "/m", "--device", "cpu", "--swap-space", "4", "--disable-custom-all-reduce", "-O", "3",
        "--max-seq-len-to-capture", "8192", "--distributed-executor-backend", "mp", "--max-lora-rank", "64",
        "--limit-mm-per-prompt", '{"image": 0}', "--task", "generate", "--cpu-offload-gb", "0",
        "--tool-call-parser", "qwen3_xml", "--enable-log-requests", "--max-log-len", "100",
        "--enable-prompt-tokens-details", "--enable-force-include-usage", "--enable-request-id-headers",
        "--response-role", "assistant", "--default-chat-template-kwargs", '{"enable_thinking": false}',
        "--chat-template-content-format", "string", "--override-generation-config", '{"temperature": 0.5}'])
    with caplog.at_level(logging.INFO, logger="lamina.vllm_compat"):
        check_compat_args(args, None)
    assert "--swap-space 4.0: no effect" in caplog.text and "--compilation-config 3: lamina does not torch.compile" in caplog.text
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert engine_kwargs(args)["override_generation_config"] == {"temperature": 0.5}
    kwargs = engine_kwargs(args)  # -O 3: no cudagraph_mode, both kinds of graphs
    assert kwargs["enforce_eager"] is False and kwargs["prefill_graphs"] is True
    for flags, named in ((["--enable-lora"], "--enable-lora is not supported; valid: false (lamina has no LoRA"),
                         (["--cpu-offload-gb", "8"], "--cpu-offload-gb 8.0 is not supported; valid: 0"),
                         (["--enable-sleep-mode"], "--enable-sleep-mode is not supported"),
                         (["--distributed-executor-backend", "ray"], "valid: mp or uni (no Ray)"),
                         (["--limit-mm-per-prompt", '{"image": 2}'], "zero items of every modality"),
                         (["--middleware", "my.mod.Middleware"], "--middleware my.mod.Middleware: lamina loads no")):
        with pytest.raises(ValueError, match=re.escape(named)):
            check_compat_args(build_parser().parse_args(["serve", "--device", "cpu", *flags]), None)


def test_ssl_flags_need_each_other(capsys, tmp_path):
    assert cli_main(["serve", "--device", "cpu", "--port", "0", "--ssl-keyfile", str(tmp_path / "k.pem")]) == 2
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err

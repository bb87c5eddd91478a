"""vLLM's command-line conveniences: `--config FILE` (YAML of long option names; the command line
wins) and JSON options key by key (`--hf-overrides.a.b value`, `--speculative-config.key value`,
`key+` list appends), expanded before argparse."""

from __future__ import annotations

import pytest

from lamina.entrypoints.cli import _boolean_flags, build_parser, engine_kwargs, main
from lamina.entrypoints.cli_args import expand_argv


def _parse(argv):
    parser = build_parser()
    return parser.parse_args(expand_argv(argv, _boolean_flags(parser)))


def test_json_options_key_by_key():
    args = _parse(["serve", "/m", "--hf-overrides.text_config.rope_parameters.rope_type", "yarn",
                   "--hf-overrides.text_config.rope_parameters.factor=4.0",
                   "--speculative-config.method", "qwen3_next_mtp", "--speculative-config.num_speculative_tokens", "2",
                   "--hf-overrides", '{"text_config": {"rope_parameters": {"rope_theta": 1e7}}, "a": true}',
                   "--hf-overrides.layers+", "1", "--hf-overrides.layers+=2,3"])
    assert args.hf_overrides == {"text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                                     "rope_theta": 1e7}}, "a": True, "layers": [1, 2, 3]}
    assert engine_kwargs(args)["speculative_config"] == {"method": "qwen3_next_mtp", "num_speculative_tokens": 2}
    assert args.model_tag == "/m"


def test_config_file_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: /from/file\nport: 8001\nmax-model-len: 32k\nenable-auto-tool-choice: true\n"
                      "tool_call_parser: hermes\nenable-prefix-caching: false\ntrust-remote-code: false\n"
                      "served-model-name: [a, b]\nhf-overrides:\n  rope_parameters:\n    rope_type: yarn\n"
                      "allowed-origins: ['http://ui.example']\n")
    args = _parse(["serve", "--config", str(config), "--port", "9000"])
    assert (args.model, args.port, args.max_model_len) == ("/from/file", 9000, 32000)
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    assert args.enable_prefix_caching is False and not args.trust_remote_code
    assert args.served_model_name == ["a", "b"] and args.allowed_origins == ["http://ui.example"]
    assert args.hf_overrides == {"rope_parameters": {"rope_type": "yarn"}}
    assert _parse(["serve", f"--config={config}"]).port == 8001


@pytest.mark.parametrize("argv, message", [
    (["serve", "--config", "/nonexistent.yaml"], "--config /nonexistent.yaml: cannot read it"),
    (["serve", "--hf-overrides.a"], "--hf-overrides.a needs a value"),
    (["serve", "--hf-overrides.a", "1", "--hf-overrides.a.b", "2"], "'a' already holds a value, not an object"),
    (["serve", "--speculative-config", "[1]"], "--speculative-config must be a JSON object"),
])
def test_bad_input_exits_2(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_bad_yaml_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert "must map option names to values" in capsys.readouterr().err


def test_invocation_keeps_what_was_typed(monkeypatch):
    """Bench records keep the command as typed, not as expanded."""
    from lamina.entrypoints import cli

    seen = {}

    def record(args):
        seen.update(invocation=args.invocation, overrides=args.hf_overrides)
        return 0

    monkeypatch.setattr(cli, "_generate", record)
    argv = ["generate", "--prompt", "x", "--hf-overrides.a", "1"]
    assert main(argv) == 0
    assert seen == {"invocation": argv, "overrides": {"a": 1}}


def test_logprobs_mode_flag(capsys):
    """vLLM's --logprobs-mode reaches the engine's arguments; a mode it does not know is refused."""
    from lamina.config import EngineArgs

    assert engine_kwargs(_parse(["generate", "--logprobs-mode", "processed_logits"]))["logprobs_mode"] == "processed_logits"
    assert engine_kwargs(_parse(["serve"]))["logprobs_mode"] == "raw_logprobs"
    with pytest.raises(SystemExit):
        _parse(["generate", "--logprobs-mode", "processed"])
    assert "--logprobs-mode" in capsys.readouterr().err
    with pytest.raises(ValueError, match="logprobs_mode = 'logits' is not one of raw_logprobs, raw_logits"):
        EngineArgs(model="m", logprobs_mode="logits").validate()

"""vLLM's command-line conveniences, turned into plain arguments before argparse sees them:

- `--config FILE`: a YAML file of long option names and values (`port: 8001`, `max-model-len:
  32k`, `enable-auto-tool-choice: true`, `model: /path`); options given on the command line win
  (they are placed after the file's);
- JSON options key by key: `--hf-overrides.rope_parameters.rope_type yarn` (or `...=yarn`) is
  `--hf-overrides '{"rope_parameters": {"rope_type": "yarn"}}'`; a value is read as JSON when it
  parses (`2`, `true`, `[1, 2]`), else taken as a string; `--json-arg.key+ value` appends to a list
  (`value` may hold several, comma-separated). Several of them, and a whole-JSON form, merge.
  `--compilation-config` (vLLM's `-cc`, and the older `-O`) takes them too (`-cc.cudagraph_mode
  FULL_DECODE_ONLY`, `-O.max_cudagraph_capture_size 64`); an optimisation level (`-O0` .. `-O3`) becomes
  its `optimization_level` key.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# the options that take a JSON object (--compilation-config also an optimisation level: -O3, -O 3)
JSON_OPTIONS = ("--hf-overrides", "--speculative-config", "--override-generation-config", "--compilation-config")


def expand_argv(argv: list[str], boolean_flags: dict[str, bool]) -> list[str]:
    """`argv` with `--config FILE` and dotted JSON options expanded. `boolean_flags`: option name ->
    whether it has a `--no-` form (BooleanOptionalAction), for the YAML file's true / false."""
    return _merge_json_options(_expand_config(argv, boolean_flags))


def _expand_config(argv: list[str], boolean_flags: dict[str, bool]) -> list[str]:
    for i, token in enumerate(argv):
        if token == "--config" or token.startswith("--config="):
            if token == "--config":
                if i + 1 >= len(argv):
                    raise ValueError("--config needs a YAML file")
                path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
            else:
                path, rest = token.split("=", 1)[1], argv[:i] + argv[i + 1:]
            first = 1 if rest and not rest[0].startswith("-") else 0  # after the subcommand
            return rest[:first] + _config_tokens(Path(path), boolean_flags) + rest[first:]
    return argv


def _config_tokens(path: Path, boolean_flags: dict[str, bool]) -> list[str]:
    import yaml

    try:
        config = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({e})") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: must map option names to values, e.g. 'port: 8001'")
    tokens: list[str] = []
    for key, value in config.items():
        option = "--" + str(key).removeprefix("--").replace("_", "-")
        if isinstance(value, bool):
            if option in boolean_flags:
                tokens += [option] if value else ([f"--no-{option[2:]}"] if boolean_flags[option] else [])
                continue
            value = str(value).lower()
        if isinstance(value, dict):
            tokens += [option, json.dumps(value)]
        elif isinstance(value, list) and option not in ("--allowed-origins", "--allowed-methods", "--allowed-headers"):
            tokens += [option, *(str(v) for v in value)]
        elif isinstance(value, list):
            tokens += [option, json.dumps(value)]
        else:
            tokens += [option, str(value)]
    return tokens


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _merge_json_options(argv: list[str]) -> list[str]:
    """Dotted JSON options (and whole-JSON ones) merged into one `--option JSON` each, where the
    first of them stood."""
    merged: dict[str, dict] = {}
    first_at: dict[str, int] = {}
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = _long_compilation_config(argv[i])
        option = next((o for o in JSON_OPTIONS if token == o or token.startswith((o + ".", o + "="))), None)
        if option is None:
            out.append(token)
            i += 1
            continue
        name, eq, inline = token.partition("=")
        if eq:
            value_text, i = inline, i + 1
        elif i + 1 < len(argv):
            value_text, i = argv[i + 1], i + 2
        else:
            raise ValueError(f"{name} needs a value")
        target = merged.setdefault(option, {})
        if option not in first_at:
            first_at[option] = len(out)
            out.append(option)  # placeholder: the merged JSON goes after it
        if name == option and option == "--compilation-config" and _optimisation_level(value_text) is not None:
            target["optimization_level"] = _optimisation_level(value_text)  # -O3 (lamina.vllm_compat reads -O0)
            continue
        if name == option:  # the whole object
            try:
                value = json.loads(value_text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{option} is not valid JSON ({e}): {value_text!r}") from None
            if not isinstance(value, dict):
                raise ValueError(f"{option} must be a JSON object, got {value_text!r}")
            _deep_update(target, value)
            continue
        keys = name[len(option) + 1:].split(".")
        if not all(keys):
            raise ValueError(f"{name}: an empty key")
        node = target
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"{name}: {key!r} already holds a value, not an object")
        last = keys[-1]
        if last.endswith("+"):  # list append, one value or several comma-separated
            items = node.setdefault(last[:-1], [])
            if not isinstance(items, list):
                raise ValueError(f"{name}: {last[:-1]!r} already holds a value, not a list")
            items.extend(_parse_value(v) for v in value_text.split(","))
        else:
            node[last] = _parse_value(value_text)
    for option, at in sorted(first_at.items(), key=lambda kv: -kv[1]):
        out.insert(at + 1, json.dumps(merged[option]))
    return out


def _long_compilation_config(token: str) -> str:
    """vLLM's short forms of --compilation-config, exactly: `-cc` / `-O` alone (a JSON object or a
    level follows), `-cc.key`, `-O.key` (with `=value` or a value following), `-cc=...`, `-O=...`, and
    the optimisation levels `-O0` .. `-O3`. Anything else (a prompt reading "-O my god") is left."""
    for short in ("-cc", "-O"):
        if token == short or token.startswith((short + ".", short + "=")):
            return "--compilation-config" + token[len(short):]
    if token[:2] == "-O" and token[2:].isdigit():
        return "--compilation-config=" + token[2:]  # -O3
    return token


def _optimisation_level(text: str) -> int | None:
    """vLLM's optimisation level (-O 0 .. 3, also spelt O3), or None."""
    text = text.strip().removeprefix("O")
    return int(text) if text.isdigit() else None


def _deep_update(target: dict, value: dict) -> None:
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(target.get(key), dict):
            _deep_update(target[key], item)
        else:
            target[key] = item


def json_object(text: str, of: str = "keys and values") -> dict:
    """An option's JSON object value (argparse type): a clear error for bad JSON or a non-object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of {of}, got {text!r}")
    return value

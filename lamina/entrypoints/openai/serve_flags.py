"""`lamina serve` flags that launch lines written for vLLM carry: the chat parsers and template, and the
flags for features lamina does not have (accepted when they ask for what lamina does, refused with a
message naming the flag otherwise), plus the `--served-model-name NAME... MODEL` repair."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from lamina.config import check_vllm_modes
from lamina.entrypoints.cli_args import json_object
from lamina.entrypoints.openai.reasoning_parser import REASONING_PARSERS
from lamina.entrypoints.openai.tool_parsers import TOOL_PARSERS
from lamina.models.hub import looks_like_repo_id
from lamina.vllm_compat import COMPAT_OPTIONS, SERVE_FLAGS_OF_THEIR_OWN, check_compat_options



def add_chat_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("chat: tool calls, reasoning, template (vLLM's flags)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls when a request's tool_choice is 'auto' (needs --tool-call-parser)")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the tool-call format the model writes: hermes (<tool_call>{json}</tool_call>) or "
                        "qwen3_coder (<tool_call><function=...><parameter=...>)")
    g.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="qwen3: answer <think>...</think> as reasoning_content")
    g.add_argument("--chat-template", default=None, metavar="FILE|STRING",
                   help="a Jinja chat template (a file path, or the template itself) instead of the tokenizer's")
    g.add_argument("--default-chat-template-kwargs", type=_template_kwargs, default=None, metavar="JSON",
                   help="vLLM's flag: chat template kwargs of every request (a request's chat_template_kwargs "
                        "win), e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string"],
                   help="vLLM's flag: lamina hands the template text content as strings (auto = string)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="a chat request's own chat_template field is used (without this flag such a request "
                        "is answered 400, as in vLLM)")


def _template_kwargs(text: str) -> dict:
    return json_object(text, "chat template kwargs")


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM compatibility (accepted; see docs/SERVING.md)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted, no effect: lamina runs its own model code and reads configs with transformers")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's older flag: no request logging (lamina logs none unless --enable-log-requests)")
    g.add_argument("--language-model-only", action="store_true",
                   help="accepted, no effect: lamina serves the text model of a vision-language checkpoint and "
                        "never loads its vision encoder")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="lamina always splits prompts longer than --max-num-batched-tokens into chunks: "
                        "--enable-chunked-prefill is accepted, --no-enable-chunked-prefill refused")
    g.add_argument("--tokenizer-mode", default="auto",
                   help="only 'auto' (or 'hf'): the checkpoint's tokenizer through transformers' AutoTokenizer")
    # vLLM's options for what lamina does not have (lamina.vllm_compat): accepted where they ask for nothing
    g.add_argument("--swap-space", type=float, default=None, metavar="GIB", help="accepted, no effect")
    g.add_argument("--cpu-offload-gb", type=float, default=None, metavar="GIB", help="0 only")
    g.add_argument("--disable-custom-all-reduce", action="store_true", default=None, help="accepted, no effect")
    g.add_argument("--max-seq-len-to-capture", type=int, default=None, metavar="N", help="accepted, no effect")
    g.add_argument("--tokenizer-revision", default=None, metavar="REV",
                   help="refused: lamina reads the tokenizer of MODEL at --revision (or --tokenizer)")
    g.add_argument("--distributed-executor-backend", default=None, metavar="mp|uni",
                   help="mp / uni accepted (lamina's ranks are its own processes); ray refused")
    g.add_argument("--enable-sleep-mode", action="store_true", default=None, help="refused: no sleep mode")
    g.add_argument("--enable-lora", action="store_true", default=None, help="refused: no LoRA adapters")
    g.add_argument("--max-lora-rank", type=int, default=None, help="accepted, no effect without LoRA")
    g.add_argument("--max-loras", type=int, default=None, help="accepted, no effect without LoRA")
    g.add_argument("--max-cpu-loras", type=int, default=None, help="accepted, no effect without LoRA")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help="zero items of every modality only (the text model is served)")
    g.add_argument("--task", default=None, help="auto / generate only")
    g.add_argument("--runner", default=None, help="auto / generate only")
    g.add_argument("--scheduling-policy", default=None, metavar="fcfs", help="fcfs only (no priority scheduling)")
    g.add_argument("--middleware", action="append", default=None, metavar="IMPORT_PATH",
                   help="refused: lamina loads no middleware from import paths")


def _config_json(model: str | None, overrides: dict | None = None) -> dict:
    """config.json of `model` ({} when unreadable) with --hf-overrides laid over it."""
    from lamina.worker.model_loader import merge_overrides

    try:
        config = json.loads((Path(model) / "config.json").read_text()) if model is not None else {}
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    return merge_overrides(config, overrides) if overrides else config


def _config_namespace(config: dict):
    """A config.json dict (and its text_config) as attributes, enough for lamina.quantization."""
    from types import SimpleNamespace

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return SimpleNamespace(quantization_config=config.get("quantization_config"),
                           text_config=SimpleNamespace(quantization_config=text.get("quantization_config")))


def _flag(name: str, value) -> str:
    """An option as a `lamina serve` flag: `--name` (True, or only named), `--no-name` (False), `--name value`."""
    flag = "--" + name.replace("_", "-")
    if value is False:
        return f"--no-{flag[2:]}"
    return flag if value is None or value is True else f"{flag} {value}"


def check_compat_args(args: argparse.Namespace, model: str | None) -> None:
    """Refuse (ValueError, exit 2) what lamina cannot do, naming the flag and what is supported."""
    check_vllm_modes(args.enable_prefix_caching, args.enable_chunked_prefill, args.tokenizer_mode, spell=_flag)
    if args.middleware:
        raise ValueError(f"--middleware {args.middleware[0]}: lamina loads no ASGI middleware from import paths; run "
                         "it in a proxy in front of the server")
    check_compat_options({name: getattr(args, name) for name in COMPAT_OPTIONS if name not in SERVE_FLAGS_OF_THEIR_OWN},
                         spell=_flag)
    if args.quantization is not None:
        from lamina.quantization import read_quantization, resolve_quantization

        try:
            config = _config_json(model, getattr(args, "hf_overrides", None))
            resolve_quantization(args.quantization, read_quantization(_config_namespace(config)),
                                 getattr(args, "load_format", "auto"))
        except ValueError as e:
            raise ValueError(f"--quantization {args.quantization}: {e}") from None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({' or '.join(sorted(TOOL_PARSERS))})")


# flags that take several values, so that argparse takes a MODEL written after them as one more:
# (attribute, flag, whether its values may be printed and a last Hub-id-shaped one taken as MODEL; never
# for keys, which may hold a slash and must not be sent to the Hub as a model name)
_MULTI_VALUE_FLAGS = (("served_model_name", "--served-model-name", True), ("api_key", "--api-key", False))


def repair_trailing_model(args: argparse.Namespace) -> None:
    """`--served-model-name foo /path/to/model` (MODEL after the flag; --api-key the same): argparse takes
    the path as a second value. Without another MODEL, a last value that is an existing path is the MODEL
    (for --served-model-name also a Hub id, `org/name`: lamina would otherwise serve its demo model)."""
    for attr, flag, shown in _MULTI_VALUE_FLAGS:
        values = getattr(args, attr, None)
        if args.model_tag or args.model or not values or len(values) < 2:
            continue
        last = values[-1]
        if os.path.exists(os.path.expanduser(last)) or (shown and looks_like_repo_id(last)):
            setattr(args, attr, values[:-1])
            args.model_tag = last
            kept = f": serving it as {', '.join(map(repr, values[:-1]))}" if shown else ""
            print(f"[lamina] MODEL {last!r} was given after {flag}{kept}", file=sys.stderr)
        elif any(c in last for c in "/\\") and last.startswith((".", "/", "~")):
            what = f"{flag} {' '.join(values)}" if shown else flag
            raise ValueError(f"{what}: {last!r} looks like a MODEL path but does not exist; put MODEL "
                             f"before {flag} (lamina serve MODEL {flag} ...)")

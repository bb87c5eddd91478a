"""`lamina serve [MODEL]`: load the model, then answer the OpenAI API over HTTP until SIGTERM/SIGINT.

On SIGTERM the server drains: it stops accepting connections, answers new requests on open ones
with 503, gives in-flight requests `--drain-timeout` seconds to finish, ends the rest with an error,
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys

from lamina.engine.stats_log import DEFAULT_LOG_STATS_INTERVAL_S
from lamina.entrypoints.openai.serve_flags import (
    add_chat_args, add_compat_args, check_compat_args, repair_trailing_model,
)

API_KEY_ENVS = ("LAMINA_API_KEY", "VLLM_API_KEY")  # the first set one is the key when --api-key is not given


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `serve` subcommand on the `lamina` command's subparsers."""
    from lamina.entrypoints import cli  # lazy: cli.py imports this module

    p = subparsers.add_parser("serve", help="serve the OpenAI API (completions, chat) over HTTP",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory or Hugging Face Hub id (default: the built-in demo model); same as --model")
    cli.add_engine_args(p)
    if hasattr(cli, "add_parallel_args"):
        cli.add_parallel_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default=None,
                   help="address to bind (default: every IPv4 interface, 0.0.0.0, as vLLM; 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (any of the KEYs given) on /v1 routes "
                        f"(default: ${API_KEY_ENVS[0]}, else ${API_KEY_ENVS[1]}, as vLLM reads it)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use; the first is reported in responses (default: MODEL)")
    s.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                   help="answer 503 (with Retry-After) while N requests are queued (default: no limit)")
    s.add_argument("--max-request-body-bytes", type=int, default=8 << 20, metavar="BYTES",
                   help="larger request bodies get 413 (default: 8 MiB)")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may run before they are aborted (default: 30)")
    s.add_argument("--preset", default=None, metavar="NAME",
                   help="serve a built-in model shape with dummy (random) weights instead of a checkpoint, e.g. "
                        "qwen3.5-35b-a3b (lamina/entrypoints/presets.py); no tokenizer: token-id prompts only")
    s.add_argument("--num-layers", type=int, default=None, metavar="N", help="with --preset: override its layer count")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="vLLM's flag: uvicorn's log level (default: --log-level)")
    s.add_argument("--no-access-log", "--disable-uvicorn-access-log", dest="no_access_log", action="store_true",
                   help="do not log each HTTP request (vLLM's spelling: --disable-uvicorn-access-log)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="vLLM's flag: logprobs name each token as 'token_id:N' (a request's "
                        "return_tokens_as_token_ids field overrides it)")
    s.add_argument("--root-path", default=None, metavar="PATH",
                   help="vLLM's flag: the path prefix a reverse proxy serves the API under (ASGI root_path)")
    s.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help="vLLM's flag: CORS origins, a JSON list (default: [\"*\"])")
    s.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help="vLLM's flag: CORS methods, a JSON list (default: [\"*\"])")
    s.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help="vLLM's flag: CORS headers, a JSON list (default: [\"*\"])")
    s.add_argument("--allow-credentials", action="store_true", help="vLLM's flag: CORS credentials")
    s.add_argument("--disable-fastapi-docs", action="store_true",
                   help="vLLM's flag: no /docs, /redoc or /openapi.json")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="do not log the engine-statistics line (prompt / generation tok/s, running and waiting "
                        "requests, KV cache use, step times)")
    s.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="vLLM's flag: serve HTTPS with this key")
    s.add_argument("--ssl-certfile", default=None, metavar="FILE", help="vLLM's flag: ... and this certificate")
    s.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="vLLM's flag: CA certificates of clients")
    s.add_argument("--ssl-cert-reqs", type=int, default=0, metavar="N",
                   help="vLLM's flag: whether a client certificate is needed (Python's ssl.CERT_*: 0 none, 2 required)")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="vLLM's flag: log each request's prompt, token ids and sampling parameters (INFO)")
    s.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="vLLM's flag: with --enable-log-requests, the prompt characters and token ids a line shows")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="vLLM's flag: usage carries prompt_tokens_details when prompt tokens came from a prefix "
                        "cache; lamina has none, so the field stays out, as in vLLM's answers without cached tokens")
    s.add_argument("--enable-force-include-usage", action="store_true",
                   help="vLLM's flag: every stream ends with a usage chunk, whatever its stream_options ask")
    s.add_argument("--enable-request-id-headers", action="store_true",
                   help="vLLM's flag: every answer carries an X-Request-Id header (the request's, else a new one)")
    s.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="vLLM's flag: the role of chat answers when add_generation_prompt is true")
    s.add_argument("--log-stats-interval", type=float, default=DEFAULT_LOG_STATS_INTERVAL_S, metavar="SECONDS",
                   help=f"seconds between engine-statistics lines while there is work (default: "
                        f"{DEFAULT_LOG_STATS_INTERVAL_S:g})")
    add_chat_args(p)
    add_compat_args(p)
    p.set_defaults(func=run_serve)
    return p


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys /v1 routes accept: --api-key's, else the first of API_KEY_ENVS that is set; none: open."""
    if args.api_key:
        return tuple(key for key in args.api_key if key)
    return next(((os.environ[name],) for name in API_KEY_ENVS if os.environ.get(name)), ())


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a taken port fails at once."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def resolve_preset(args: argparse.Namespace, model_arg: str | None) -> str:
    """`--preset NAME [--num-layers N]`: write the preset's config into a temporary directory (the MODEL
    served), with dummy weights and no tokenizer. Errors name the valid presets."""
    from lamina.entrypoints.presets import check_preset, preset_dir, preset_label

    if args.preset is None:
        raise ValueError("--num-layers goes with --preset (it overrides the preset's layer count)")
    if model_arg:
        raise ValueError(f"give MODEL ({model_arg!r}) or --preset {args.preset}, not both")
    check_preset(args.preset)
    if args.load_format not in ("auto", "dummy"):
        raise ValueError(f"--preset serves dummy weights; --load-format {args.load_format} does not apply")
    path = str(preset_dir(args.preset, args.num_layers))
    args.load_format = "dummy"
    args.skip_tokenizer_init = True  # a preset has no tokenizer
    print(f"[lamina] preset {preset_label(args.preset, args.num_layers)}: no tokenizer (token-id prompts to "
          f"/v1/completions only), config in {path}", file=sys.stderr)
    return path


def run_serve(args: argparse.Namespace) -> int:
    from lamina import LLM
    from lamina.entrypoints.cli import engine_kwargs
    from lamina.entrypoints.openai.app import ServerConfig, build_app
    from lamina.entrypoints.openai.chat_tools import ChatOptions, load_chat_template
    from lamina.entrypoints.openai.serving import FrontendOptions
    from lamina.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    repair_trailing_model(args)
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree; give one")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if not args.log_stats_interval > 0:
        raise ValueError(f"--log-stats-interval must be > 0 seconds, got {args.log_stats_interval}")
    if args.max_request_body_bytes <= 0:
        raise ValueError(f"--max-request-body-bytes must be positive, got {args.max_request_body_bytes}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model_arg = args.model_tag or args.model
    if args.preset is not None or args.num_layers is not None:
        model_arg = resolve_preset(args, model_arg)
    check_compat_args(args, model_arg)
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    chat = ChatOptions(tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                       reasoning_parser=args.reasoning_parser, chat_template=load_chat_template(args.chat_template),
                       trust_request_chat_template=args.trust_request_chat_template,
                       default_chat_template_kwargs=args.default_chat_template_kwargs)
    if getattr(args, "node_rank", 0) > 0:  # a secondary node of a multi-node layout: its ranks only, no HTTP
        from lamina.config import EngineArgs
        from lamina.engine.mp_executor import run_headless_node

        return run_headless_node(EngineArgs(model=model_arg, **engine_kwargs(args)))
    model = model_arg or str(ensure_default_model())
    names = args.served_model_name or [args.preset or model_arg or DEFAULT_MODEL_NAME]
    host = args.host or "0.0.0.0"
    sock = bind_socket(host, args.port)
    if host in ("0.0.0.0", "::") and not api_keys(args):
        print(f"[lamina] listening on every interface ({host}) without --api-key: anyone who reaches this machine's "
              "port can use the model (pass --host 127.0.0.1 or --api-key to restrict it)", file=sys.stderr)
    try:
        llm = LLM(model, **engine_kwargs(args))
    except BaseException:
        sock.close()
        raise
    try:
        config = ServerConfig(
            served_model_names=names, api_key=api_keys(args) or None, max_waiting_requests=args.max_waiting_requests,
            max_body_bytes=args.max_request_body_bytes, drain_timeout_s=args.drain_timeout, model_root=model,
            chat=chat, log_stats_interval_s=None if args.disable_log_stats else args.log_stats_interval,
            allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
            allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
            fastapi_docs=not args.disable_fastapi_docs, return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            frontend=FrontendOptions(
                force_include_usage=args.enable_force_include_usage,
                prompt_tokens_details=args.enable_prompt_tokens_details,
                request_id_headers=args.enable_request_id_headers, response_role=args.response_role,
                log_requests=args.enable_log_requests and not args.disable_log_requests, max_log_len=args.max_log_len),
        )
        app = build_app(llm.engine, config)
        import uvicorn  # the server stack loads only for `lamina serve` (bench / generate run without it)

        from lamina.entrypoints.openai.uvicorn_server import LaminaServer

        uv_config = uvicorn.Config(app, host=host, port=sock.getsockname()[1],
                                   log_level=args.uvicorn_log_level or args.log_level,
                                   access_log=not args.no_access_log, timeout_graceful_shutdown=5,
                                   root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile,
                                   ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                                   ssl_cert_reqs=args.ssl_cert_reqs)
        server = LaminaServer(uv_config, app.state.lamina)
        scheme = "https" if args.ssl_certfile else "http"
        print(f"[lamina] serving {names[0]!r} on {scheme}://{host}:{sock.getsockname()[1]}/v1", file=sys.stderr)
        server.run(sockets=[sock])
    finally:
        llm.shutdown()
        sock.close()
    return 0

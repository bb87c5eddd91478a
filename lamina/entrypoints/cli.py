"""The `lamina` command line: `lamina generate | plan | serve | bench | eval ...`."""

from __future__ import annotations

import argparse
import json
import sys

from lamina.config import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES, LOGPROBS_MODES
from lamina.entrypoints.cli_args import json_object
from lamina.entrypoints.openai.cli_serve import add_serve_parser
from lamina.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, with vLLM's names."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="checkpoint directory, or a Hugging Face Hub id fetched into the local "
                   "cache (default: the built-in demo model, lamina/demo_model)")
    g.add_argument("--revision", default=None, help="the Hub revision (branch, tag or commit) of a MODEL given as a Hub id")
    g.add_argument("--download-dir", default=None,
                   help="where a MODEL given as a Hub id is fetched (default: the Hugging Face cache)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts must be token ids, outputs carry token ids and empty text, "
                        "stop strings are refused")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--quantization", "-q", default=None,
                   help="vLLM's flag. Unset: follow the checkpoint's config.json. fp8: a block-wise FP8 checkpoint "
                        "(on a GPU its MoE experts stay FP8, the rest is dequantized into --dtype as it loads), or "
                        "an unquantized one whose experts are quantized to block FP8 as they load (weight-only); "
                        "with --load-format dummy: FP8 dummy weights. none: the checkpoint is unquantized")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="vLLM's flag: a YAML file of long option names and values (e.g. 'max-model-len: 32k'); "
                        "options on the command line win. JSON options also take vLLM's key-by-key form: "
                        "--hf-overrides.rope_parameters.rope_type yarn, --speculative-config.num_speculative_tokens 2")
    g.add_argument("--hf-overrides", type=_hf_overrides, default=None, metavar="JSON",
                   help="vLLM's flag: a JSON object laid over config.json, nested objects merged key by key, "
                        "e.g. '{\"text_config\": {\"rope_parameters\": {\"rope_type\": \"yarn\", ...}}}'")
    g.add_argument("--max-model-len", type=_max_model_len, default=None, metavar="TOKENS|auto",
                   help="context length (prompt and output; default: the model's): an integer, a count such as 32k "
                        "(32,000) or 32K (32,768), or auto / -1: the model's own if the GPU holds it, else the "
                        "longest that fits")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="keep prompt prefixes (KV blocks and a copy of the recurrent state where a chunk ended) "
                        "for later prompts that start with them; off unless given (vLLM's default is on)")
    g.add_argument("--prefix-cache-min-tokens", type=int, default=256,
                   help="the shortest prefix kept (keeping one costs its prompt a one-token step)")
    g.add_argument("--prefix-cache-junctions", action=argparse.BooleanOptionalAction, default=True,
                   help="with prefix caching: a prompt whose start an earlier prompt had too ends a chunk where "
                        "they part, once, and keeps that prefix for later prompts (vLLM's shared-prefix "
                        "checkpoint; costs that prompt one more step)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: seeded random weights from config.json alone (benchmarks)")
    g.add_argument("--ple-table-device", default="auto", choices=["auto", "gpu", "cpu"],
                   help="where Qwen4-Exp's N-gram PLE table lives (cpu: host memory, rows gathered per step)")
    g.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the delta-net layers' recurrent state pool (auto: the checkpoint's mamba_ssm_dtype, "
                        "else --mamba-cache-dtype, else float32; bfloat16 / float16 halve it, so more requests fit "
                        "on a GPU, and round the states at every step)")
    g.add_argument("--mamba-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="vLLM's flag: the recurrent state pool's dtype when --mamba-ssm-cache-dtype is auto and the "
                        "checkpoint names none (the conv state stays in the model's dtype, which holds it exactly)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES + KV_CACHE_DTYPE_ALIASES,
                   help="vLLM's flag: the attention layers' paged KV cache dtype (auto: the model's; fp8 = fp8_e4m3 "
                        "and fp8_e5m2 halve a 16-bit cache, scale 1.0: keys and values are clamped to the format's "
                        "range and rounded as they are stored, and every attention read sees the stored values; "
                        "needs a GPU of compute capability 8.9 or later, or the CPU)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly instead of replaying captured CUDA graphs")
    g.add_argument("--compilation-config", "-cc", "-O", default=None, metavar="JSON|LEVEL",
                   help="of vLLM's compilation config lamina reads cudagraph_mode (NONE = --enforce-eager, "
                        "FULL_DECODE_ONLY = decode graphs only: prefill / mixed steps eagerly) and "
                        "cudagraph_capture_sizes / max_cudagraph_capture_size (tokens: which decode steps replay a "
                        "graph); the rest has no effect. Key by key too: -cc.max_cudagraph_capture_size 64. "
                        "-O0 (vLLM's optimisation level 0) runs eagerly unless a cudagraph_mode is given, -O1..3 "
                        "keep the graphs")
    g.add_argument("--optimization-level", type=int, default=None, metavar="0-3",
                   help="vLLM's: 0 runs eagerly (its cudagraph_mode NONE) unless --compilation-config names a mode; "
                        "1-3 keep lamina's graphs (no torch.compile). -O0 .. -O3 too")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan and launch the next step while the current one runs on the GPU "
                        "(default: on for one GPU; with MTP, verification steps replayed from CUDA "
                        "graphs are planned ahead as if every draft were accepted)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="default sampling parameters of requests that set none: 'auto' reads the model's "
                        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens), 'vllm' ignores it, or a folder holding one")
    g.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                   help="vLLM's flag: sampling defaults laid over the generation config's (alone with "
                        "--generation-config vllm), e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 256}'")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs / prompt_logprobs a request may ask (-1: the whole vocabulary, "
                        "which a request asks with -1)")
    g.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=LOGPROBS_MODES,
                   help="vLLM's flag: what a sampled token's logprobs report: the model's (raw) or those the "
                        "token was drawn from after penalties, bans, temperature and top-k / top-p / min-p "
                        "(processed), as log-probabilities or logits (prompt_logprobs stay raw logprobs)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='MTP speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\' '
                        '(add "policy": "auto" to let the engine lower K when drafts do not pay)')


def _hf_overrides(text: str) -> dict:
    return json_object(text, "config.json keys")


def _max_model_len(text: str) -> int | str:
    from lamina.config import parse_max_model_len

    try:
        return parse_max_model_len(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Parallelism flags, with vLLM's names."""
    g = parser.add_argument_group("parallelism")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    g.add_argument("-dp", "--data-parallel-size", type=int, default=1)
    g.add_argument("--enable-expert-parallel", action="store_true")
    g.add_argument("--sequence-parallel-moe", default="auto", choices=["auto", "on", "off"],
                   help="auto: on when expert parallel, TP > 1 and DP > 1")
    g.add_argument("--pp-layer-partition", default=None,
                   help="layers per pipeline stage, e.g. 2,16,16,14 (env LAMINA_PP_LAYER_PARTITION or its alias "
                        "VLLM_PP_LAYER_PARTITION; the flag wins)")
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--node-rank", type=int, default=0)
    g.add_argument("--master-addr", default="127.0.0.1")
    g.add_argument("--master-port", type=int, default=None)


def parallel_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
        sequence_parallel_moe=args.sequence_parallel_moe, pp_layer_partition=args.pp_layer_partition,
        nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    from lamina.vllm_compat import cudagraph_overrides

    # vLLM's cudagraph_mode, capture sizes and optimization level 0 (lamina serve)
    graphs = cudagraph_overrides(getattr(args, "compilation_config", None), getattr(args, "optimization_level", None))
    return dict(
        tokenizer=args.tokenizer, skip_tokenizer_init=getattr(args, "skip_tokenizer_init", False),
        revision=getattr(args, "revision", None), download_dir=getattr(args, "download_dir", None),
        device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, seed=args.seed, num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization, ple_table_device=args.ple_table_device,
        mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", "auto"),
        mamba_cache_dtype=getattr(args, "mamba_cache_dtype", "auto"), load_format=args.load_format,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        quantization=getattr(args, "quantization", None), hf_overrides=getattr(args, "hf_overrides", None),
        enforce_eager=args.enforce_eager or graphs.get("enforce_eager", False),
        prefill_graphs=graphs.get("prefill_graphs", True),
        cudagraph_capture_sizes=graphs.get("cudagraph_capture_sizes"),
        max_cudagraph_capture_size=graphs.get("max_cudagraph_capture_size"),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", None),
        prefix_cache_min_tokens=getattr(args, "prefix_cache_min_tokens", 256),
        prefix_cache_junctions=getattr(args, "prefix_cache_junctions", True),
        generation_config=getattr(args, "generation_config", "auto"), max_logprobs=getattr(args, "max_logprobs", 20),
        override_generation_config=getattr(args, "override_generation_config", None),
        logprobs_mode=getattr(args, "logprobs_mode", "raw_logprobs"),
        async_scheduling=getattr(args, "async_scheduling", None), speculative_config=_speculative_config(getattr(args, "speculative_config", None)),
        **(parallel_kwargs(args) if hasattr(args, "tensor_parallel_size") else {}),
    )


def _speculative_config(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
    return value


def _generate(args: argparse.Namespace) -> int:
    from lamina import LLM
    from lamina.models.default_model import ensure_default_model

    if args.node_rank > 0:  # a secondary node of a multi-node layout: run its ranks headless
        from lamina.config import EngineArgs
        from lamina.engine.mp_executor import run_headless_node

        return run_headless_node(EngineArgs(model=args.model, **engine_kwargs(args)))
    token_prompts = [_token_ids(text) for text in args.prompt_token_ids]
    if not args.prompt and not token_prompts:
        print("lamina generate: error: --prompt or --prompt-token-ids is required", file=sys.stderr)
        return 2
    if args.chat and token_prompts:
        print("lamina generate: error: --chat applies a chat template to text: use --prompt", file=sys.stderr)
        return 2
    model = args.model or str(ensure_default_model())
    with LLM(model, **engine_kwargs(args)) as llm:
        params = _generate_params(args, llm.engine.default_sampling)
        if args.chat:  # each prompt its own one-message conversation
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
        else:
            prompts = [*args.prompt, *({"prompt_token_ids": ids} for ids in token_prompts)]
            outputs = llm.generate(prompts, params, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    for prompt, out in zip([*args.prompt, *token_prompts], outputs):
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({
                "prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
            }))
        elif isinstance(prompt, list):  # token ids in: the text, or the ids where there is no tokenizer
            print(completion.text if tokenizer is not None else " ".join(map(str, completion.token_ids)))
        else:
            print(completion.text if args.chat else f"{prompt}{completion.text}")
        if not args.json:
            print(f"[lamina] {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}", file=sys.stderr)
    return 0


# what `lamina generate` samples with when neither its flags nor the generation config say: greedy, 32 tokens
GENERATE_FALLBACK = {"temperature": 0.0, "max_tokens": 32}
GENERATE_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "max_tokens")


def _generate_params(args: argparse.Namespace, config_defaults: dict) -> SamplingParams:
    """A flag that is given, else the model's generation config (`--generation-config`; vLLM's
    defaults for requests that leave a field out), else GENERATE_FALLBACK."""
    given = {name: getattr(args, name) for name in GENERATE_SAMPLING_FLAGS if getattr(args, name) is not None}
    return SamplingParams(**{**GENERATE_FALLBACK, **config_defaults, **given}, seed=args.sampling_seed,
                          stop=args.stop or None, ignore_eos=args.ignore_eos)


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ValueError(f"--prompt-token-ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-token-ids is empty: give at least one token id")
    return ids


def _plan(args: argparse.Namespace) -> int:
    from lamina.config import EngineArgs
    from lamina.entrypoints.plan_cmd import run_plan

    kwargs = engine_kwargs(args)
    return run_plan(args, EngineArgs(model=args.model_path, **kwargs))


class _LaminaParser(argparse.ArgumentParser):
    """Unknown arguments of a subcommand are reported with that subcommand's usage, not the top level's."""

    subcommands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            target = self.subcommands.get(getattr(parsed, "command", None) or "", self)
            target.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    import lamina

    parser = _LaminaParser(prog="lamina", description="Inference engine for the Qwen hybrid MoE models.")
    parser.add_argument("--version", action="version", version=f"lamina {lamina.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text offline for one or more prompts")
    add_engine_args(gen)
    add_parallel_args(gen)
    s = gen.add_argument_group("sampling")
    s.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for several; required on node 0)")
    s.add_argument("--prompt-token-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable; works without a tokenizer)")
    # unset: the model's generation config (--generation-config), else greedy and 32 tokens
    s.add_argument("--max-tokens", type=int, default=None, help="default: the generation config's max_new_tokens, else 32")
    s.add_argument("--temperature", type=float, default=None, help="default: the generation config's, else 0 (greedy)")
    s.add_argument("--top-p", type=float, default=None, help="default: the generation config's, else 1")
    s.add_argument("--top-k", type=int, default=None, help="default: the generation config's, else 0 (off)")
    s.add_argument("--min-p", type=float, default=None, help="default: the generation config's, else 0")
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--chat", action="store_true",
                   help="apply the tokenizer's chat template to each prompt (a one-message conversation each)")
    s.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.set_defaults(func=_generate)

    plan = sub.add_parser("plan", help="print the parallel plan of a model and layout (reads config.json only)")
    plan.add_argument("model_path", metavar="MODEL")
    add_engine_args(plan)
    add_parallel_args(plan)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                      help="also show what fits on GPUs of this many GiB (e.g. 79.2 for an 80 GB H100): max_num_seqs "
                           "and KV cache tokens under --gpu-memory-utilization, --max-num-seqs, --max-model-len "
                           "(with the weights a GPU engine keeps: FP8 experts stay FP8 on GPUs of compute capability "
                           "8.9 or newer, counted so where triton is installed, else dequantized)")
    plan.set_defaults(func=_plan)
    add_serve_parser(sub)
    from lamina.entrypoints.bench import add_bench_parser

    add_bench_parser(sub)
    from lamina.entrypoints.eval_cmd import add_eval_parser

    add_eval_parser(sub)
    parser.subcommands = dict(sub.choices)
    return parser


def _boolean_flags(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """Every subcommand's on/off options -> whether it has a `--no-` form (for `--config` files)."""
    flags: dict[str, bool] = {}
    parsers = [parser]
    while parsers:
        current = parsers.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif isinstance(action, argparse.BooleanOptionalAction):
                flags[action.option_strings[0]] = True
            elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                flags.update({o: False for o in action.option_strings if o.startswith("--")})
    return flags


def main(argv: list[str] | None = None) -> int:
    from lamina.entrypoints.cli_args import expand_argv

    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    try:
        expanded = expand_argv(given, _boolean_flags(parser))  # --config FILE, --json-option.key value
    except ValueError as e:
        print(f"lamina: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(expanded)
    args.invocation = given  # what ran (bench records keep it)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"lamina: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

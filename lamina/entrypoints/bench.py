"""`lamina bench latency | throughput | serve`: vLLM-style benchmarks.

latency: for each batch size, B prompts of `--input-len` random token ids decode `--output-len`
tokens together; reports TTFT (the prefill steps), TPOT (mean decode step), output tok/s and the
fraction of the HBM roofline: the bytes one decode step really reads (every non-expert weight
but the embedding, the distinct routed experts of the batch's real decode steps (counted in an
untimed eager rerun of its first steps), the shared experts, the LM
head, the KV cache read, the recurrent state read and written) over the device copy bandwidth
measured in the same run. throughput: N prompts offline, total and output tok/s. serve: a running
`lamina serve` measured over HTTP (lamina/entrypoints/bench_serve.py).

Each run prints a markdown table, writes one JSON record per row (`--output-json`) and, where
matplotlib is installed, a PNG of output tok/s against batch size with the roofline drawn.
Without `--model`, `--preset qwen3.5-35b-a3b` writes that model's text config (dummy weights;
the presets are in lamina/entrypoints/presets.py).
Every record carries the keys of SHARED_KEYS (None where a kind has no such figure).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from lamina.entrypoints.presets import DEFAULT_PRESET, preset_dir, preset_names

# The keys every bench record has, whatever its kind (None where the kind has no such figure).
# concurrency: requests in flight at most (latency: the batch size; throughput: the engine's
# max_num_seqs or fewer prompts; serve: --max-concurrency, None for no limit).
SHARED_KEYS = ("kind", "command", "gpu", "model", "dtype", "concurrency", "num_prompts", "input_len", "output_len",
               "output_tok_per_s", "total_tok_per_s", "tpot_ms", "ttft_ms", "hbm_roofline_fraction",
               "bytes_per_step", "baseline", "speedup_vs_baseline")


def add_bench_parser(subparsers) -> None:
    from lamina.entrypoints.bench_serve import __doc__ as serve_doc, add_serve_bench_args, run_serve_bench

    raw = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser("bench", help="benchmarks: latency (decode), throughput (offline), serve (HTTP)",
                              description=__doc__, formatter_class=raw)
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    for kind, help_ in (("latency", "decode latency of batches, offline"), ("throughput", "N prompts, offline")):
        k = kinds.add_parser(kind, help=help_, description=__doc__, formatter_class=raw)
        _add_offline_args(k)
        k.set_defaults(func=run_bench)
    s = kinds.add_parser("serve", help="a running `lamina serve`, over HTTP", description=serve_doc,
                         formatter_class=raw)
    add_serve_bench_args(s)
    s.set_defaults(func=run_serve_bench)


def _add_offline_args(p) -> None:
    from lamina.entrypoints import cli

    cli.add_engine_args(p)
    cli.add_parallel_args(p)  # vLLM's bench commands take every engine flag, -tp / -pp / -dp too
    b = p.add_argument_group("benchmark")
    b.add_argument("--preset", default=DEFAULT_PRESET, choices=preset_names(),
                   help="config written when --model is not given (weights: --load-format dummy)")
    b.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    b.add_argument("--batch-size", type=int, nargs="+", default=[1], help="latency: batch sizes to sweep")
    b.add_argument("--num-prompts", type=int, default=64, help="throughput: number of prompts")
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--output-json", default=None, help="write the records (a JSON list) here")
    b.add_argument("--plot", default=None, help="latency: write a PNG of tok/s against batch size")
    b.add_argument("--compare", choices=["transformers"], default=None,
                   help="latency: also time transformers' generate on the same config in this run")


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 10)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / sorted(times[2:])[len(times[2:]) // 2]


def distinct_experts_per_layer(llm, prompts_ids: list[list[int]], output_len: int, decode_steps: int = 4) -> list[float]:
    """Per MoE layer, the mean number of distinct experts one decode step of this batch routes to:
    the prompts run again (untimed, `output_len` tokens each, as in the timed run) through the
    engine eagerly, the experts kernel counting the routed ids of every step whose metadata says
    one token for each of the batch's requests (not prefill, not mixed prefill + decode), until
    `decode_steps` such steps were counted; the requests are then aborted. The routing of real
    decode steps (their contexts, their states), not a proxy: with dummy weights it is far from
    uniform, and it decides how many expert bytes a step reads."""
    from lamina import SamplingParams
    from lamina.kernels.selection import is_one_token_decode
    from lamina.layers.moe import SparseMoE

    engine = llm.engine
    runner = engine.executor.runner
    batch = len(prompts_ids)
    moes = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    counts: list[list[int]] = [[] for _ in moes]
    decode_step = [False]  # set from each MoE call's step metadata (host ints of the plan)

    def watching(forward):
        def watched(x, meta):
            decode_step[0] = is_one_token_decode(meta) and meta.num_reqs == batch
            return forward(x, meta)

        return watched

    def counting(index, inner):
        def counted(x, w13, w2, weights, ids, start, **kwargs):
            if decode_step[0]:
                counts[index].append(int(torch.unique(ids).numel()))
            return inner(x, w13, w2, weights, ids, start, **kwargs)

        return counted

    saved = [m.experts_kernel for m in moes]
    graphs, runner.decode_graphs = runner.decode_graphs, None  # eager: the hooks see every step
    request_ids = []
    try:
        for i, m in enumerate(moes):
            m.forward = watching(m.forward)  # instance attributes, removed below
            m.experts_kernel = counting(i, saved[i])
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        request_ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts_ids]
        with torch.inference_mode():
            while engine.has_unfinished_requests() and min((len(c) for c in counts), default=0) < decode_steps:
                engine.step()
    finally:
        for request_id in request_ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():  # a step in flight (asynchronous scheduling) completes
            engine.step()
        runner.decode_graphs = graphs
        for m, inner in zip(moes, saved):
            m.experts_kernel = inner
            m.__dict__.pop("forward", None)
    return [sum(c) / len(c) if c else 0.0 for c in counts]


def decode_bytes(llm, batch: int, context_len: int, distinct_experts: list[float]) -> int:
    """Bytes one decode step at this batch reads (and, for recurrent state, writes)."""
    from lamina.layers.attention import GatedAttention
    from lamina.layers.embedding import VocabParallelEmbedding
    from lamina.layers.gated_delta_net import GatedDeltaNet
    from lamina.layers.moe import SparseMoE

    model = llm.engine.executor.runner.model
    total = 0
    expert_params = set()
    for m in model.modules():
        if isinstance(m, SparseMoE):
            expert_params |= {id(m.w13), id(m.w2)}
            if m.fp8 is not None:  # block FP8: each routed expert's scales are read with it
                expert_params |= {id(m.w13_scale_inv), id(m.w2_scale_inv)}
        if isinstance(m, VocabParallelEmbedding):
            expert_params |= {id(p) for p in m.parameters()}  # only B rows are read
    for p in model.parameters():
        if id(p) not in expert_params:
            total += p.numel() * p.element_size()
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for m, distinct in zip(moes, distinct_experts):
        per_expert = (m.w13[0].numel() + m.w2[0].numel()) * m.w13.element_size()
        if m.fp8 is not None:
            per_expert += (m.w13_scale_inv[0].numel() + m.w2_scale_inv[0].numel()) * 4
        total += round(distinct * per_expert)
    for m in model.modules():
        if isinstance(m, GatedAttention):
            total += batch * context_len * 2 * m.num_kv_heads * m.head_dim * m.k_cache.element_size()
        if isinstance(m, GatedDeltaNet):
            per_slot = (m.ssm_state[0].numel() * m.ssm_state.element_size()
                        + m.conv_state[0].numel() * m.conv_state.element_size())
            total += 2 * batch * per_slot  # read and written
    return total


def _mixed_replays(engine) -> int:
    """Prefill / mixed steps replayed from graphs so far (single rank; 0 where there are none)."""
    runner = getattr(engine.executor, "runner", None)
    return getattr(runner, "mixed_replays", 0)


def _quantization(engine) -> str | None:
    """The weights' block FP8 format, as the record names it (None: unquantized)."""
    quant = engine.setup.quantization if getattr(engine, "setup", None) is not None else None
    return quant.describe() if quant is not None else None


def _warn_if_preempting(engine, batch: int, tokens_per_request: int) -> None:
    """A latency run whose batch does not fit the KV cache preempts and recomputes requests, which
    its TPOT and TTFT then include: say so (the GPU's memory plan may have left the cache small)."""
    block = engine.args.block_size
    per_replica = -(-batch // getattr(engine, "num_replicas", 1))  # each data-parallel replica has its own cache
    need = per_replica * -(-tokens_per_request // block)
    if engine.num_kv_blocks < need:
        print(f"lamina bench: the KV cache holds {engine.num_kv_blocks * block} tokens, fewer than batch {per_replica} x "
              f"{tokens_per_request} tokens (per data-parallel replica); requests will be preempted and recomputed, "
              "and the figures include it (raise --gpu-memory-utilization or lower the batch size)", file=sys.stderr)


def _engine_kwargs(args) -> dict:
    from lamina.entrypoints.cli import engine_kwargs

    kwargs = engine_kwargs(args)
    kwargs["show_progress"] = False
    return kwargs


def measures_roofline(device: torch.device, engine_kwargs: dict) -> bool:
    """Whether a latency record gets the HBM roofline: on one GPU, whose model the bench reads in
    this process (routed experts, weight bytes). Several ranks keep their models in their own
    processes (and a roofline would be per rank): their records carry TPOT and tok/s only."""
    from dataclasses import fields

    from lamina.parallel.config import ParallelConfig

    layout = ParallelConfig(**{f.name: engine_kwargs[f.name] for f in fields(ParallelConfig) if f.name in engine_kwargs})
    return device.type == "cuda" and layout.is_single_rank


def run_latency(args, model_path: str) -> list[dict]:
    from lamina import LLM, SamplingParams
    from lamina.config import resolve_device
    from lamina.engine.gc_heap import frozen_heap

    device = resolve_device(args.device)
    kwargs = _engine_kwargs(args)
    bandwidth = copy_bandwidth(device) if measures_roofline(device, kwargs) else None
    records = []
    rng = random.Random(0)
    max_batch = max(args.batch_size)
    implicit_seqs = not kwargs.get("max_num_seqs")
    kwargs["max_num_seqs"] = kwargs.get("max_num_seqs") or max_batch
    kwargs["max_model_len"] = kwargs.get("max_model_len") or args.input_len + args.output_len + 16
    try:
        llm = LLM(model_path, **kwargs)
    except ValueError as e:  # the GPU's memory plan refusing the batch: say where max_num_seqs came from
        if implicit_seqs and f"max_num_seqs = {max_batch} " in str(e):
            raise ValueError(f"{e} (bench latency sets max_num_seqs to the largest --batch-size, {max_batch})") from e
        raise
    with llm:
        engine = llm.engine
        _warn_if_preempting(engine, max_batch, args.input_len + args.output_len)
        vocab = engine.model_config.vocab_size
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], warm, use_tqdm=False)
        for batch in args.batch_size:
            prompts = [[rng.randrange(0, min(vocab, 200_000)) for _ in range(args.input_len)] for _ in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
            for p in prompts:
                engine.add_request({"prompt_token_ids": p}, params)
            # Timed at the host's arrival of each step's tokens (no device sync per step, which
            # would stop asynchronous scheduling from overlapping steps): TTFT when every request
            # has its first token, TPOT over the steps that brought every request one more.
            ttft = first_all = last_all = None
            decode_steps = 0
            mixed_before = _mixed_replays(engine)
            start = time.perf_counter()
            produced = {}
            first_steps_ms = []  # each step's wall time until every request has its first token
            with frozen_heap():  # as LLM.generate and the server run their steps (lamina.engine.gc_heap)
                while engine.has_unfinished_requests():
                    before = time.perf_counter()
                    outs = engine.step()
                    now = time.perf_counter()
                    if ttft is None:
                        first_steps_ms.append(round((now - before) * 1e3, 3))
                    all_started = len(produced) == batch
                    for o in outs:
                        produced[o.request_id] = len(o.outputs[0].token_ids)
                    if ttft is None and len(produced) == batch:
                        ttft, first_all = now - start, now
                    elif all_started and len(outs) == batch:
                        decode_steps += 1
                        last_all = now
            tpot = (last_all - first_all) / decode_steps if decode_steps else float("nan")
            record = {
                "kind": "latency", "command": command_line(args), "gpu": _gpu_name(device),
                "model": args.model or f"{args.preset} ({engine.model_config.num_hidden_layers} layers, dummy)",
                "dtype": str(engine.dtype).removeprefix("torch."), "quantization": _quantization(engine),
                "batch_size": batch, "concurrency": batch,
                "num_prompts": batch, "input_len": args.input_len,
                "output_len": args.output_len, "output_tok_per_s": batch / tpot if decode_steps else None,
                "total_tok_per_s": batch * (args.input_len + args.output_len) / (time.perf_counter() - start),
                "tpot_ms": tpot * 1e3, "ttft_ms": ttft * 1e3 if ttft is not None else None,
                "cuda_graphs": engine.cuda_graphs, "async_scheduling": engine.async_scheduling,
                # prefill / mixed steps replayed from graphs during this batch size's run (lamina.worker.mixed_graphs)
                "prefill_graph_steps": _mixed_replays(engine) - mixed_before,
                "decode_steps": decode_steps, "first_token_steps_ms": first_steps_ms,
            }
            if bandwidth is not None:
                distinct = distinct_experts_per_layer(llm, prompts, args.output_len)
                nbytes = decode_bytes(llm, batch, args.input_len + args.output_len // 2, distinct)
                record.update(
                    bytes_per_step=nbytes, copy_bandwidth_gb_s=bandwidth / 1e9,
                    roofline_tpot_ms=nbytes / bandwidth * 1e3,
                    hbm_roofline_fraction=(nbytes / bandwidth) / tpot if decode_steps else None,
                    mean_distinct_experts=sum(distinct) / max(len(distinct), 1),
                )
            records.append(record)
    return records


def transformers_model(model_path: str, device: torch.device, dtype: torch.dtype, hf_overrides: dict | None = None):
    """transformers' model of the checkpoint in `dtype` on `device` (config.json with `hf_overrides`
    laid over it, as lamina read it): its weights, or its own random init for a config-only
    directory (the dummy presets), built in `dtype` from the start: plain `cls(config)` would first
    build float32 weights, twice the bytes (the 35B preset's then does not fit an 80 GB GPU)."""
    import transformers

    from lamina.worker.model_loader import read_model_config

    config = read_model_config(model_path, hf_overrides)
    cls = getattr(transformers, config.architectures[0])
    torch.manual_seed(0)
    if any(Path(model_path).glob("*.safetensors")):
        return cls.from_pretrained(model_path, config=config, dtype=dtype).to(device).eval()
    with torch.device(device):
        return cls._from_config(config, dtype=dtype).eval()


def transformers_decode(model_path: str, batch: int, input_len: int, output_len: int, device: torch.device,
                        dtype: torch.dtype, hf_overrides: dict | None = None) -> dict:
    """transformers' `generate` on the checkpoint (`transformers_model`). TPOT comes from one timed
    `generate`: a stopping criterion (called once per generated token) syncs the device and stamps
    the time, and TPOT is the mean gap between the stamps after the first token (subtracting two
    separately timed runs went negative under load)."""
    import transformers

    model = transformers_model(model_path, device, dtype, hf_overrides)
    config = model.config
    vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    ids = torch.randint(0, min(vocab, 200_000), (batch, input_len), device=device)

    class TokenTimes(transformers.StoppingCriteria):
        """Never stops generation; records when each generated token is on the host's side."""

        def __init__(self):
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            _sync(device)
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(new_tokens: int) -> list[float]:
        times = TokenTimes()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       stopping_criteria=transformers.StoppingCriteriaList([times]))
        return times.stamps

    with torch.no_grad():
        generate(2)  # warm-up
        stamps = generate(max(output_len, 2))
    del model
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return {"engine": f"transformers {transformers.__version__}", "output_tok_per_s": batch / tpot, "tpot_ms": tpot * 1e3}


def run_throughput(args, model_path: str) -> list[dict]:
    from lamina import LLM, SamplingParams
    from lamina.config import resolve_device

    rng = random.Random(0)
    kwargs = _engine_kwargs(args)
    kwargs["max_model_len"] = kwargs.get("max_model_len") or args.input_len + args.output_len + 16
    device = resolve_device(args.device)
    with LLM(model_path, **kwargs) as llm:
        vocab = llm.engine.model_config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(0, min(vocab, 200_000)) for _ in range(args.input_len)]}
                   for _ in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        _sync(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        elapsed = time.perf_counter() - start
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return [{
            "kind": "throughput", "command": command_line(args), "gpu": _gpu_name(device),
            "model": args.model or f"{args.preset} (dummy)", "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "quantization": _quantization(llm.engine), "concurrency": min(args.num_prompts, llm.engine.max_num_seqs), "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len, "max_num_seqs": llm.engine.max_num_seqs,
            "output_tokens": out_tokens, "elapsed_s": elapsed,
            "output_tok_per_s": out_tokens / elapsed, "total_tok_per_s": (out_tokens + args.num_prompts * args.input_len) / elapsed,
        }]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def command_line(args) -> str:
    """The command that ran, as a shell line (`cli.main` keeps its argv on the namespace)."""
    return shlex.join(["lamina", *getattr(args, "invocation", sys.argv[1:])])


def with_shared_keys(record: dict) -> dict:
    return {**{k: None for k in SHARED_KEYS}, **record}


TABLE = ("batch_size", "num_prompts", "input_len", "output_len", "ttft_ms", "tpot_ms", "output_tok_per_s",
         "total_tok_per_s", "hbm_roofline_fraction", "mean_distinct_experts", "speedup_vs_baseline")


def markdown_table(records: list[dict], columns=TABLE) -> str:
    """The columns some record has a value for; an empty cell where a record has none."""
    columns = [c for c in columns if any(r.get(c) is not None for r in records)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    for r in records:
        cells = [r.get(c) for c in columns]
        lines.append("| " + " | ".join("" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
                                       for v in cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch_size"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r["output_tok_per_s"] for r in records], "o-", label="lamina")
    if all("roofline_tpot_ms" in r for r in records):
        ax.plot(batches, [b / (r["roofline_tpot_ms"] / 1e3) for b, r in zip(batches, records)], "k--", label="HBM roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode output tok/s")
    ax.set_title(records[0]["model"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_bench(args) -> int:
    model_path = args.model or str(preset_dir(args.preset, args.num_layers))
    if args.model is None:
        args.load_format = "dummy"
    records = run_latency(args, model_path) if args.kind == "latency" else run_throughput(args, model_path)
    if args.compare == "transformers" and args.kind == "latency":
        from lamina.config import resolve_device, resolve_dtype

        gc.collect()  # lamina's engine is shut down: its weights and caches go before transformers' load
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device, None)
        for record in records:
            baseline = transformers_decode(model_path, record["batch_size"], args.input_len, args.output_len, device,
                                           dtype, getattr(args, "hf_overrides", None))
            # what transformers ran: the checkpoint's own weights, or for dummy weights its random bf16 init
            # (lamina's FP8 dummy experts have no transformers counterpart)
            baseline["quantization"] = None if args.load_format == "dummy" else record.get("quantization")
            record["baseline"] = baseline
            record["speedup_vs_baseline"] = record["output_tok_per_s"] / baseline["output_tok_per_s"]
    records = [with_shared_keys(r) for r in records]
    print(markdown_table(records))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(records, indent=2))
    if args.plot and args.kind == "latency":
        try:
            plot(records, args.plot)
        except ImportError:
            print("lamina bench: matplotlib is not installed; no plot written", file=sys.stderr)
    return 0

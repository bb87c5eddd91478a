"""`lamina plan MODEL [flags] [--json]`: print the ParallelPlan of a model and layout, per rank.

Reads config.json (and the safetensors headers, for the experts' FP8 check and the MTP drafter);
MODEL may be a Hugging Face Hub id: its configs are fetched into the HF cache (no weights) and the
headers read remotely, where the local snapshot has no shards. Per-rank memory is estimated by building each rank's stage on the meta
device (no memory, no weights), so the figures are what the loader would allocate. With
`--gpu-memory-gib N` it also says what the engine's GPU memory plan would make of each rank on a
GPU of N GiB (max_num_seqs, KV cache tokens), or why it would not start.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch

from pathlib import Path

from lamina.config import EngineArgs, resolve_dtype, resolve_kv_cache_dtype, resolve_ssm_state_dtype
from lamina.engine.memory_plan import (
    GIB, activation_headroom_bytes, plan_gpu_memory, speculation_bytes, state_dtype_hint, usable_gpu_bytes,
)
from lamina.engine.setup import expert_intermediate_per_rank, max_model_len_is_auto, resolve_max_model_len
from lamina.engine.spec_decode import SpeculativeConfig, check_speculative
from lamina.models.registry import resolve_model_class
from lamina.parallel.context import GroupCollectives, ParallelContext
from lamina.parallel.plan import ParallelConfigError, ParallelPlan, build_plan
from lamina.models.hub import looks_like_repo_id, resolve_model_path
from lamina.models.loader import CheckpointError, ShardHeader, read_header, resolve_shards
from lamina.quantization import online_blocks, read_quantization, resolve_quantization, unquantized_expert_tensors
from lamina.worker.mixed_graphs import drafter_needs_more, prefill_needs_host
from lamina.worker.model_loader import attach_drafter, read_model_config


def _headers(model_path, engine_args: EngineArgs, hub_id: str | None = None) -> list:
    """The checkpoint's shard headers ([] for dummy weights or a folder without shards). A Hub id
    whose snapshot holds no shards (plan fetches configs only) has its headers read from the Hub
    (`huggingface_hub.get_safetensors_metadata`: the headers alone, no weights); [] when that fails."""
    if engine_args.load_format == "dummy":
        return []
    try:
        return [read_header(p) for p in resolve_shards(Path(model_path))]
    except (CheckpointError, OSError):
        if hub_id is None:
            return []
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = get_safetensors_metadata(hub_id, revision=engine_args.revision)
    except Exception as e:  # noqa: BLE001 - network, auth, a repository without safetensors
        print(f"lamina plan: the shard headers of {hub_id!r} could not be read from the Hub ({type(e).__name__}: "
              f"{e}); planning as if every expert tensor were in the checkpoint's declared format", file=sys.stderr)
        return []
    return [ShardHeader(Path(name), {t: (info.dtype, tuple(info.shape)) for t, info in file.tensors.items()})
            for name, file in sorted(meta.files_metadata.items())]


def _is_ple_table(name: str) -> bool:
    return "ngram_embedding" in name or "ple_table" in name


def estimate_rank(model_cls, cfg, plan: ParallelPlan, rank: int, dtype: torch.dtype, block_size: int,
                  ssm_state_dtype: torch.dtype = torch.float32, quantization=None, kernels: str = "reference",
                  fp8_experts: bool = True, drafter: dict | None = None, kv_cache_dtype: torch.dtype | None = None) -> dict:
    """Weight bytes (PLE tables apart), KV bytes per token and recurrent-state bytes per request
    (the recurrent pools in `ssm_state_dtype`). `quantization`: the checkpoint's block FP8 format,
    whose experts stay FP8 on the `kernels` set "triton" (a CUDA engine) when `fp8_experts` (every
    expert tensor of the checkpoint is FP8: `lamina.quantization.unquantized_expert_tensors`). `drafter`
    (`hf_config`, `mtp_prefix`, shard `headers`) under MTP: the last stage's drafter is built too, and
    its weights (its own embedding table on a pipeline's last stage) and KV cache are counted. The paged
    KV cache is counted in `kv_cache_dtype` (None: `dtype`)."""
    me = plan.ranks[rank]
    ctx = ParallelContext(
        tp=GroupCollectives(plan.tp, me.tp), device=torch.device("meta"),
        dp=GroupCollectives(plan.dp, me.dp), ep=GroupCollectives(plan.ep_size, me.ep or 0),
        ep_enabled=plan.ep_enabled, expert_range=me.experts, sp=plan.sp,
    )
    options = {"ple_table_device": "gpu", "quantization": quantization, "kernel_set": kernels,
               "fp8_experts": fp8_experts}
    model = model_cls(cfg, ctx, dtype=dtype, device="meta", layer_range=me.layer_range, options=options)
    if drafter is not None and model.is_last_stage:
        attach_drafter(model, drafter["hf_config"], dict(options, mtp_prefix=drafter["mtp_prefix"]), "meta",
                       drafter["headers"])
    mtp = getattr(model, "mtp", None)
    weights = ple = 0
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        nbytes = param.numel() * param.element_size()
        if _is_ple_table(name):
            ple += nbytes
        else:
            weights += nbytes
    caches = model.paged_cache_modules() + (mtp.paged_cache_modules() if mtp is not None else [])
    kv_per_block = sum(m.paged_cache_bytes_per_block(block_size, kv_cache_dtype or dtype) for m in caches)
    state = sum(m.bind_state(1, dtype, "meta", ssm_dtype=ssm_state_dtype) for m in model.state_modules())
    return {"weight_bytes": weights, "ple_table_bytes": ple, "kv_bytes_per_token": kv_per_block // block_size,
            "state_bytes_per_request": state, "ssm_state_dtype": str(ssm_state_dtype).removeprefix("torch."),
            "kv_cache_dtype": str(kv_cache_dtype or dtype).removeprefix("torch."),
            # why short prefill / mixed steps could not replay graphs whatever the kernels (None: they can)
            "prefill_graphs_blocked_by": prefill_needs_host(model) or drafter_needs_more(mtp)}


# Memory a CUDA process holds outside torch's allocator before the caches (context, cuBLAS, modules):
# 0.75 GiB measured on an H100 with torch 2.11 (session 30, memory_peak_h100_s30.json), rounded up.
CUDA_CONTEXT_BYTES = 1 << 30


def gpu_memory_preview(estimate: dict, cfg, engine_args: EngineArgs, gpu_memory_gib: float, max_model_len: int,
                       dtype: torch.dtype, num_speculative_tokens: int,
                       ssm_state_dtype: torch.dtype = torch.float32, kv_cache_dtype: torch.dtype | None = None) -> dict:
    """What the engine's memory plan (lamina.engine.memory_plan) would make of one rank on a GPU of
    `gpu_memory_gib` GiB: its max_num_seqs and KV cache, or the error it would raise. Approximate: the
    engine plans from the free memory it finds after loading; here that is the GPU's memory less the
    rank's weights (PLE tables too with --ple-table-device gpu) and CUDA_CONTEXT_BYTES; MTP's reserve
    counts its verification graphs' buffers."""
    from lamina.engine.llm_engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
    from lamina.worker.cuda_graphs import graph_token_limit
    from lamina.worker.mixed_graphs import mixed_graph_max_tokens
    from lamina.worker.verify_graphs import verify_state_rows

    total = int(gpu_memory_gib * GIB)
    resident = estimate["weight_bytes"] + (estimate["ple_table_bytes"] if engine_args.ple_table_device == "gpu" else 0)
    free = total - resident - CUDA_CONTEXT_BYTES
    seqs = engine_args.max_num_seqs or engine_args.default_max_num_seqs or DEFAULT_MAX_NUM_SEQS["cuda"]
    batched = engine_args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    per_slot, k = estimate["state_bytes_per_request"], num_speculative_tokens
    graphs = not engine_args.enforce_eager
    hint = state_dtype_hint(ssm_state_dtype, kv_cache_dtype)  # (a GPU of FP8's generation assumed)
    single_rank = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size * engine_args.data_parallel_size == 1
    prefill_graphs = (graphs and engine_args.prefill_graphs and single_rank
                      and estimate.get("prefill_graphs_blocked_by") is None)
    limit = graph_token_limit(engine_args.cudagraph_capture_sizes, engine_args.max_cudagraph_capture_size)
    mixed = mixed_graph_max_tokens(limit) if prefill_graphs else 0  # their pool (lamina.worker.mixed_graphs)
    try:
        plan = plan_gpu_memory(
            usable_bytes=usable_gpu_bytes(free, total, engine_args.gpu_memory_utilization),
            bytes_per_block=estimate["kv_bytes_per_token"] * engine_args.block_size, block_size=engine_args.block_size,
            max_model_len=max_model_len, max_num_seqs=seqs, max_num_seqs_is_default=engine_args.max_num_seqs is None,
            state_bytes_per_slot=per_slot,
            speculation_bytes=lambda n: speculation_bytes(
                n, k, per_slot, cfg.vocab_size, verify_state_rows(
                    n, k, engine_args.cudagraph_capture_sizes, engine_args.max_cudagraph_capture_size) if graphs else 0),
            activation_bytes=lambda n: activation_headroom_bytes(cfg, dtype.itemsize, batched, n, k, mixed),
            state_hint=hint, fit_max_model_len=max_model_len_is_auto(engine_args),
        )
    except ValueError as e:
        return {"gpu_memory_gib": gpu_memory_gib, "fits": False, "error": str(e)}
    return {"gpu_memory_gib": gpu_memory_gib, "fits": True, "max_num_seqs": plan.max_num_seqs,
            "state_hint": hint, "max_model_len": plan.max_model_len,
            "max_num_seqs_lowered_from": plan.lowered_from, "kv_cache_tokens": plan.num_kv_blocks * engine_args.block_size,
            "usable_bytes": plan.usable_bytes, "state_bytes": plan.state_bytes, "speculation_bytes": plan.speculation_bytes,
            "activation_bytes": plan.activation_bytes, "kv_cache_bytes": plan.kv_cache_bytes,
            "describe": plan.describe(engine_args.block_size, plan.max_model_len)}


def _boundary(model_cls, cfg, plan: ParallelPlan) -> dict:
    width = cfg.hidden_size * getattr(cfg, "hc_count", 1)
    name = "hyper-connection streams" if getattr(cfg, "hc_count", 1) > 1 else "hidden states"
    rows = f"ceil(T/{plan.tp})" if plan.sp else "T"
    return {"tensor": name, "shape": f"[{rows}, {width}]", "layout": "S(0) over TP" if plan.sp else "R over TP"}


def _gib(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def render(plan: ParallelPlan, ranks: list[dict], boundary: dict, device_type: str) -> str:
    lines = [
        f"world size {plan.world_size}: tp {plan.tp} x pp {plan.pp} x dp {plan.dp}; "
        f"expert parallel {'on, EP size ' + str(plan.ep_size) if plan.ep_enabled else 'off'}",
        f"sequence-parallel MoE: {'on' if plan.sp else 'off'} ({plan.sp_reason})",
        f"stages ({plan.partition_source}): " + ", ".join(f"{s}" for s in plan.stage_sizes),
    ]
    if plan.kv_heads_replicated:
        lines.append(f"KV heads replicated across groups of TP ranks (tp {plan.tp} > num_key_value_heads)")
    if plan.pp > 1:
        lines.append(f"pipeline boundary: {boundary['tensor']} {boundary['shape']} ({boundary['layout']})")
    for r in ranks:
        me = r["coords"]
        start, end = me["layer_range"]
        dev = "cpu" if device_type == "cpu" else f"cuda:{me['local_rank']}"
        lines.append(
            f"rank {me['rank']} (node {me['node']}, {dev}): dp {me['dp']} pp {me['pp']} tp {me['tp']} ep {me['ep'] if me['ep'] is not None else '-'}"
        )
        lines.append(f"  layers {start}-{end - 1} ({end - start})" + ("  + embedding" if me["has_embedding"] else "")
                     + ("  + final norm/LM head" if me["has_lm_head"] else ""))
        for i in range(start, end):
            lines.append(f"    {i:3d} {plan.layer_kinds[i]}")
        if me["experts"] is not None:
            lines.append(f"  experts {me['experts'][0]}-{me['experts'][1] - 1}")
        est = r["estimate"]
        lines.append(
            f"  weights {_gib(est['weight_bytes'])}" + (f", PLE table {_gib(est['ple_table_bytes'])}" if est["ple_table_bytes"] else "")
            + f"; KV {est['kv_bytes_per_token']} B/token ({est['kv_cache_dtype']}); state {_gib(est['state_bytes_per_request'])}/request"
            + (f" (recurrent pool in {est['ssm_state_dtype']})" if est["state_bytes_per_request"] else "")
        )
        memory = r.get("gpu_memory")
        if memory is not None:
            head = f"  on a {memory['gpu_memory_gib']:g} GiB GPU: "
            if not memory["fits"]:
                lines.append(head + "does not fit: " + memory["error"])
            else:
                lowered = memory["max_num_seqs_lowered_from"]
                lines.append(head + f"max_num_seqs {memory['max_num_seqs']}"
                             + (f" (default {lowered} lowered)" if lowered else "") + f"; {memory['describe']}"
                             + (f"; to fit more, {memory['state_hint']}" if lowered and memory["state_hint"] else ""))
    return "\n".join(lines)


def run_plan(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    try:
        engine_args.validate()
        # A Hub id: its configs fetched into (or found in) the HF cache, no weights; a local folder wins.
        model_path = resolve_model_path(args.model_path, revision=engine_args.revision, load_format="dummy",
                                        download_dir=engine_args.download_dir)
        hub_id = args.model_path if model_path != args.model_path and looks_like_repo_id(args.model_path) else None
        hf_config = read_model_config(model_path, engine_args.hf_overrides)
        architecture, model_cls = resolve_model_class(hf_config)
        cfg = model_cls.parse_config(hf_config, architecture)
        spec = SpeculativeConfig.parse(engine_args.speculative_config)
        headers = _headers(model_path, engine_args, hub_id)  # read once: the FP8 experts' check and the drafter's
        drafter = None
        if spec is not None:  # refuse what `generate` would refuse, from config and headers alone
            hub_names = [n for h in headers for n in h.tensors] if hub_id else None
            prefix = check_speculative(  # a Hub id's headers unread: its MTP tensors taken as the config says
                spec, hf_config, model_cls, Path(model_path),
                "dummy" if hub_id and not headers else engine_args.load_format, tensor_names=hub_names)
            drafter = {"hf_config": hf_config, "mtp_prefix": prefix, "headers": headers}
        device_type = "cpu" if engine_args.device == "cpu" else ("cuda" if engine_args.device.startswith("cuda") or torch.cuda.is_available() else "cpu")
        plan = build_plan(cfg, engine_args.parallel_config(), num_devices=None, device_type=device_type)
        dtype = resolve_dtype(engine_args.dtype, torch.device("cuda" if device_type == "cuda" else "cpu"), getattr(hf_config, "dtype", None))
        if engine_args.dtype == "auto":
            dtype = resolve_dtype("auto", torch.device("cuda"), getattr(hf_config, "dtype", None))
        ssm_state_dtype = resolve_ssm_state_dtype(engine_args.mamba_ssm_cache_dtype, hf_config,
                                                  engine_args.mamba_cache_dtype)
        kv_cache_dtype = resolve_kv_cache_dtype(engine_args.kv_cache_dtype, dtype)
        quantization = resolve_quantization(engine_args.quantization, read_quantization(hf_config),
                                            engine_args.load_format)
        quantization = online_blocks(quantization, expert_intermediate_per_rank(cfg, plan))  # quantized at load
        # every expert tensor is FP8 (dummy weights, quantized at load, or no shards to read: as the config says)
        fp8_experts = quantization is None or quantization.online or not unquantized_expert_tensors(headers)
        cache: dict = {}
        ranks = []
        gib = getattr(args, "gpu_memory_gib", None)
        if gib is not None and gib <= 0:
            raise ValueError(f"--gpu-memory-gib must be positive, got {gib}")
        max_model_len = resolve_max_model_len(engine_args, cfg) if gib is not None else None
        # the weights a CUDA engine holds (FP8 experts stay FP8 on its kernel set): on a CUDA device,
        # or when previewing a GPU (--gpu-memory-gib) from a machine without one, unless --device cpu
        # (building the Triton set's layers, even on the meta device, imports triton)
        on_gpu = device_type == "cuda" or (gib is not None and engine_args.device != "cpu"
                                           and importlib.util.find_spec("triton") is not None)
        for me in plan.ranks:
            key = (me.pp, me.tp, me.experts)
            if key not in cache:
                est = estimate_rank(model_cls, cfg, plan, me.rank, dtype, engine_args.block_size, ssm_state_dtype,
                                    quantization, "triton" if on_gpu else "reference", fp8_experts, drafter, kv_cache_dtype)
                memory = None if gib is None else gpu_memory_preview(
                    est, cfg, engine_args, gib, max_model_len, dtype, spec.num_speculative_tokens if spec else 0,
                    ssm_state_dtype, kv_cache_dtype)
                cache[key] = (est, memory)
            est, memory = cache[key]
            ranks.append({"coords": me.__dict__ | {}, "estimate": est}
                         | ({} if memory is None else {"gpu_memory": memory}))
    except (ParallelConfigError, ValueError, OSError) as e:
        print(f"lamina plan: error: {e}", file=sys.stderr)
        return 2
    boundary = _boundary(model_cls, cfg, plan)
    tightest = _tightest_rank(ranks)
    if args.json:
        print(json.dumps({
            "architecture": architecture, "world_size": plan.world_size, "tp": plan.tp, "pp": plan.pp, "dp": plan.dp,
            "ep_enabled": plan.ep_enabled, "ep_size": plan.ep_size, "sp": plan.sp, "sp_reason": plan.sp_reason,
            "stage_sizes": list(plan.stage_sizes), "stage_ranges": [list(r) for r in plan.stage_ranges],
            "partition_source": plan.partition_source, "layer_kinds": list(plan.layer_kinds),
            "boundary": boundary, "dtype": str(dtype).replace("torch.", ""), "ranks": ranks,
            **({} if tightest is None else {"gpu_memory": tightest}),
        }, default=list))
    else:
        print(render(plan, ranks, boundary, device_type))
        if tightest is not None and len(ranks) > 1:
            print(f"the engine plans one layout for every rank, the tightest's: max_num_seqs "
                  f"{tightest['max_num_seqs']}, max_model_len {tightest['max_model_len']}, "
                  f"KV cache {tightest['kv_cache_tokens']} tokens")
    return 0


def _tightest_rank(ranks: list[dict]) -> dict | None:
    """What one engine over all `ranks` gets from `--gpu-memory-gib` (it plans from the least free memory
    and the largest per-request figures, so the tightest rank decides): the smallest max_num_seqs and
    max_model_len and KV cache of the ranks' previews; None without a preview or when a rank does not fit."""
    previews = [r.get("gpu_memory") for r in ranks]
    if not previews or any(p is None or not p["fits"] for p in previews):
        return None
    return {name: min(p[name] for p in previews) for name in ("max_num_seqs", "max_model_len", "kv_cache_tokens")}

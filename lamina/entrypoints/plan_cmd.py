"""`lamina plan MODEL [flags] [--json]`: print the ParallelPlan of a model and layout, per rank.

Reads config.json only; per-rank memory is estimated by building each rank's stage on the meta
device (no memory, no weights), so the figures are what the loader would allocate.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pathlib import Path

from lamina.config import EngineArgs, resolve_dtype
from lamina.engine.spec_decode import SpeculativeConfig, check_speculative
from lamina.models.registry import resolve_model_class
from lamina.parallel.context import GroupCollectives, ParallelContext
from lamina.parallel.plan import ParallelConfigError, ParallelPlan, build_plan
from lamina.worker.model_loader import read_model_config


def _is_ple_table(name: str) -> bool:
    return "ngram_embedding" in name or "ple_table" in name


def estimate_rank(model_cls, cfg, plan: ParallelPlan, rank: int, dtype: torch.dtype, block_size: int) -> dict:
    """Weight bytes (PLE tables apart), KV bytes per token and recurrent-state bytes per request."""
    me = plan.ranks[rank]
    ctx = ParallelContext(
        tp=GroupCollectives(plan.tp, me.tp), device=torch.device("meta"),
        dp=GroupCollectives(plan.dp, me.dp), ep=GroupCollectives(plan.ep_size, me.ep or 0),
        ep_enabled=plan.ep_enabled, expert_range=me.experts, sp=plan.sp,
    )
    model = model_cls(cfg, ctx, dtype=dtype, device="meta", layer_range=me.layer_range, options={"ple_table_device": "gpu"})
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
    kv_per_block = sum(m.paged_cache_bytes_per_block(block_size, dtype) for m in model.paged_cache_modules())
    state = sum(m.bind_state(1, dtype, "meta") for m in model.state_modules())
    return {"weight_bytes": weights, "ple_table_bytes": ple, "kv_bytes_per_token": kv_per_block // block_size,
            "state_bytes_per_request": state}


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
            + f"; KV {est['kv_bytes_per_token']} B/token; state {_gib(est['state_bytes_per_request'])}/request"
        )
    return "\n".join(lines)


def run_plan(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    try:
        engine_args.validate()
        hf_config = read_model_config(args.model_path)
        architecture, model_cls = resolve_model_class(hf_config)
        cfg = model_cls.parse_config(hf_config, architecture)
        spec = SpeculativeConfig.parse(engine_args.speculative_config)
        if spec is not None:  # refuse what `generate` would refuse, from config and headers alone
            check_speculative(spec, hf_config, model_cls, Path(args.model_path), engine_args.load_format)
        device_type = "cpu" if engine_args.device == "cpu" else ("cuda" if engine_args.device.startswith("cuda") or torch.cuda.is_available() else "cpu")
        plan = build_plan(cfg, engine_args.parallel_config(), num_devices=None, device_type=device_type)
        dtype = resolve_dtype(engine_args.dtype, torch.device("cuda" if device_type == "cuda" else "cpu"), getattr(hf_config, "dtype", None))
        if engine_args.dtype == "auto":
            dtype = resolve_dtype("auto", torch.device("cuda"), getattr(hf_config, "dtype", None))
        cache: dict = {}
        ranks = []
        for me in plan.ranks:
            key = (me.pp, me.tp, me.experts)
            if key not in cache:
                cache[key] = estimate_rank(model_cls, cfg, plan, me.rank, dtype, engine_args.block_size)
            ranks.append({"coords": me.__dict__ | {}, "estimate": cache[key]})
    except (ParallelConfigError, ValueError, OSError) as e:
        print(f"lamina plan: error: {e}", file=sys.stderr)
        return 2
    boundary = _boundary(model_cls, cfg, plan)
    if args.json:
        print(json.dumps({
            "architecture": architecture, "world_size": plan.world_size, "tp": plan.tp, "pp": plan.pp, "dp": plan.dp,
            "ep_enabled": plan.ep_enabled, "ep_size": plan.ep_size, "sp": plan.sp, "sp_reason": plan.sp_reason,
            "stage_sizes": list(plan.stage_sizes), "stage_ranges": [list(r) for r in plan.stage_ranges],
            "partition_source": plan.partition_source, "layer_kinds": list(plan.layer_kinds),
            "boundary": boundary, "dtype": str(dtype).replace("torch.", ""), "ranks": ranks,
        }, default=list))
    else:
        print(render(plan, ranks, boundary, device_type))
    return 0

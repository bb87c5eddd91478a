"""Warps per program of the small one-token decode kernels, timed at batch 1 on one GPU.

Between the decode GEMVs a batch-1 step runs ~250 small kernels (routing, residual add + RMSNorm,
conv, delta rule, gated norm, q/k prep, paged attention) of a few microseconds each, most of it
latency: loads, a chain of reductions, stores. A reduction over several warps goes through shared
memory and a barrier; over one warp it stays in shuffles. This times each kernel with 1, 2, 4 and
8 warps at the Qwen3.5-35B-A3B shapes (bf16), as CUDA graphs of LAYERS calls with programmatic
dependent launch as the engine runs them (the delta rule reads a distinct state per call, as the
layers do), in microseconds per call. The defaults are module constants (ROUTE_WARPS, NORM_WARPS,
GATED_NORM_WARPS, CONV_WARPS, GDR_WARPS, QK_PREP_WARPS, ATTENTION_WARPS): never a function of the
batch, so a row's reductions run in one order whatever the batch. The MoE router is timed both ways,
its split-K GEMV (warps of the GEMV) then the routing kernel, and the GEMV with the routing as its
epilogue (`gemv_route`).

    python benchmarks/tune_decode_warps.py --out tune_decode_warps.json    # ~20 s
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels import triton_decode, triton_gemv, triton_moe, triton_norm, triton_qk_prep  # noqa: E402
from graph_timing import time_graph  # noqa: E402 (this folder, on the path as the script's own)

LAYERS = 40
WARPS = (1, 2, 4, 8)
STATEFUL = {"conv", "delta_rule"}  # they update their pools per call: outputs of two calls are not comparable


def cases(dev, dtype):
    """name -> (fn(layer, num_warps), default warps constant)."""
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt)

    hidden, hk, hv, dk, dv, conv_k = 2048, 16, 32, 128, 128, 4
    heads, kv_heads, head_dim, rot, page, seq_len = 16, 2, 256, 64, 16, 192
    one = torch.zeros(1, dtype=torch.int64, device=dev)
    keep = torch.ones(1, dtype=torch.bool, device=dev)
    logits = rand(1, 264)  # [T, E + shared gate + padding]
    x, residual, norm_w = rand(1, hidden), rand(1, hidden), rand(hidden)
    core, z, gated_w = rand(1, hv, dv), rand(1, hv * dv), rand(dv)
    conv_dim = 2 * hk * dk + hv * dv
    conv_x, conv_w = rand(1, conv_dim), rand(conv_dim, conv_k)
    conv_pools = [rand(2, conv_dim, conv_k - 1) for _ in range(LAYERS)]
    q, k, v = rand(1, hk, dk), rand(1, hk, dk), rand(1, hv, dv)
    a, b, a_log, dt_bias = rand(1, hv), rand(1, hv), rand(hv, scale=0.1), rand(hv, scale=0.1)
    ssm_pools = [rand(2, hv, dk, dv, scale=0.1, dt=torch.float32) for _ in range(LAYERS)]  # distinct, as layers
    qkv = rand(1, heads * 2 * head_dim + 2 * kv_heads * head_dim)  # the attention's joint GEMV output
    query_gate, key, value = qkv.split([heads * 2 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    query = query_gate.view(1, heads, 2 * head_dim)[..., :head_dim]  # [T, H, D], each head's query before its gate
    key, value = key.view(1, kv_heads, head_dim), value.view(1, kv_heads, head_dim)
    q_w, k_w = rand(head_dim), rand(head_dim)
    cos, sin = rand(1, rot, dt=torch.float32), rand(1, rot, dt=torch.float32)
    pages = (seq_len + page - 1) // page
    k_cache, v_cache = rand(pages + 1, page, kv_heads, head_dim), rand(pages + 1, page, kv_heads, head_dim)
    slot_mapping = torch.tensor([seq_len - 1], device=dev)
    block_tables = torch.arange(pages, device=dev, dtype=torch.int32)[None]  # [1, pages]
    seq_lens = torch.tensor([seq_len], device=dev, dtype=torch.int32)
    attn_q, attn_gate = rand(1, heads, head_dim), rand(1, heads, head_dim)
    router_rows = [rand(264, hidden, scale=0.02) for _ in range(LAYERS)]  # experts, the shared gate, padding
    small = triton_gemv.gemv_config(264, hidden)

    def router_two_launches(layer, warps):
        logits = triton_gemv.gemv(x, router_rows[layer], dict(small, warps=warps))
        return triton_moe.route_softmax_topk(logits[:, :256], 8, True, dtype)

    def router_one_launch(layer, warps):
        return triton_gemv.gemv_route(x, router_rows[layer], 256, 8, True, dict(small, warps=warps))[1:]

    return {
        "router_gemv_then_route": (router_two_launches, small["warps"]),
        "router_gemv_route_epilogue": (router_one_launch, small["warps"]),
        "route": (lambda layer, w: triton_moe.route_softmax_topk(logits[:, :256], 8, True, dtype, num_warps=w),
                  triton_moe.ROUTE_WARPS),
        "add_rms_norm": (lambda layer, w: triton_norm.add_rms_norm(x, residual, norm_w, 1e-6, True, num_warps=w),
                         triton_norm.NORM_WARPS),
        "gated_rms_norm": (lambda layer, w: triton_norm.gated_rms_norm(core, z.view(1, hv, dv), gated_w, 1e-6, "silu",
                                                                       num_warps=w), triton_norm.GATED_NORM_WARPS),
        "conv": (lambda layer, w: triton_decode.causal_conv1d_decode(conv_x, conv_w, conv_pools[layer], one, keep,
                                                                      num_warps=w), triton_decode.CONV_WARPS),
        "delta_rule": (lambda layer, w: triton_decode.gated_delta_rule_decode(
            q, k, v, a, b, ssm_pools[layer], one, keep, a_log=a_log, dt_bias=dt_bias, num_warps=w),
            triton_decode.GDR_WARPS),
        "qk_prep": (lambda layer, w: triton_qk_prep.qk_norm_rope_cache(
            query, key, value, q_w, k_w, 1e-6, True, cos, sin, slot_mapping, k_cache, v_cache, num_warps=w),
            triton_qk_prep.QK_PREP_WARPS),
        "paged_attention": (lambda layer, w: triton_decode.paged_decode_attention(
            attn_q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5, gate=attn_gate, num_warps=w),
            triton_decode.ATTENTION_WARPS),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="comma-separated kernel names")
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    results = [{"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers_per_graph": LAYERS}]
    for name, (fn, default) in cases(dev, dtype).items():
        if args.only and name not in args.only.split(","):
            continue
        rec = {"kernel": name, "default_warps": default}
        reference = fn(0, default)
        for warps in WARPS:
            try:
                rec[f"us_warps_{warps}"] = time_graph(lambda layer, w=warps: fn(layer, w), LAYERS)
                if name in STATEFUL:
                    continue
                out = fn(0, warps)
                pairs = zip(out, reference) if isinstance(out, tuple) else [(out, reference)]
                rec[f"max_diff_warps_{warps}"] = max(float((o.float() - r.float()).abs().max()) for o, r in pairs)
            except Exception as error:  # a tile that does not compile at this warp count
                rec[f"us_warps_{warps}"] = None
                rec[f"error_warps_{warps}"] = str(error)[:200]
        timed = {w: rec[f"us_warps_{w}"] for w in WARPS if rec[f"us_warps_{w}"] is not None}
        rec["best_warps"] = min(timed, key=timed.get)
        results.append(rec)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items() if "error" not in k}),
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

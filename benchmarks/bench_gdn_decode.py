"""The gated delta net's one-token decode on one GPU, from the in_proj output to out_proj's input:
the fused kernel (`lamina.kernels.triton_gdn_decode.fused_gdn_decode`, one launch) against the three
launches it replaces (`causal_conv1d_decode` + `gated_delta_rule_decode` + `gated_rms_norm`, the
path under LAMINA_FUSED_GDN_DECODE=0, the z copy of `gated_rms_norm` included).

Default shape: Qwen3.5-35B-A3B (Hk 16, Hv 32, Dk = Dv = 128, conv kernel 4), bf16 activations, a
float32 recurrent state. Each timed replay is a CUDA graph of LAYERS calls, each on its own layer's
weights and state pools (as in a decode step: the states do not stay in L2), timed with CUDA events
and reported in microseconds per call (per layer). With --sweep, the fused kernel at num_warps 4,
8 and 16 too. Each record also gives the largest output difference between the two paths.

    python benchmarks/bench_gdn_decode.py --out bench_gdn_decode.json            # well under a minute
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.triton_decode import causal_conv1d_decode, gated_delta_rule_decode  # noqa: E402
from lamina.kernels.triton_gdn_decode import fused_gdn_decode  # noqa: E402
from lamina.kernels.triton_norm import gated_rms_norm  # noqa: E402
from graph_timing import time_graph  # noqa: E402 (this folder, on the path as the script's own)

LAYERS = 30
EPS = 1e-6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--conv", type=int, default=4)
    ap.add_argument("--sweep", action="store_true", help="also time the fused kernel at num_warps 4, 8, 16")
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    hk, hv, d, kernel = args.k_heads, args.v_heads, args.head_dim, args.conv
    key_dim, value_dim = hk * d, hv * d
    conv_dim = 2 * key_dim + value_dim
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [dict(
        conv_weight=(torch.randn(conv_dim, kernel, device=dev, generator=gen) * 0.5).to(dtype),
        a_log=torch.rand(hv, device=dev, generator=gen).to(dtype),
        dt_bias=torch.rand(hv, device=dev, generator=gen).to(dtype),
        norm_weight=(1 + 0.1 * torch.randn(d, device=dev, generator=gen)).to(dtype),
    ) for _ in range(LAYERS)]
    results = [{"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "k_heads": hk, "v_heads": hv,
                "head_dim": d, "conv": kernel, "layers_per_graph": LAYERS}]
    print(json.dumps(results[0]))
    for bsz in (int(b) for b in args.batch.split(",")):
        slots = torch.arange(bsz, device=dev)
        keep = torch.ones(bsz, dtype=torch.bool, device=dev)
        projected = [torch.randn(bsz, conv_dim + value_dim + 2 * hv, device=dev, generator=gen).to(dtype)
                     for _ in range(LAYERS)]
        pools = [(torch.randn(bsz + 1, conv_dim, kernel - 1, device=dev, generator=gen).to(dtype),
                  torch.randn(bsz + 1, hv, d, d, device=dev, generator=gen) * 0.1) for _ in range(LAYERS)]

        def inputs(layer):
            return projected[layer].split([conv_dim, value_dim, hv, hv], dim=-1)

        def three(layer):
            x, z, b, a = inputs(layer)
            w, (conv_state, ssm_state) = weights[layer], pools[layer]
            y = causal_conv1d_decode(x, w["conv_weight"], conv_state, slots, keep)
            q, k, v = y.split([key_dim, key_dim, value_dim], dim=-1)
            core = gated_delta_rule_decode(q.reshape(bsz, hk, d), k.reshape(bsz, hk, d), v.reshape(bsz, hv, d), a, b,
                                           ssm_state, slots, keep, a_log=w["a_log"], dt_bias=w["dt_bias"])
            return gated_rms_norm(core, z.reshape(bsz, hv, d), w["norm_weight"], EPS, "silu").reshape(bsz, value_dim)

        def fused(layer, num_warps=None):
            x, z, b, a = inputs(layer)
            w, (conv_state, ssm_state) = weights[layer], pools[layer]
            return fused_gdn_decode(x, z, b, a, w["conv_weight"], conv_state, ssm_state, slots, keep, w["a_log"],
                                    w["dt_bias"], w["norm_weight"], num_k_heads=hk, head_k_dim=d, norm_eps=EPS,
                                    num_warps=num_warps)

        saved = [(c.clone(), s.clone()) for c, s in pools]
        ref = [three(layer) for layer in range(LAYERS)]
        ref_pools = [(c.clone(), s.clone()) for c, s in pools]
        for (c, s), (c0, s0) in zip(pools, saved):
            c.copy_(c0)
            s.copy_(s0)
        ours = [fused(layer) for layer in range(LAYERS)]
        record = {
            "batch": bsz,
            "max_out_diff": max((o.float() - r.float()).abs().max().item() for o, r in zip(ours, ref)),
            "out_equal_fraction": sum((o == r).float().mean().item() for o, r in zip(ours, ref)) / LAYERS,
            "max_ssm_state_diff": max((p[1] - r[1]).abs().max().item() for p, r in zip(pools, ref_pools)),
            "conv_state_equal": all(torch.equal(p[0], r[0]) for p, r in zip(pools, ref_pools)),
            "three_kernels_us": time_graph(three, LAYERS),
            "fused_us": time_graph(fused, LAYERS),
        }
        record["speedup"] = record["three_kernels_us"] / record["fused_us"]
        if args.sweep:
            for warps in (4, 8, 16):
                record[f"fused_warps{warps}_us"] = time_graph(lambda layer, w=warps: fused(layer, w), LAYERS)
        state_bytes = 2 * bsz * hv * d * d * 4  # the recurrent state read and written
        record["fused_state_tb_per_s"] = state_bytes / (record["fused_us"] * 1e-6) / 1e12
        print(json.dumps(record))
        results.append(record)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""The delta net's memory-bound prefill kernels at the Qwen3.5-35B-A3B shape on one GPU, at 8k tokens:
the gated RMSNorm (rows per program swept; 1 row with a contiguous copy of z is the kernel before
session 8) and the causal conv1d prefill (token x channel tiles and warps of its body kernel swept;
session 9's run also timed session 8's one-kernel layout, since removed), each against the bytes it
must move at the copy bandwidth measured in the same run.

    python benchmarks/bench_prefill_kernels.py [--tokens 8192] --out bench_prefill_kernels.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from bench_prefill_attention import time_ms as _time_ms  # a sibling script
from lamina.kernels import triton_conv, triton_norm


def time_ms(fn) -> float:
    return _time_ms(fn, reps=20)  # the repeats bench_prefill_kernels_h200.json was measured with


def copy_gb_s() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def gated_norm_rows(tokens: int, heads: int, dim: int, bandwidth: float) -> list[dict]:
    projected = torch.randn(tokens, 2 * heads * dim, device="cuda", dtype=torch.bfloat16)  # [T, 2*H*D]
    z = projected[:, heads * dim:].view(tokens, heads, dim)  # [T, H, D]: strided, as the delta net's
    x = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)  # [T, H, D]
    w = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens * heads, dim, device="cuda", dtype=torch.bfloat16)  # [T*H, D]
    rows = tokens * heads
    ideal_ms = 3 * x.numel() * 2 / bandwidth / 1e6

    def launch(xs, gs, block_r, heads_, sxt, sxh, sgt, sgh):
        triton_norm._gated_rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            xs, gs, w, out, rows, heads_, dim, 1e-6, sxt, sxh, sgt, sgh, out.stride(0),
            SILU=True, BLOCK_R=block_r, BLOCK_D=dim, PDL=False)

    records = []
    x2 = x.view(rows, dim)

    def before():  # one row per program after a contiguous copy of z (the kernel before session 8)
        zc = z.reshape(rows, dim)  # copies: z is strided
        launch(x2, zc, 1, 1, dim, 0, dim, 0)

    ms = time_ms(before)
    records.append({"kernel": "gated_rms_norm", "variant": "copy z + 1 row/program (before)", "ms": ms,
                    "ideal_ms": ideal_ms})
    for block_r in (1, 2, 4, 8, 16, 32, 64):
        ms = time_ms(lambda: launch(x, z, block_r, heads, x.stride(0), x.stride(1), z.stride(0), z.stride(1)))
        records.append({"kernel": "gated_rms_norm", "variant": f"strided z, {block_r} rows/program", "ms": ms,
                        "ideal_ms": ideal_ms, "block_r": block_r})
    ref = triton_norm.gated_rms_norm(x, z, w, 1e-6, "silu")
    before()
    records.append({"kernel": "gated_rms_norm", "check": "max |default - before|",
                    "value": (ref.view(rows, dim).float() - out.float()).abs().max().item()})
    return records


def conv_tiles(tokens: int, channels: int, kernel: int, bandwidth: float) -> list[dict]:
    """The delta net's conv prefill call (`causal_conv1d_prefill` with the q / k / v split, rows
    strided as in_proj's joint output, 8 requests' worth of state) over the body kernel's token x
    channel tiles and warps."""
    x = torch.randn(tokens, channels + 4160, device="cuda", dtype=torch.bfloat16)[:, :channels]  # strided rows
    weight = torch.randn(channels, kernel, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(16, channels, kernel - 1, device="cuda", dtype=torch.bfloat16)
    requests = 8
    slots = torch.arange(1, requests + 1, device="cuda")
    keep = torch.tensor([True, False] * (requests // 2), device="cuda")
    bounds = [tokens * i // requests for i in range(requests + 1)]
    qsl = torch.tensor(bounds, device="cuda", dtype=torch.int32)
    req = torch.repeat_interleave(torch.arange(requests, device="cuda", dtype=torch.int32),
                                  torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], device="cuda"))
    split = (channels // 4, channels // 4, channels // 2)
    ideal_ms = 2 * tokens * channels * 2 / bandwidth / 1e6
    records = []
    default_tile = (*triton_conv.CONV_PREFILL_TILE, triton_conv.CONV_PREFILL_WARPS)
    for block_t in (16, 32, 64, 128):
        for block_c in (64, 128, 256):
            for warps in (4, 8):
                tile = (block_t, block_c, warps)

                def launch():
                    return triton_conv.causal_conv1d_prefill(x, weight, pool, slots, keep, qsl, req, split=split,
                                                             tile=tile)
                try:
                    ms = time_ms(launch)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                    records.append({"kernel": "conv_prefill", "block_t": block_t, "block_c": block_c, "warps": warps,
                                    "error": str(e)[:200]})
                    continue
                records.append({"kernel": "conv_prefill", "block_t": block_t, "block_c": block_c, "warps": warps,
                                "ms": ms, "ideal_ms": ideal_ms, "default": tile == default_tile})
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bandwidth = copy_gb_s()
    records = [{"copy_bandwidth_gb_s": bandwidth, "tokens": args.tokens, "gpu": torch.cuda.get_device_name()}]
    records += gated_norm_rows(args.tokens, 32, 128, bandwidth)
    records += conv_tiles(args.tokens, 8192, 4, bandwidth)
    for r in records:
        if "ms" in r:
            print(f"{r['kernel']:18s} {r.get('variant')} {(r.get('block_t'), r.get('block_c'), r.get('warps'))}: {r['ms'] * 1e3:8.1f} us"
                  f"  ({r['ideal_ms'] / r['ms']:.0%} of the copy rate)" + ("  <- default" if r.get("default") else ""))
        else:
            print(r)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()

"""The fused MoE on prefill chunks at the Qwen3.5-35B-A3B shape (256 experts of 512 x 2048, top-8,
the shared expert fused), one GPU: where a call's time goes, kernel by kernel, and a small sweep of
launch orders and tiles against today's defaults, all in one run, with cuBLAS on the same FLOPs as
a ceiling.

    python benchmarks/bench_moe_prefill.py [--tokens 256,1024,2048,8192] [--quick] --out bench_moe_prefill.json

`--quick`: today's tiles in both launch orders and the down-K 128 variants only (fewer compiles:
for timing two trees of lamina with this same script).

Per token count: `default` (today's tiles), its kernels under the torch profiler (alignment,
gate/up, down, slot sum), each config's time (`triton.testing.do_bench`, ms) and TFLOP/s, and the
time of one dense bf16 matmul pair with the call's FLOPs (`[P, 2048] @ [2048, 1024]` then
`[P, 512] @ [512, 2048]`, P = routed + shared rows), and of the same MoE on `torch._grouped_mm`
(CUTLASS's grouped GEMM on sm90) two ways where torch has it: lamina's torch reference path
(`grouped_experts` plus the shared expert) and `grouped_mm_moe` (`LAMINA_MOE_PREFILL=grouped_mm`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.moe import grouped_experts  # noqa: E402
from lamina.kernels.grouped_mm_moe import grouped_mm_moe  # noqa: E402
from lamina.kernels.triton_moe import DEFAULT_CONFIG_LARGE, default_config, fused_moe  # noqa: E402


def variants(default: dict, quick: bool = False) -> list[tuple[str, dict]]:
    """Today's tiles as they are and in the other launch order (`_rowfirst` / `_nfirst`), then a few
    larger / differently split tiles, column tiles first (session 27 measured row blocks first
    slower for every tile at 2k and 8k tokens, bench_moe_prefill_h100_s27.json)."""
    out = [("default", dict(default))]
    other = not default.get("n_fastest", False)
    out.append(("default_" + ("nfirst" if other else "rowfirst"), dict(default, n_fastest=other)))
    tiles = {
        "m128_n128_k64_w8_s3": dict(block_m=128, up_n=128, up_k=64, down_n=128, down_k=64, warps=8, stages=3),
        "m64_n128_k64_w4_s4": dict(block_m=64, up_n=128, up_k=64, down_n=128, down_k=64, warps=4, stages=4),
        "m64_n64_k64_w4_s4": dict(block_m=64, up_n=64, up_k=64, down_n=64, down_k=64, warps=4, stages=4),
        "m128_up128_down256_w8": dict(block_m=128, up_n=128, up_k=64, down_n=256, down_k=64, warps=8, stages=3),
        # the down GEMM's K is only 512: longer K steps, fewer loop trips
        "m128_n128_up_k64_down_k128_w8_s3": dict(block_m=128, up_n=128, up_k=64, down_n=128, down_k=128, warps=8, stages=3),
        "m128_n128_down_k128_s2": dict(block_m=128, up_n=128, up_k=64, down_n=128, down_k=128, warps=8, stages=3,
                                       down_stages=2),
        "m64_n128_down_k128_w4_s4": dict(block_m=64, up_n=128, up_k=64, down_n=128, down_k=128, warps=4, stages=4,
                                         down_stages=3),
        "m128_n128_k64_w8_s3_down_w4s4": dict(block_m=128, up_n=128, up_k=64, down_n=128, down_k=64, warps=8,
                                              stages=3, down_warps=4, down_stages=4),
        # decode-sized row blocks (batch 65-512 decode steps take the prefill tiles today)
        "decode_large_m16": dict(DEFAULT_CONFIG_LARGE),
        "m32_n64_k128_w4_s3": dict(block_m=32, up_n=64, up_k=128, down_n=64, down_k=128, warps=4, stages=3),
    }
    out += [(name + "_nfirst", dict(cfg, n_fastest=True)) for name, cfg in tiles.items()
            if not quick or "down_k128" in name]
    return out


def torch_path_moe(x, w13, w2, weights, ids, shared):
    """The same MoE as lamina's torch path runs it: `grouped_experts` (pairs sorted by expert,
    `torch._grouped_mm`, CUTLASS's grouped GEMM on sm90, bf16 out, the slot sum in float32) plus the
    shared expert as dense matmuls. Timed against the Triton kernels, not bitwise equal to them."""
    sw13, sw2, logit = shared
    g, u = (x @ sw13.t()).chunk(2, dim=-1)
    shared_out = (torch.nn.functional.silu(g) * u) @ sw2.t()  # [T, H]
    return grouped_experts(x, w13, w2, weights, ids) + torch.sigmoid(logit.to(x.dtype))[:, None] * shared_out


def kernel_breakdown(call, reps: int = 5) -> dict:
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.device_time / reps
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,2048,8192")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="today's tiles and the down-K 128 variants only")
    args = ap.parse_args()
    hidden, inter, experts, top_k = 2048, 512, 256, 8
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    sw13 = torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    sw2 = torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    results = {"gpu": torch.cuda.get_device_name(), "command": "python benchmarks/bench_moe_prefill.py " + " ".join(sys.argv[1:]),
               "sizes": []}
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(tokens, experts + 1, device=dev, generator=gen)
        weights, ids = torch.softmax(logits[:, :experts], -1).topk(top_k, dim=-1)
        weights = weights.to(torch.bfloat16)
        shared = (sw13, sw2, logits[:, experts])
        rows = tokens * (top_k + 1)
        flops = rows * 6 * hidden * inter
        default = dict(default_config(tokens * top_k, torch.bfloat16))
        reference = fused_moe(x, w13, w2, weights, ids, shared=shared, config=default)
        a = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(hidden, 2 * inter, device=dev, dtype=torch.bfloat16, generator=gen)
        c = torch.randn(rows, inter, device=dev, dtype=torch.bfloat16, generator=gen)
        d = torch.randn(inter, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        dense_ms = triton.testing.do_bench(lambda: (a @ b, c @ d))
        record = {"tokens": tokens, "rows": rows, "gflop": flops / 1e9, "default": default,
                  "dense_cublas_ms": dense_ms, "dense_cublas_tflop_s": flops / dense_ms / 1e9,
                  "default_kernels_us": kernel_breakdown(
                      lambda: fused_moe(x, w13, w2, weights, ids, shared=shared, config=default)),
                  "configs": []}
        for name, cfg in variants(default, args.quick):
            try:
                call = lambda: fused_moe(x, w13, w2, weights, ids, shared=shared, config=cfg)  # noqa: E731
                same = bool(torch.equal(call(), reference)) if name.startswith("default") else None  # same tiles: bitwise
                ms = triton.testing.do_bench(call)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
                record["configs"].append({"name": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            record["configs"].append({"name": name, "config": cfg, "ms": ms, "tflop_s": flops / ms / 1e9,
                                      "bitwise_equal_to_default": same})
        for name, call in (
            ("torch_grouped_experts", lambda: torch_path_moe(x, w13, w2, weights, ids, shared)),
            ("grouped_mm_moe", lambda: grouped_mm_moe(x, w13, w2, weights, ids, 0, shared)),
        ):
            try:
                diff = (call().float() - reference.float()).abs().max().item()
                ms = triton.testing.do_bench(call)
                record["configs"].append({"name": name, "ms": ms, "tflop_s": flops / ms / 1e9,
                                          "bitwise_equal_to_default": None, "max_abs_diff_to_default": diff})
                record[name + "_kernels_us"] = kernel_breakdown(call)
            except Exception as e:  # noqa: BLE001
                record["configs"].append({"name": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
        ok = [c for c in record["configs"] if "ms" in c]
        best = min(ok, key=lambda c: c["ms"])
        record["best"] = best["name"]
        print(f"tokens {tokens}: cuBLAS {dense_ms:.3f} ms ({record['dense_cublas_tflop_s']:.0f} TFLOP/s); "
              f"kernels us {json.dumps({k[:24]: round(v, 1) for k, v in list(record['default_kernels_us'].items())[:6]})}")
        for c in sorted(ok, key=lambda c: c["ms"]):
            print(f"  {c['name']:40s} {c['ms']:.3f} ms {c['tflop_s']:6.1f} TFLOP/s"
                  + ("" if c["bitwise_equal_to_default"] is None else f" equal={c['bitwise_equal_to_default']}")
                  + (f" max diff {c['max_abs_diff_to_default']:.2e}" if "max_abs_diff_to_default" in c else ""))
        for name in ("torch_grouped_experts", "grouped_mm_moe"):
            if name + "_kernels_us" in record:
                print(f"  {name} kernels us", json.dumps({k[:28]: round(v, 1) for k, v in list(record[name + "_kernels_us"].items())[:8]}))
        for c in record["configs"]:
            if "error" in c:
                print("  skip", c["name"], c["error"])
        results["sizes"].append(record)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

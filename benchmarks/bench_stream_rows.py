"""How fast a batch-1 GEMV streams its weights as a function of how many programs share the work
(one H200, CUDA graphs of 40 distinct weights, L2-cold), to decide whether the one-token MoE
GEMVs lose to their grid shape: the gate/up kernel runs 72 programs of 512 KB (60 of 132 SMs
idle), the down kernel 288 programs then a ticket over 9 slots.

- `rows`: a plain GEMV over a [N, K] weight whose 16-row tiles are dealt out evenly to G programs
  (each steps through its tiles' K columns in one flat, pipelined loop): the gate/up's 9 x 1024
  rows of 2048 (37.7 MB) and the down's shape as one matrix, for G around the SM count;
- `moe`: lamina's one-token fused MoE GEMV (`fused_moe_gemv`, gate/up then down) at its defaults
  and with the down kernel as one program per 16-row output tile over all 9 slots (no ticket);
- `fma`: the `rows` split without tl.dot (plain loads, elementwise float32 products), more shapes,
  with lamina's split-K GEMV on the dense ones; and the MoE GEMV's `fma` kernels at several tiles.

    python benchmarks/bench_stream_rows.py --out bench_stream_rows.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels import triton_gemv, triton_moe_gemv  # noqa: E402
from graph_timing import time_graph  # noqa: E402

LAYERS = 40


@triton.jit
def _rows_gemv_kernel(x_ptr, w_ptr, y_ptr, tiles, in_features, k_steps,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program p takes the BLOCK_N-row tiles [p * tiles // G, (p + 1) * tiles // G) and
    steps through them BLOCK_K columns at a time in one flat loop (so the pipeliner keeps the next
    tile's first loads in flight behind this tile's last dot)."""
    programs = tl.num_programs(0)
    pid = tl.program_id(0)
    first = pid * tiles // programs
    last = (pid + 1) * tiles // programs
    offs_m = tl.arange(0, 16)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for step in range(0, (last - first) * k_steps):
        tile = first + step // k_steps
        k = (step % k_steps) * BLOCK_K + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * 0 + k[None, :], mask=(offs_m[:, None] == 0) & (k[None, :] >= 0), other=0.0)  # [16, K]
        w = tl.load(w_ptr + (tile * BLOCK_N + offs_n)[None, :].to(tl.int64) * in_features + k[:, None])  # [K, N]
        acc += tl.dot(x, w)
        not_done = ((step % k_steps) != k_steps - 1).to(tl.int32)
        store_rows = (offs_m[:, None] + not_done * 16 + offs_n[None, :] * 0) == 0  # [16, N]: row 0 of a finished tile
        tl.store(y_ptr + tile * BLOCK_N + offs_n[None, :] + offs_m[:, None] * 0, acc, mask=store_rows)
        acc = acc * not_done.to(tl.float32)  # zeroed after a finished tile


@triton.jit
def _rows_fma_kernel(x_ptr, w_ptr, y_ptr, tiles, in_features, k_steps,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The same work split without tl.dot: plain [BLOCK_N, BLOCK_K] weight loads (K contiguous),
    multiplied by x and accumulated elementwise in float32, each tile's rows summed once at its end."""
    programs = tl.num_programs(0)
    pid = tl.program_id(0)
    first = pid * tiles // programs
    last = (pid + 1) * tiles // programs
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for step in range(0, (last - first) * k_steps):
        tile = first + step // k_steps
        k = (step % k_steps) * BLOCK_K + offs_k
        x = tl.load(x_ptr + k).to(tl.float32)  # [K]
        w = tl.load(w_ptr + (tile * BLOCK_N + offs_n)[:, None].to(tl.int64) * in_features + k[None, :])  # [N, K]
        acc += w.to(tl.float32) * x[None, :]
        if (step % k_steps) == k_steps - 1:
            tl.store(y_ptr + tile * BLOCK_N + offs_n, tl.sum(acc, axis=1))
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)


def rows_fma(x, w, programs, block_n, block_k, warps, stages):
    n, k = w.shape
    y = torch.empty(n, dtype=torch.float32, device=w.device)
    _rows_fma_kernel[(programs,)](x, w, y, n // block_n, k, k // block_k, BLOCK_N=block_n, BLOCK_K=block_k,
                                  num_warps=warps, num_stages=stages)
    return y


def rows_gemv(x, w, programs, block_n, block_k, warps, stages):
    n, k = w.shape
    y = torch.empty(n, dtype=torch.float32, device=w.device)
    _rows_gemv_kernel[(programs,)](x, w, y, n // block_n, k, k // block_k, BLOCK_N=block_n, BLOCK_K=block_k,
                                   num_warps=warps, num_stages=stages)
    return y


def save(path, results) -> None:
    """Written after every section, so a run cut short keeps what it measured."""
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a few cells (a smoke run)")
    ap.add_argument("--only-fma", action="store_true", help="skip the tl.dot rows sweep and its MoE down tiles")
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"gpu": torch.cuda.get_device_name(), "sms": sms, "layers_per_graph": LAYERS, "rows": [], "moe": []}

    # copy rate in the same run (read + write of 1 GB)
    a = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    results["copy_gb_s"] = 2 * a.numel() / time_graph(lambda _: b.copy_(a), 4) / 1e3
    del a, b
    print("copy GB/s", round(results["copy_gb_s"]), flush=True)

    shapes = {"gate_up 9x1024x2048": (9 * 1024, 2048), "down as 9x2048x512": (9 * 2048, 512)}
    programs_grid = (72, sms, 2 * sms, 3 * sms, 4 * sms, 144, 288, 576)
    tiles_grid = [(16, 128, 4, 4), (16, 256, 4, 3), (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 256, 4, 3)]
    if args.quick:
        programs_grid, tiles_grid = (sms,), tiles_grid[:2]
    for name, (n, k) in ({} if args.only_fma else shapes).items():
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(LAYERS)]
        x = torch.randn(k, device=dev, dtype=dtype)
        ref = weights[0].float() @ x.float()
        nbytes = n * k * 2
        for programs, (bn, bk, warps, stages) in itertools.product(programs_grid, tiles_grid):
            if bk > k or (n // bn) < programs:
                continue
            try:
                y = rows_gemv(x, weights[0], programs, bn, bk, warps, stages)
                err = ((y - ref).norm() / ref.norm()).item()
                us = time_graph(lambda i, p=programs, c=(bn, bk, warps, stages): rows_gemv(x, weights[i], p, *c), LAYERS)
            except Exception as error:  # noqa: BLE001 - a tile that does not compile or fit
                results["rows"].append(dict(shape=name, programs=programs, block_n=bn, block_k=bk, error=str(error)[:160]))
                continue
            row = dict(shape=name, programs=programs, block_n=bn, block_k=bk, warps=warps, stages=stages,
                       us=us, gb_s=nbytes / us / 1e3, rel_err=err)
            results["rows"].append(row)
        best = sorted((r for r in results["rows"] if r["shape"] == name and "us" in r), key=lambda r: r["us"])
        print(name, json.dumps([{kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in r.items() if kk != "shape"}
                                for r in best[:6]]), flush=True)
        del weights

    # the same without tl.dot, more shapes, against lamina's split-K GEMV where it runs them
    fma_shapes = {"down as 9x2048x512": (9 * 2048, 512), "out_proj 2048x4096": (2048, 4096),
                  "gate_up 9x1024x2048": (9 * 1024, 2048), "router 264x2048": (264, 2048),
                  "in_proj 12352x2048": (12352, 2048)}
    fma_programs = (sms, 2 * sms, 4 * sms, 8 * sms, 512, 1024)
    fma_tiles = [(1, 512, 2, 1), (1, 512, 2, 3), (2, 512, 4, 1), (2, 512, 4, 3), (4, 512, 4, 2), (4, 256, 4, 3),
                 (8, 256, 4, 3), (8, 512, 8, 2), (1, 1024, 4, 2), (2, 1024, 4, 2)]
    if args.quick:
        fma_shapes, fma_programs, fma_tiles = dict(list(fma_shapes.items())[:1]), (sms,), fma_tiles[:2]
    results["fma"], results["lamina_gemv"] = [], []
    for name, (n, k) in fma_shapes.items():
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(LAYERS)]
        x = torch.randn(k, device=dev, dtype=dtype)
        ref = weights[0].float() @ x.float()
        nbytes = n * k * 2
        if not name.startswith(("down", "gate_up")):
            us = time_graph(lambda i: triton_gemv.gemv(x.view(1, k), weights[i]), LAYERS)
            results["lamina_gemv"].append(dict(shape=name, config="default", us=us, gb_s=nbytes / us / 1e3))
            for bn, warps in itertools.product((1, 2, 4, 8), (2, 4, 8)):
                cfg = dict(fma=1, block_n=bn, block_k=512, warps=warps)
                us_fma = time_graph(lambda i, c=cfg: triton_gemv.gemv(x.view(1, k), weights[i], c), LAYERS)
                results["lamina_gemv"].append(dict(shape=name, config=cfg, us=us_fma, gb_s=nbytes / us_fma / 1e3))
            fastest = min((r for r in results["lamina_gemv"] if r["shape"] == name), key=lambda r: r["us"])
            print(name, "lamina gemv", round(us, 2), "us; fastest", fastest["config"], round(fastest["us"], 2), flush=True)
        for programs, (bn, bk, warps, stages) in itertools.product(fma_programs, fma_tiles):
            if bk > k or k % bk or n % bn or (n // bn) < programs:
                continue
            try:
                y = rows_fma(x, weights[0], programs, bn, bk, warps, stages)
                err = ((y - ref).norm() / ref.norm()).item()
                us = time_graph(lambda i, p=programs, c=(bn, bk, warps, stages): rows_fma(x, weights[i], p, *c), LAYERS)
            except Exception as error:  # noqa: BLE001
                results["fma"].append(dict(shape=name, programs=programs, block_n=bn, block_k=bk, error=str(error)[:160]))
                continue
            results["fma"].append(dict(shape=name, programs=programs, block_n=bn, block_k=bk, warps=warps,
                                       stages=stages, us=us, gb_s=nbytes / us / 1e3, rel_err=err))
        best = sorted((r for r in results["fma"] if r["shape"] == name and "us" in r), key=lambda r: r["us"])
        save(args.out, results)
        print(name, "fma", json.dumps([{kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in r.items()
                                         if kk != "shape"} for r in best[:5]]), flush=True)
        del weights

    # lamina's MoE GEMV at one token, 40 layers of distinct routed experts
    hidden, inter, experts, top_k = 2048, 512, 256, 8
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dtype) * 0.02
    shared = [(torch.randn(2 * inter, hidden, device=dev, dtype=dtype) * 0.02,
               torch.randn(hidden, inter, device=dev, dtype=dtype) * 0.02) for _ in range(LAYERS)]
    x = torch.randn(1, hidden, device=dev, dtype=dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    routings = []
    for layer in range(LAYERS):
        ids = torch.randperm(experts, device=dev, generator=gen)[:top_k].view(1, top_k)
        weights = torch.softmax(torch.randn(1, top_k, device=dev, generator=gen), -1).to(dtype)
        routings.append((weights, ids, torch.randn(1, device=dev, generator=gen).to(dtype)))

    def moe(layer, cfg):
        weights, ids, logit = routings[layer]
        return triton_moe_gemv.fused_moe_gemv(x, w13, w2, weights, ids, shared=(*shared[layer], logit), config=cfg)

    ref = moe(0, None).float()
    cfgs = [None]
    downs = [(16, 128, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3), (16, 512, 4, 4), (16, 512, 2, 4), (16, 256, 2, 4),
             (32, 512, 4, 3)]
    if args.quick or args.only_fma:
        downs = downs[:1]
    for dn, dk, warps, stages in downs:
        cfgs.append(dict(triton_moe_gemv.GEMV_CONFIG_ONE_TOKEN, down_n=dn, down_k=dk, down_slots=top_k + 1,
                         down_warps=warps, down_stages=stages))
    # the kernels without tl.dot (fma configs): (up_n, up_k, up_warps, down_n, down_k, down_warps)
    fma = [(4, 512, 4, 4, 512, 4), (2, 512, 4, 4, 512, 4), (8, 512, 4, 4, 512, 4), (4, 1024, 4, 4, 512, 4),
           (4, 2048, 8, 4, 512, 4), (2, 1024, 4, 2, 512, 4), (4, 512, 4, 2, 512, 2), (4, 512, 4, 8, 512, 4),
           (4, 512, 4, 8, 256, 4), (4, 512, 4, 16, 512, 8), (8, 256, 4, 4, 256, 2), (2, 2048, 8, 2, 512, 4)]
    for un, uk, uw, dn, dk, dw in fma[:2] if args.quick else fma:
        cfgs.append(dict(triton_moe_gemv.GEMV_CONFIG_FMA, up_n=un, up_k=uk, up_warps=uw, down_n=dn, down_k=dk,
                         down_warps=dw))
    for cfg in cfgs:
        try:
            err = ((moe(0, cfg).float() - ref).norm() / ref.norm()).item()
            us = time_graph(lambda i, c=cfg: moe(i, c), LAYERS)
        except Exception as error:  # noqa: BLE001
            results["moe"].append(dict(config=cfg, error=str(error)[:160]))
            continue
        nbytes = (top_k + 1) * 3 * inter * hidden * 2
        results["moe"].append(dict(config=cfg or "default", us=us, gb_s=nbytes / us / 1e3, rel_err_vs_default=err))
        print("moe", json.dumps(results["moe"][-1]), flush=True)
        save(args.out, results)


if __name__ == "__main__":
    main()

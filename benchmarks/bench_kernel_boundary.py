"""What a kernel boundary costs in a CUDA graph, with programmatic dependent launch (PDL) and without.

A batch-1 decode step is a chain of ~450 kernels reading 1-36 MB each. Before fusing more of them,
this measures what one boundary costs at those sizes:

1. `empty`: N one-program kernels that each read one float and write one (a dependency chain):
   microseconds per kernel = the launch-to-launch floor of a graph.
2. `stream`: N kernels that each read about `mb` MB of their own slice of one large buffer (each
   program reads whole 2,048-element blocks, so the size is rounded per grid: the records hold the
   real one; the slices together, >= 256 MB of the requested size, far beyond the 50 MB L2, so
   every read comes from HBM) and write one float per program, against
   ONE kernel that reads all N slices (the same bytes, no boundaries). The difference divided by N
   is the cost of a boundary at that size; bytes over time give each its bandwidth.

    python benchmarks/bench_kernel_boundary.py --out bench_kernel_boundary.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from graph_timing import time_graph
from lamina.kernels.pdl import pdl_launch, wait_for_producer


@triton.jit
def _chain_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    tl.store(dst_ptr, tl.load(src_ptr) + 1.0)


@triton.jit
def _stream_kernel(w_ptr, dst_ptr, chunk, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Each program sums `chunk` contiguous bf16 elements (weights: read before the wait, as the
    decode GEMVs read their first block) and writes its sum after the wait."""
    pid = tl.program_id(0)
    base = w_ptr + pid.to(tl.int64) * chunk
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, chunk, BLOCK):
        acc += tl.load(base + start + tl.arange(0, BLOCK)).to(tl.float32)
    wait_for_producer(PDL)
    tl.store(dst_ptr + pid, tl.sum(acc))


def _pdl(on: bool) -> dict:
    return {"PDL": on, "launch_pdl": on}


def bench_empty(n: int, pdl: bool) -> float:
    buf = torch.zeros(n + 1, device="cuda")

    def call(i):
        _chain_kernel[(1,)](buf[i:], buf[i + 1:], **_pdl(pdl))
    return time_graph(call, n)


def bench_stream(n: int, mb: float, programs: int, pdl: bool, block: int = 2048, warps: int = 4) -> dict:
    chunk = max(block, int(mb * 2**20 / 2 / programs) // block * block)  # bf16 elements per program
    per_kernel = chunk * programs
    weights = torch.ones(n * per_kernel, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty(n * programs, device="cuda")

    def chained(i):
        _stream_kernel[(programs,)](weights[i * per_kernel:], dst[i * programs:], chunk, BLOCK=block,
                                    num_warps=warps, **_pdl(pdl))

    def single(_):
        _stream_kernel[(n * programs,)](weights, dst, chunk, BLOCK=block, num_warps=warps, **_pdl(pdl))
    us_chain = time_graph(chained, n)  # per kernel
    us_single = time_graph(single, 1)  # all n slices in one launch
    bytes_per_kernel = per_kernel * 2
    return {
        "mb_per_kernel": bytes_per_kernel / 2**20, "programs": programs, "kernels": n, "pdl": pdl,
        "us_per_kernel_chained": us_chain, "us_one_kernel_all": us_single,
        "boundary_us": us_chain - us_single / n,
        "tb_s_chained": bytes_per_kernel / us_chain / 1e6, "tb_s_one_kernel": bytes_per_kernel * n / us_single / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=40, help="kernels per graph in the stream test (one per layer)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    modes = (False, True) if pdl_launch(torch.device("cuda", torch.cuda.current_device())) else (False,)  # LAMINA_PDL, sm90+
    for pdl in modes:
        for n in (100, 450):
            us = bench_empty(n, pdl)
            rows.append({"test": "empty", "kernels": n, "pdl": pdl, "us_per_kernel": us})
            print(rows[-1], flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # the decode step's sizes: router 1 MB, out_proj 8 MB, MoE down 18 MB, gate/up 36 MB, in_proj ~24 MB
    for mb in (1, 4, 8, 18, 36):
        for programs in (sms // 2, sms, 2 * sms, 4 * sms):
            for pdl in modes:
                n = max(args.kernels, -(-256 // mb))  # >= 256 MB per graph: past the 50 MB L2
                rows.append({"test": "stream", **bench_stream(n, mb, programs, pdl)})
                r = rows[-1]
                print(f"{r['mb_per_kernel']:6.2f} MB x{programs:4d} pdl={int(pdl)}: chained {r['us_per_kernel_chained']:7.2f} us "
                      f"({r['tb_s_chained']:.2f} TB/s), one kernel {r['us_one_kernel_all'] / n:7.2f} us/slice "
                      f"({r['tb_s_one_kernel']:.2f} TB/s), boundary {r['boundary_us']:.2f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

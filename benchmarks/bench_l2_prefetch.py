"""Does pulling a weight into L2 during latency-bound kernels speed up the GEMV that reads it next?

In a batch-1 decode step the delta net's out_proj (attention's o_proj) GEMV, 2048 x 4096 bf16 =
16.8 MB, follows ~7-11 us of kernels that read almost nothing (conv, delta rule, gated norm; q/k
prep, attention). This times, in CUDA graphs of `--reps` repetitions (a different weight copy each
time, far beyond the 50 MB L2, so nothing is warm by accident), with PDL as the decode step has it:

- `busy`: a one-program kernel spinning `n` dependent FMAs (the stand-in for those kernels);
- `cold`: busy(n) -> GEMV(x, W_i): today's order;
- `prefetch`: prefetch_to_l2(W_i) -> busy(n) -> GEMV(x, W_i);
- `warm`: busy(n) -> GEMV(x, W_0) every time (L2-warm: the floor);
- `prefetch_busy`: prefetch_to_l2(W_i) -> busy(n) (what the prefetch adds when nothing reads it).

GEMV microseconds = the case minus `busy`. A sweep of the prefetch's chunk size (bytes per bulk
prefetch instruction; programs = size / (32 x chunk)) at one spin length follows.

Measured on an H200 (2026-12-03, benchmarks/results/bench_l2_prefetch_h200.json): the GEMV takes
7.4 us cold and 5.9 us on a weight already in L2, but 9.6-11.6 us after the prefetch, whatever
the spin (up to 15 us), and the prefetch adds 3.1 us to the chain; in the engine the batch-1 step
took 2.98 ms with it against 2.68 without (latency_l2pf_h200.json). So the prefetch was not kept.
The kernel that ran took up to three tensors and had a load path for Triton's interpreter; only
its one-tensor bulk path, the one this benchmark used, is kept here (not re-run since).

    python benchmarks/bench_l2_prefetch.py --out bench_l2_prefetch.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from graph_timing import time_graph
from lamina.kernels.pdl import pdl_kwargs, wait_for_producer
from lamina.kernels.triton_gemv import gemv

# The prefetch kernel, written for the engine's decode path (launched after the delta net's in_proj
# GEMV and attention's qkv GEMV) and kept here only: it made the batch-1 step slower (see the
# module docstring). Each program (one warp) covers CHUNKS consecutive chunks of CHUNK bytes, one
# per thread, and issues `cp.async.bulk.prefetch.L2.global` (fire and forget) for each right after
# its predecessor completes.
CHUNK_BYTES = 16384  # bytes per bulk prefetch instruction (a multiple of 16)
CHUNKS_PER_PROGRAM = 32  # one per thread of a program's single warp


@triton.jit
def _l2_prefetch_kernel(addr, size, sink_ptr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)  # after the wait: the predecessor (a weight-streaming GEMV) is done with the HBM
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * (CHUNKS * CHUNK) + tl.arange(0, CHUNKS).to(tl.int64) * CHUNK  # [CHUNKS]
    nbytes = tl.minimum(tl.maximum(size - offs, 0), CHUNK) // 16 * 16  # whole 16-byte units inside the tensor
    done = tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.gt.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        constraints="=r,l,r", args=[addr + offs, nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )
    tl.store(sink_ptr + pid, tl.sum(done))  # keeps the asm alive


def prefetch_to_l2(weight: torch.Tensor, chunk: int = CHUNK_BYTES) -> None:
    """Start pulling a contiguous CUDA tensor into L2 (one launch, after its predecessor completes)."""
    assert weight.is_contiguous() and chunk % 16 == 0
    addr, size = weight.data_ptr(), weight.numel() * weight.element_size()
    head = -addr % 16  # the bulk prefetch takes 16-byte aligned addresses
    programs = max(1, triton.cdiv(size, CHUNKS_PER_PROGRAM * chunk))
    sink = torch.empty(programs, dtype=torch.int32, device=weight.device)
    _l2_prefetch_kernel[(programs,)](addr + head, max(0, size - head), sink, CHUNK=chunk, CHUNKS=CHUNKS_PER_PROGRAM,
                                     num_warps=1, **pdl_kwargs(weight.device))


@triton.jit
def _busy_kernel(buf_ptr, n, PDL: tl.constexpr):
    wait_for_producer(PDL)
    acc = tl.load(buf_ptr)
    for _ in range(n):
        acc = acc * 0.999 + 1.0
    tl.store(buf_ptr, acc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=24, help="weight copies per graph (16.8 MB each)")
    ap.add_argument("--spins", type=int, nargs="+", default=[0, 250, 500, 1000, 2000, 4000])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    weights = [torch.randn(2048, 4096, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(args.reps)]
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
    buf = torch.zeros(1, device=dev)
    pdl = pdl_kwargs(dev)

    def busy(n):
        _busy_kernel[(1,)](buf, n, num_warps=1, **pdl)

    rows = []
    ref = gemv(x, weights[0])
    prefetch_to_l2(weights[0])
    torch.cuda.synchronize()
    assert torch.equal(gemv(x, weights[0]), ref)

    def case(name, n, chunk=None):
        def fn(i):
            if name in ("prefetch", "prefetch_busy"):
                prefetch_to_l2(weights[i], **({"chunk": chunk} if chunk else {}))
            busy(n)
            if name in ("cold", "prefetch"):
                gemv(x, weights[i])
            elif name == "warm":
                gemv(x, weights[0])
        return time_graph(fn, args.reps)

    for n in args.spins:
        t = {c: case(c, n) for c in ("busy", "cold", "prefetch", "warm", "prefetch_busy")}
        row = {"spin": n, **{f"{c}_us": v for c, v in t.items()},
               "gemv_cold_us": t["cold"] - t["busy"], "gemv_after_prefetch_us": t["prefetch"] - t["busy"],
               "gemv_warm_us": t["warm"] - t["busy"], "prefetch_adds_us": t["prefetch_busy"] - t["busy"]}
        rows.append(row)
        print(f"spin {n:5d}: busy {t['busy']:6.2f} us | GEMV cold {row['gemv_cold_us']:6.2f}, after prefetch "
              f"{row['gemv_after_prefetch_us']:6.2f}, warm {row['gemv_warm_us']:6.2f} | prefetch adds {row['prefetch_adds_us']:5.2f}",
              flush=True)
    n_mid = args.spins[len(args.spins) // 2]
    busy_mid = case("busy", n_mid)
    for chunk in (4096, 8192, 16384, 32768, 65536):
        t = case("prefetch", n_mid, chunk)
        rows.append({"spin": n_mid, "chunk": chunk, "programs": -(-weights[0].numel() * 2 // (32 * chunk)),
                     "prefetch_us": t, "busy_us": busy_mid, "gemv_after_prefetch_us": t - busy_mid})
        print(f"chunk {chunk:6d} ({rows[-1]['programs']:4d} programs), spin {n_mid}: GEMV after prefetch {t - busy_mid:6.2f} us",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "weight_mb": weights[0].numel() * 2 / 1e6,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

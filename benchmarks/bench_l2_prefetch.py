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
# module docstring). Each program covers CHUNKS (one per thread of its single warp) consecutive
# chunks of CHUNK bytes of one tensor (grid axis 1 picks the tensor); on a GPU it issues
# `cp.async.bulk.prefetch.L2.global` (fire and forget) per chunk right after its predecessor
# completes; BULK=False reads the chunks with plain loads instead (a byte sum per program).
CHUNK_BYTES = 16384  # bytes per bulk prefetch instruction (a multiple of 16)
CHUNKS_PER_PROGRAM = 32  # one per thread of a program's single warp
MAX_TENSORS = 3


@triton.jit
def _l2_prefetch_kernel(addr0, addr1, addr2, bytes0_ptr, bytes1_ptr, bytes2_ptr, size0, size1, size2, sink_ptr,
                        CHUNK: tl.constexpr, CHUNKS: tl.constexpr, BULK: tl.constexpr, LOAD_BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    # After the wait: the predecessor (a weight-streaming GEMV) has finished with the HBM.
    wait_for_producer(PDL)
    pid = tl.program_id(0)
    which = tl.program_id(1)
    size = tl.where(which == 0, size0, tl.where(which == 1, size1, size2)).to(tl.int64)
    first = pid.to(tl.int64) * (CHUNKS * CHUNK)  # this program's first byte in its tensor
    if BULK:
        base = tl.where(which == 0, addr0, tl.where(which == 1, addr1, addr2)).to(tl.int64)
        offs = first + tl.arange(0, CHUNKS).to(tl.int64) * CHUNK  # [CHUNKS]
        nbytes = tl.minimum(tl.maximum(size - offs, 0), CHUNK) // 16 * 16  # whole 16-byte units inside the tensor
        done = tl.inline_asm_elementwise(
            asm="""{
            .reg .pred p;
            setp.gt.s32 p, $2, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }""",
            constraints="=r,l,r", args=[base + offs, nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )
        tl.store(sink_ptr + which * tl.num_programs(0) + pid, tl.sum(done))
    else:
        total = tl.zeros([LOAD_BLOCK], tl.int32)
        for step in range(0, CHUNKS * CHUNK // LOAD_BLOCK):
            offs = first + step * LOAD_BLOCK + tl.arange(0, LOAD_BLOCK)  # [LOAD_BLOCK]
            ok = offs < size
            if which == 0:
                total += tl.load(bytes0_ptr + offs, mask=ok, other=0).to(tl.int32)
            elif which == 1:
                total += tl.load(bytes1_ptr + offs, mask=ok, other=0).to(tl.int32)
            else:
                total += tl.load(bytes2_ptr + offs, mask=ok, other=0).to(tl.int32)
        tl.store(sink_ptr + which * tl.num_programs(0) + pid, tl.sum(total))


def prefetch_plan(sizes: list[int], chunk: int = CHUNK_BYTES) -> int:
    """Programs per tensor (grid axis 0) for tensors of these byte sizes."""
    span = CHUNKS_PER_PROGRAM * chunk
    return max(1, max(triton.cdiv(s, span) for s in sizes))


def prefetch_to_l2(*tensors: torch.Tensor, chunk: int = CHUNK_BYTES, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Start pulling up to `MAX_TENSORS` contiguous tensors of one CUDA device into L2 (one launch,
    after its predecessor completes; returns at once). Returns the per-program sink `[T, P]` int32
    (zeros on the GPU; under Triton's interpreter each program's byte sum)."""
    if not 0 < len(tensors) <= MAX_TENSORS:
        raise ValueError(f"prefetch_to_l2 takes 1 to {MAX_TENSORS} tensors, got {len(tensors)}")
    if chunk % 16 or chunk <= 0 or (CHUNKS_PER_PROGRAM * chunk) % 1024:
        raise ValueError(f"prefetch_to_l2: chunk {chunk} must be a positive multiple of 16 with 32 chunks a multiple of 1024 bytes")
    device = tensors[0].device
    for t in tensors:
        if not t.is_contiguous() or t.device != device:
            raise ValueError(f"prefetch_to_l2 takes contiguous tensors of one device, got {tuple(t.shape)} on {t.device}")
    as_bytes = [t.reshape(-1).view(torch.uint8) for t in tensors]  # [bytes]
    as_bytes += [as_bytes[0]] * (MAX_TENSORS - len(as_bytes))
    sizes = [b.numel() for b in as_bytes[: len(tensors)]] + [0] * (MAX_TENSORS - len(tensors))
    programs = prefetch_plan(sizes[: len(tensors)], chunk)
    bulk = device.type == "cuda"
    if sink is None or sink.numel() < len(tensors) * programs:
        sink = torch.empty(len(tensors), programs, dtype=torch.int32, device=device)  # [T, P]
    addrs = [b.data_ptr() for b in as_bytes]
    if bulk:  # the bulk prefetch takes 16-byte aligned addresses: skip a misaligned head (< 16 bytes)
        heads = [-a % 16 for a in addrs]
        addrs = [a + h for a, h in zip(addrs, heads)]
        sizes = [max(0, s - h) for s, h in zip(sizes, heads)]
    _l2_prefetch_kernel[(programs, len(tensors))](
        *addrs, *as_bytes, *sizes, sink,
        CHUNK=chunk, CHUNKS=CHUNKS_PER_PROGRAM, BULK=bulk, LOAD_BLOCK=1024, num_warps=1, **pdl_kwargs(device),
    )
    return sink



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
    pre = prefetch_to_l2(weights[0])
    torch.cuda.synchronize()
    assert torch.equal(gemv(x, weights[0]), ref) and int(pre.sum()) == 0

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

"""MoE pair alignment (`lamina.kernels.triton_align.align_pairs`) on one GPU: the one-program sort
kernel against the kernel it replaced (copied below as `_align_kernel_v0`: [64, E] one-hot tiles
with a cumsum per chunk, a 64-lane padding fill) and the torch reference, per call, at decode-like
pair counts (default 8, 128, 512, 2048 pairs = batch 1, 16, 64, 256 at top-8 over 256 experts,
BLOCK_M 16: fused_moe's default tile).

Every path is first checked bitwise against `_align_torch` on the same ids; each time is
`triton.testing.do_bench_cudagraph` (the call captured in a CUDA graph, replayed; median, in
microseconds per call, launch included). `--sweep` also times the new kernel at 1, 2, 4 and 8
warps (the default picks by pair count: `_align_warps`).

    python benchmarks/bench_align.py --out bench_align.json             # ~30 s (compiles included)
    python benchmarks/bench_align.py --out bench_align.json --sweep     # + warps sweep, ~1-2 min
    python benchmarks/bench_align.py --experts 64 --global-experts 256 --expert-start 64   # EP rank 1 of 4
    python benchmarks/bench_align.py --pairs 8192,16384,65536 --block-m 64 --no-v0 --eager   # prefill chunks:
        # the three-launch alignment (triton_align) against torch's, in graphs and eagerly
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.kernels.triton_align import align_pairs_blocked  # noqa: E402
from lamina.kernels.triton_align import _align_one_program, _align_torch, _align_warps, _max_rows  # noqa: E402


# The kernel before the sort-based one (lamina commit 0835e6a), kept here as the baseline.
@triton.jit
def _align_kernel_v0(ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, expert_start, num_experts, max_rows,
                     BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + lanes
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32) - expert_start
        local = (offs < num_pairs) & (e >= 0) & (e < num_experts)
        e = tl.where(local, e, -1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    for b0 in range(0, max_rows // BLOCK_M, CHUNK):
        blocks = b0 + lanes
        first_row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32) * (experts[None, :] < num_experts), axis=1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < max_rows // BLOCK_M)
    for r0 in range(0, max_rows, CHUNK):
        rows = r0 + lanes
        tl.store(sorted_pairs_ptr + rows, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=rows < max_rows)
    tl.debug_barrier()
    running = starts
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + lanes
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32) - expert_start
        local = (offs < num_pairs) & (e >= 0) & (e < num_experts)
        onehot = ((e[:, None] == experts[None, :]) & local[:, None]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot
        dest = tl.sum(onehot * (running[None, :] + before), axis=1)
        tl.store(sorted_pairs_ptr + dest, offs.to(tl.int32), mask=local)
        running += tl.sum(onehot, axis=0)


def _align_v0(topk_ids, num_local_experts, expert_start, block_m):
    num_pairs = topk_ids.numel()
    max_rows = _max_rows(num_pairs, num_local_experts, block_m)
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=topk_ids.device)
    _align_kernel_v0[(1,)](
        topk_ids.reshape(-1), sorted_pairs, block_expert, num_pairs, expert_start, num_local_experts, max_rows,
        BLOCK_M=block_m, E_PAD=triton.next_power_of_2(num_local_experts),
        CHUNK=min(64, max(16, triton.next_power_of_2(num_pairs))), num_warps=4,
    )
    return sorted_pairs, block_expert


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    ap.add_argument("--pairs", default="8,128,512,2048", help="(token, expert) pairs per call")
    ap.add_argument("--experts", type=int, default=256, help="local experts (E_local)")
    ap.add_argument("--global-experts", type=int, default=None, help="ids are drawn from these (default: --experts)")
    ap.add_argument("--expert-start", type=int, default=0, help="first local expert id (expert parallelism)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--rep", type=int, default=20, help="do_bench_cudagraph's rep (ms)")
    ap.add_argument("--sweep", action="store_true", help="also time the new kernel at 1, 2, 4, 8 warps")
    ap.add_argument("--no-v0", action="store_true", help="skip the old kernel (slow: ~40 us per call)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch reference's timing")
    ap.add_argument("--block-p", type=int, nargs="*", default=[], help="also time the blocked alignment at these BLOCK_P")
    ap.add_argument("--eager", action="store_true",
                    help="also time eager calls (launches included: what a prefill step, which runs eagerly, pays)")
    args = ap.parse_args()
    dev = "cuda"
    experts, start, block_m, top_k = args.experts, args.expert_start, args.block_m, args.top_k
    global_experts = args.global_experts or experts
    gen = torch.Generator(device=dev).manual_seed(0)
    results = [{"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "experts": experts, "global_experts": global_experts, "expert_start": start, "top_k": top_k,
                "block_m": block_m, "timer": "do_bench_cudagraph median, us per call"}]
    print(json.dumps(results[0]))
    for num_pairs in (int(p) for p in args.pairs.split(",")):
        k = top_k if num_pairs % top_k == 0 and top_k <= global_experts else 1
        scores = torch.rand(num_pairs // k, global_experts, device=dev, generator=gen)
        ids = scores.topk(k, dim=-1).indices  # [T, k] int64: distinct experts per token, as the router's
        ref = _align_torch(ids, experts, start, block_m)
        paths = {"new": lambda: _align_one_program(ids, experts, start, block_m)} if num_pairs <= 4096 else {}
        paths["blocked"] = lambda: align_pairs_blocked(ids, experts, start, block_m, _max_rows(ids.numel(), experts, block_m))
        for bp in args.block_p:
            paths[f"blocked_{bp}"] = lambda bp=bp: align_pairs_blocked(ids, experts, start, block_m,
                                                                       _max_rows(ids.numel(), experts, block_m), bp)
        if args.sweep:
            for warps in (1, 2, 4, 8):
                paths[f"new_{warps}w"] = lambda warps=warps: _align_one_program(ids, experts, start, block_m, warps)
        if not args.no_v0:
            paths["v0"] = lambda: _align_v0(ids, experts, start, block_m)
        if not args.no_torch:
            paths["torch"] = lambda: _align_torch(ids, experts, start, block_m)
        record = {"pairs": num_pairs, "tokens": num_pairs // k, "top_k": k, "rows": ref[0].numel(),
                  "new_warps": _align_warps(max(32, triton.next_power_of_2(num_pairs)))}
        for name, fn in paths.items():
            out = fn()
            torch.cuda.synchronize()
            record[f"{name}_equal"] = bool(torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]))
            try:
                record[f"{name}_us"] = do_bench_cudagraph(fn, rep=args.rep, return_mode="median") * 1e3
            except Exception as e:  # noqa: BLE001 - e.g. a path that cannot be captured: reported, skipped
                record[f"{name}_us"] = None
                record[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                args.no_torch = args.no_torch or name == "torch"  # a failed capture: not again
            if args.eager:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
                record[f"{name}_eager_us"] = (time.perf_counter() - t0) / 50 * 1e6
        if record.get("v0_us") and record.get("new_us"):
            record["speedup_vs_v0"] = record["v0_us"] / record["new_us"]
        print(json.dumps(record))
        results.append(record)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

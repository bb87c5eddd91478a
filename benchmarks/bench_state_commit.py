"""What committing speculative states costs a step: the reference (`index_select` + `index_copy_`
per state pool) against lamina.kernels.triton_state_rows (one launch per group of like pools).

Pools of the Qwen3.5-35B-A3B shape: 30 gated delta net layers, each a bf16 conv state
[slots, 8192, 3] and a float32 recurrent state [slots, 32, 128, 128], with verification capture
rows [B*K, ...]. Timed as the engine meets it: the commit starts on an idle GPU (the previous step
synchronised on its sampled ids) and the next step waits for it, so each call is timed from the
host's start to the device's end (synchronised), and also the host's launch time alone. The same
tensors every call, as under the verification graphs' persistent capture rows: the copier's
address tables come from its cache (eager verification steps bring fresh capture rows, one table
upload more a group). `triton_tb_per_s`: the bytes read and written over that whole time, launch
included, so a floor on the kernel's own rate.

    python benchmarks/bench_state_commit.py --out commit.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lamina.kernels.state_rows import copy_state_rows_reference
from lamina.kernels.triton_state_rows import StateRowCopier

LAYERS, CONV_SHAPE, SSM_SHAPE = 30, (8192, 3), (32, 128, 128)


def timed(fn, iters: int) -> tuple[float, float]:
    """(median us from launch to device end, median us of host launch time)."""
    full, host = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        full.append((t2 - t0) * 1e6)
        host.append((t1 - t0) * 1e6)
    full.sort()
    host.sort()
    return full[len(full) // 2], host[len(host) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        slots = batch + 1
        pairs = []
        for _ in range(LAYERS):
            for shape, dtype in ((CONV_SHAPE, torch.bfloat16), (SSM_SHAPE, torch.float32)):
                pool = torch.zeros((slots, *shape), dtype=dtype, device="cuda")
                captured = torch.randn((batch * args.k, *shape), device="cuda").to(dtype)
                pairs.append((pool, captured))
        dst = torch.arange(batch, device="cuda")  # [B]: every request rejected a draft
        src = torch.arange(batch, device="cuda") * args.k  # [B]
        copier = StateRowCopier()
        reference = [(p.clone(), c) for p, c in pairs]
        copier(pairs, dst, src)
        copy_state_rows_reference(reference, dst, src)
        identical = all(torch.equal(p, r) for (p, _), (r, _) in zip(pairs, reference))
        ref_us, ref_host = timed(lambda: copy_state_rows_reference(pairs, dst, src), args.iters)
        new_us, new_host = timed(lambda: copier(pairs, dst, src), args.iters)
        moved = 2 * batch * sum(c[0].numel() * c.element_size() for _, c in pairs)  # read + write
        row = {"batch": batch, "k": args.k, "pools": len(pairs), "identical": identical,
               "reference_us": ref_us, "reference_host_us": ref_host, "triton_us": new_us, "triton_host_us": new_host,
               "bytes_moved": moved, "triton_tb_per_s": moved / new_us / 1e6}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "command": "python benchmarks/bench_state_commit.py " + " ".join(
                           f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

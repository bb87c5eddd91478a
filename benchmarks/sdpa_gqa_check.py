"""Does `scaled_dot_product_attention(..., enable_gqa=True)` with a boolean mask match the
expanded-KV call lamina's reference attention makes, and what does it cost? (GPU, bf16)

    python benchmarks/sdpa_gqa_check.py --out sdpa_gqa.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def run(fn, reps: int = 5):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / reps * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    hq, hkv, d = 16, 2, 256
    rows = []
    for name, b, lq, s in [("decode", 64, 1, 4096), ("verify k=3", 64, 4, 4096), ("prefill", 1, 4096, 4096)]:
        q = torch.randn(b, hq, lq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        pos = (s - lq) + torch.arange(lq, device="cuda")
        mask = (torch.arange(s, device="cuda")[None, :] <= pos[:, None])[None, None].expand(b, 1, lq, s)
        group = hq // hkv

        def expanded():
            ke = k[:, :, None].expand(b, hkv, group, s, d).reshape(b, hq, s, d)
            ve = v[:, :, None].expand(b, hkv, group, s, d).reshape(b, hq, s, d)
            return F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)

        def gqa():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        ref, t_ref, m_ref = run(expanded)
        row = {"shape": name, "batch": b, "queries": lq, "context": s, "expanded_ms": t_ref, "expanded_peak_gib": m_ref}
        try:
            out, t, m = run(gqa)
            row.update(gqa_ms=t, gqa_peak_gib=m, max_abs_diff=(out.float() - ref.float()).abs().max().item())
        except Exception as e:  # noqa: BLE001 - record what the backend refused
            row["gqa_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"gpu": torch.cuda.get_device_name(), "gpus": 1, "torch": torch.__version__, "command": " ".join(sys.argv), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

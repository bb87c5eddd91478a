"""Host time of staging an MTP verification step for its graph (`VerifyGraphs.stage`), against
the per-request loop it replaced (kept here as the reference): both fill a host buffer each, which
must come out identical. CPU only: no graph is captured or replayed.

    python benchmarks/bench_verify_staging.py --out staging.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

from lamina.sampling_params import SamplingParams
from lamina.step_plan import ScheduledChunk
from lamina.worker.verify_graphs import VerifyGraphs

BLOCK_SIZE = 16


class _NoStateModel:
    def state_modules(self):
        return []


def reference_stage(graphs: VerifyGraphs, chunks, queries: int, size: int) -> None:
    """Session 19's staging: numpy work per request."""
    host = graphs.host_np
    tokens = graphs._token_field(host, "token_ids", size * queries).reshape(size, queries)  # [Bc, Q]
    positions = graphs._token_field(host, "positions", size * queries).reshape(size, queries)  # [Bc, Q]
    slot_mapping = graphs._token_field(host, "slot_mapping", size * queries).reshape(size, queries)  # [Bc, Q]
    seq_lens = graphs._request_field(host, "seq_lens", size)
    state_slots = graphs._request_field(host, "state_slots", size)
    keep = graphs._request_field(host, "keep", size)
    tables = graphs._tables(host, size)
    offsets = np.arange(queries)
    for row, chunk in enumerate(chunks):
        table = chunk.block_table
        pos = chunk.start_position + offsets  # [Q]
        tokens[row] = chunk.token_ids
        positions[row] = pos
        slot_mapping[row] = np.asarray(table)[pos // graphs.block_size] * graphs.block_size + pos % graphs.block_size
        seq_lens[row] = chunk.end_position
        state_slots[row] = chunk.state_slot
        keep[row] = chunk.start_position > 0
        tables[row, : len(table)] = table
    graphs._fill_padding(queries, len(chunks), size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--contexts", default="1000,4000", help="tokens already in each request's cache")
    parser.add_argument("--k", type=int, default=2, help="drafts a request verifies (Q = k + 1 tokens)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    queries = args.k + 1
    params = SamplingParams()
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            chunks = []
            for i in range(batch):
                start = context + 7 * i
                blocks = (start + queries) // BLOCK_SIZE + 1
                chunks.append(ScheduledChunk(
                    f"r{i}", [i + q for q in range(queries)], start, list(range(300 * i, 300 * i + blocks)), i, True,
                    params, 1, num_draft_tokens=args.k,
                ))
            max_blocks = max(len(c.block_table) for c in chunks)
            made = [VerifyGraphs(_NoStateModel(), device=torch.device("cpu"), max_batch=batch,
                                 num_speculative_tokens=args.k, block_size=BLOCK_SIZE, max_blocks_per_seq=max_blocks,
                                 spare_state_slot=10_000) for _ in range(2)]
            reference, staged = made
            reference_stage(reference, chunks, queries, batch)
            staged.stage(chunks, queries, batch)
            identical = bool((reference.host_np == staged.host_np).all())
            times = {}
            repeats = max(200, 20_000 // batch)
            for name, fn in (("reference_us", lambda: reference_stage(reference, chunks, queries, batch)),
                             ("stage_us", lambda: staged.stage(chunks, queries, batch))):
                best = float("inf")
                for _ in range(3):
                    started = time.perf_counter()
                    for _ in range(repeats):
                        fn()
                    best = min(best, (time.perf_counter() - started) / repeats * 1e6)
                times[name] = best
            row = {"batch": batch, "context": context, "queries": queries, "identical": identical, **times}
            rows.append(row)
            print(f"batch {batch:3d} context {context:5d} Q {queries}: reference {times['reference_us']:.1f} us, "
                  f"stage {times['stage_us']:.1f} us, identical {identical}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"kind": "verify_staging", "python": platform.python_version(),
                       "machine": platform.processor() or platform.machine(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

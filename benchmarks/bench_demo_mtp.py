"""MTP cost and benefit on the trained demo model, with real acceptance.

    python3 benchmarks/bench_demo_mtp.py [--model lamina/demo_model] [--dtype bfloat16] --out FILE.json

For K = 0 (no speculation), 1, 2, 3 and the auto policy (K <= 3), at batch 1 (`--batch1-items`
held-out items one after another, max_num_seqs 1) and batch 64 (all held-out items, max_num_seqs
64): output tok/s, accuracy, acceptance rate per draft position, mean acceptance length, and the
mean time of a decode step (batch 1: output tokens / mean acceptance length = steps). Each
configuration runs once untimed first (CUDA graph capture, allocator warm-up).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

CONFIGS = (
    ("K=0", None),
    ("K=1", {"method": "mtp", "num_speculative_tokens": 1}),
    ("K=2", {"method": "mtp", "num_speculative_tokens": 2}),
    ("K=3", {"method": "mtp", "num_speculative_tokens": 3}),
    ("auto (K<=3)", {"method": "mtp", "num_speculative_tokens": 3, "policy": "auto"}),
)


def _snapshot(metrics) -> dict | None:
    if metrics is None:
        return None
    return dict(num_steps=metrics.num_steps, num_draft_tokens=metrics.num_draft_tokens,
                num_accepted_tokens=metrics.num_accepted_tokens, accepted=list(metrics.accepted_per_position),
                drafted=list(metrics.draft_tokens_per_position))


def run(model: str, dtype: str, items: list[dict], batch: int, spec: dict | None) -> dict:
    from lamina import LLM, SamplingParams

    conversations = [[{"role": "user", "content": it["prompt"]}] for it in items]
    params = SamplingParams(temperature=0, max_tokens=32)
    llm = LLM(model, dtype=dtype, max_num_seqs=batch, speculative_config=spec)
    try:
        llm.chat(conversations[: min(len(items), 2 * batch)], params, use_tqdm=False)  # warm-up
        metrics = getattr(llm.llm_engine, "spec_decode_metrics", None)
        before = _snapshot(metrics)
        start = time.perf_counter()
        outs = llm.chat(conversations, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = _snapshot(metrics)
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    correct = sum(o.outputs[0].text.strip() == it["answer"] for o, it in zip(outs, items))
    row = dict(batch=batch, num_items=len(items), seconds=round(seconds, 3), output_tokens=tokens,
               output_tok_per_s=round(tokens / seconds, 1), accuracy=correct / len(items),
               texts=[o.outputs[0].text for o in outs])
    if before is not None:
        steps = after["num_steps"] - before["num_steps"]
        drafts = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        per_pos = [
            (a1 - a0) / (d1 - d0) if d1 > d0 else None
            for a0, a1, d0, d1 in zip(
                before["accepted"] + [0] * 8, after["accepted"], before["drafted"] + [0] * 8, after["drafted"]
            )
        ]
        row.update(verify_steps=steps, acceptance_rate=accepted / drafts if drafts else None,
                   per_position_acceptance=per_pos,
                   mean_acceptance_length=1 + accepted / steps if steps else None)
    mal = row.get("mean_acceptance_length") or 1.0
    if batch == 1:
        row["ms_per_decode_step"] = round(1000 * seconds / (tokens / mal), 3)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "lamina" / "demo_model"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch1-items", type=int, default=60)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    items = [json.loads(line) for line in open(Path(args.model) / "eval.jsonl")]
    rows = []
    for batch, subset in ((1, items[: args.batch1_items]), (64, items)):
        baseline_texts = None
        for name, spec in CONFIGS:
            row = run(args.model, args.dtype, subset, batch, spec)
            texts = row.pop("texts")
            baseline_texts = baseline_texts or texts
            row.update(config=name, identical_to_k0=texts == baseline_texts)
            rows.append(row)
            print(json.dumps(row), flush=True)
    record = dict(command=" ".join(["python3", "benchmarks/bench_demo_mtp.py", *(argv or sys.argv[1:])]),
                  model=args.model, dtype=args.dtype, rows=rows)
    try:
        import torch

        record["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        record["gpu"] = None
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

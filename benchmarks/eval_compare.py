"""Compare `lamina eval --output-json` runs of one eval set item by item: each run's accuracy and
command, and against the first run how many completions differ (token ids and text) and which
items flipped between correct and wrong.

    python benchmarks/eval_compare.py base.json other.json [more.json ...] --out compare.json
"""

from __future__ import annotations

import argparse
import json
import sys


def compare(paths: list[str]) -> dict:
    runs = [json.load(open(p)) for p in paths]
    base = {r["id"]: r for r in runs[0]["results"]}
    record = {"command": "python benchmarks/eval_compare.py " + " ".join(sys.argv[1:]), "runs": []}
    for path, run in zip(paths, runs):
        results = {r["id"]: r for r in run["results"]}
        if set(results) != set(base):
            raise ValueError(f"{path} evaluates other items than {paths[0]}")
        differ = [i for i in base if results[i]["token_ids"] != base[i]["token_ids"]]
        record["runs"].append({
            "file": path, "accuracy": run["accuracy"], "correct": run["correct"], "num_items": run["num_items"],
            "errors": run["errors"], "device": run["device"], "dtype": run["dtype"],
            "output_tok_per_s": run["output_tok_per_s"], "completions_differing_from_first": len(differ),
            "texts_differing_from_first": sum(results[i]["output"] != base[i]["output"] for i in base),
            "became_correct": [i for i in differ if results[i]["correct"] and not base[i]["correct"]],
            "became_wrong": [i for i in differ if base[i]["correct"] and not results[i]["correct"]],
        })
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="lamina eval --output-json files; the first is the baseline")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    record = compare(args.runs)
    for run in record["runs"]:
        print(f"{run['file']}: {run['correct']}/{run['num_items']} correct, {run['completions_differing_from_first']} "
              f"completions differ from the first run (+{len(run['became_correct'])} / -{len(run['became_wrong'])})")
    if args.out:
        json.dump(record, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

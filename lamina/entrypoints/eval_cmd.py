"""`lamina eval demo`: exact-match accuracy of a model on an evaluation set, with throughput and
(under MTP speculative decoding) acceptance.

The eval set is JSON lines, one item a line:

    {"id": 17, "task": "add", "prompt": "What is 352 + 419?", "answer": "771", "max_tokens": 24}

(`max_tokens` is optional; default `--max-tokens`, 64). Each prompt is sent as one user message
through the model's chat template (as `LLM.chat` does), greedy unless `--temperature` says
otherwise, all items submitted at once (`--concurrency` sequences in flight); an item is correct
iff its completion text, stripped, equals `answer`. Items whose request fails are counted as
errors (and as not correct); the run goes on. Without `--model` the built-in default model is
evaluated; the eval set defaults to `<model>/eval.jsonl`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from lamina.outputs import SpecDecodeMetrics
from lamina.sampling_params import SamplingParams

SUITES = ("demo",)
DEFAULT_MAX_TOKENS = 64
DEFAULT_CONCURRENCY = 64
_REQUIRED = ("id", "task", "prompt", "answer")


@dataclasses.dataclass(frozen=True)
class EvalItem:
    id: int | str
    task: str
    prompt: str
    answer: str
    max_tokens: int | None = None
    line: int | None = None  # 1-based line in the eval file, for messages


# ---- the eval set ---------------------------------------------------------------------------
def load_eval_items(path: str | Path, limit: int | None = None) -> list[EvalItem]:
    """The first `limit` items (all when None) of a JSON-lines eval set. Blank lines are skipped;
    any other malformed line raises ValueError naming the file, the line and what is wrong."""
    path = Path(path)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    if not path.is_file():
        raise FileNotFoundError(f"no eval set at {path}" + (" (it is a directory)" if path.is_dir() else ""))
    items: list[EvalItem] = []
    seen: dict[int | str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            if not text.strip():
                continue
            item = _parse_line(text, f"{path}:{lineno}", lineno)
            if item.id in seen:
                raise ValueError(f"{path}:{lineno}: id {item.id!r} repeats the id of line {seen[item.id]}")
            seen[item.id] = lineno
            items.append(item)
    if not items:
        raise ValueError(f"{path}: the eval set has no items")
    return items


def _parse_line(text: str, where: str, lineno: int) -> EvalItem:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(repr(k) for k in missing)} "
                         f"(an item needs {', '.join(_REQUIRED)}; max_tokens is optional)")
    id_ = obj["id"]
    if isinstance(id_, bool) or not isinstance(id_, (int, str)):
        raise ValueError(f"{where}: 'id' must be an integer or a string, got {id_!r}")
    for key in ("task", "prompt"):
        if not isinstance(obj[key], str) or not obj[key]:
            raise ValueError(f"{where}: {key!r} must be a non-empty string, got {obj[key]!r}")
    if not isinstance(obj["answer"], str):
        raise ValueError(f"{where}: 'answer' must be a string (compared with the stripped completion text), "
                         f"got {obj['answer']!r}")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    return EvalItem(id=id_, task=obj["task"], prompt=obj["prompt"], answer=obj["answer"], max_tokens=max_tokens,
                    line=lineno)


# ---- evaluation -----------------------------------------------------------------------------
def evaluate(
    llm,
    items: Sequence[EvalItem | Mapping],
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    progress: bool = False,
) -> dict:
    """Run `items` through `llm` (an `lamina.LLM`) in one offline batch and score them.

    Returns the record: accuracy, correct, num_items, errors, per_task, elapsed_s (the generation
    only, not the model load), output_tokens, output_tok_per_s, acceptance_rate and
    mean_acceptance_length (None without speculative decoding, or when no draft was verified),
    spec_decode (the summed counters), model, layout, speculative_config, sampling, and
    `results`: one entry per item (id, task, answer, output, correct, finish_reason, error).

    A request that cannot be built or is refused by the engine (chat template, prompt too long,
    ...) or that finishes with an error counts as an error, not as a failed run; if generation
    itself raises, every request of the batch is counted as an error with its message.
    """
    fields = {f.name for f in dataclasses.fields(EvalItem)}
    items = [it if isinstance(it, EvalItem) else EvalItem(**{k: v for k, v in it.items() if k in fields})
             for it in items]
    engine = llm.engine
    results: list[dict] = [
        {"id": it.id, "task": it.task, "answer": it.answer, "output": None, "correct": False,
         "finish_reason": None, "num_output_tokens": 0, "error": None}
        for it in items
    ]
    # Build and validate every request first: a bad one is counted, the others still run.
    prompts, params, index = [], [], []
    for i, it in enumerate(items):
        p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                           max_tokens=it.max_tokens or max_tokens)
        try:
            ids = llm.chat_token_ids([{"role": "user", "content": it.prompt}])
            engine.validate_request(ids, p)
        except (ValueError, TypeError) as e:
            results[i]["error"] = f"{type(e).__name__}: {e}"
            continue
        prompts.append({"prompt": it.prompt, "prompt_token_ids": ids})
        params.append(p)
        index.append(i)
    start = time.perf_counter()
    outputs: list = []
    if prompts:
        try:
            outputs = llm.generate(prompts, params, use_tqdm=progress)
        except Exception as e:  # the whole batch failed: count it, report what ran
            for i in index:
                results[i]["error"] = f"generation failed: {type(e).__name__}: {e}"
            outputs = []
    elapsed = time.perf_counter() - start
    spec = SpecDecodeMetrics()
    output_tokens = 0
    for i, out in zip(index, outputs):
        r = results[i]
        if out is None:
            r["error"] = "no output was returned for this request"
            continue
        completion = out.outputs[0]
        output_tokens += len(completion.token_ids)
        r.update(output=completion.text, finish_reason=completion.finish_reason,
                 num_output_tokens=len(completion.token_ids), token_ids=list(completion.token_ids))
        if out.error or completion.finish_reason in ("error", "abort"):
            r["error"] = out.error or f"the request finished with finish_reason={completion.finish_reason!r}"
        else:
            r["correct"] = completion.text.strip() == items[i].answer
        if out.spec_decode is not None:
            _add_spec(spec, out.spec_decode)
    return _record(llm, items, results, elapsed, output_tokens, spec,
                   dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens))


def _add_spec(total: SpecDecodeMetrics, one: SpecDecodeMetrics) -> None:
    total.num_steps += one.num_steps
    total.num_draft_tokens += one.num_draft_tokens
    total.num_accepted_tokens += one.num_accepted_tokens
    for name in ("draft_tokens_per_position", "accepted_per_position"):
        mine, theirs = getattr(total, name), getattr(one, name)
        mine += [0] * (len(theirs) - len(mine))
        for j, v in enumerate(theirs):
            mine[j] += v


def _record(llm, items, results, elapsed, output_tokens, spec: SpecDecodeMetrics, sampling: dict) -> dict:
    engine = llm.engine
    per_task: dict[str, dict] = {}
    for r in results:
        t = per_task.setdefault(r["task"], {"num_items": 0, "correct": 0, "errors": 0})
        t["num_items"] += 1
        t["correct"] += int(r["correct"])
        t["errors"] += int(r["error"] is not None)
    for t in per_task.values():
        t["accuracy"] = t["correct"] / t["num_items"]
    correct = sum(int(r["correct"]) for r in results)
    spec_on = engine.spec_config is not None
    verified = spec_on and spec.num_steps > 0
    plan = engine.plan
    return {
        "accuracy": correct / len(items) if items else 0.0,
        "correct": correct,
        "num_items": len(items),
        "errors": sum(int(r["error"] is not None) for r in results),
        "per_task": dict(sorted(per_task.items())),
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / elapsed if elapsed > 0 else None,
        "acceptance_rate": spec.acceptance_rate if verified else None,
        "mean_acceptance_length": spec.mean_acceptance_length if verified else None,
        "spec_decode": spec.as_dict() if spec_on else None,
        "speculative_config": dataclasses.asdict(engine.spec_config) if spec_on else None,
        "model": str(engine.model_path),
        "layout": {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "ep": plan.ep_size, "sp": plan.sp},
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_num_seqs": engine.max_num_seqs,
        "sampling": sampling,
        "results": results,
    }


# ---- report -------------------------------------------------------------------------------
def format_report(record: dict) -> str:
    """A short human-readable table of a record from `evaluate`."""
    layout = record["layout"]
    lines = [
        f"model: {record['model']}",
        f"layout: tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} ep={layout['ep']}"
        + (f"  speculative: {_describe_spec(record['speculative_config'])}" if record["speculative_config"] else ""),
        "",
        "| task | items | correct | errors | accuracy |",
        "|---|---:|---:|---:|---:|",
    ]
    rows = list(record["per_task"].items()) + [("all", {
        "num_items": record["num_items"], "correct": record["correct"], "errors": record["errors"],
        "accuracy": record["accuracy"]})]
    for task, t in rows:
        lines.append(f"| {task} | {t['num_items']} | {t['correct']} | {t['errors']} | {100 * t['accuracy']:.1f}% |")
    tps = record["output_tok_per_s"]
    lines += ["", f"elapsed {record['elapsed_s']:.2f} s, {record['output_tokens']} output tokens"
              + (f", {tps:.1f} output tok/s" if tps is not None else "")]
    if record["speculative_config"]:
        if record["acceptance_rate"] is None:
            lines.append("speculative decoding: no drafts were verified")
        else:
            lines.append(f"acceptance rate {record['acceptance_rate']:.3f}, "
                         f"mean acceptance length {record['mean_acceptance_length']:.2f}")
    failed = [r for r in record.get("results", []) if r["error"] is not None]
    if failed:
        lines.append(f"first error (item {failed[0]['id']!r}): {failed[0]['error']}")
    return "\n".join(lines)


def _describe_spec(config: dict) -> str:
    return f"{config['method']} k={config['num_speculative_tokens']} (policy {config['policy']})"


# ---- the command ----------------------------------------------------------------------------
def add_eval_parser(subparsers) -> None:
    from lamina.entrypoints import cli

    p = subparsers.add_parser("eval", help="accuracy of a model on an evaluation set (demo: the built-in model's)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=SUITES, help="the eval suite (demo: exact match on <model>/eval.jsonl)")
    cli.add_engine_args(p)
    cli.add_parallel_args(p)
    e = p.add_argument_group("evaluation")
    e.add_argument("--eval-file", default=None, help="the eval set, JSON lines (default: <model>/eval.jsonl)")
    e.add_argument("--limit", type=_positive_int, default=None, help="evaluate only the first N items")
    e.add_argument("--concurrency", type=_positive_int, default=None,
                   help=f"sequences in flight, i.e. --max-num-seqs (default {DEFAULT_CONCURRENCY})")
    e.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS,
                   help=f"for items without max_tokens (default {DEFAULT_MAX_TOKENS})")
    e.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    e.add_argument("--top-p", type=float, default=1.0)
    e.add_argument("--top-k", type=int, default=0)
    e.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    e.add_argument("--json", action="store_true", help="print one JSON object (the record) to stdout")
    e.add_argument("--output-json", default=None, metavar="FILE",
                   help="also write the record with every item's output here")
    p.set_defaults(func=run_eval)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def default_model_path() -> str:
    from lamina.models.default_model import ensure_default_model

    return str(ensure_default_model())


def run_eval(args: argparse.Namespace) -> int:
    from lamina import LLM
    from lamina.entrypoints.cli import engine_kwargs
    if args.node_rank > 0:  # a secondary node of a multi-node layout: run its ranks headless
        from lamina.config import EngineArgs
        from lamina.engine.mp_executor import run_headless_node

        return run_headless_node(EngineArgs(model=args.model, **engine_kwargs(args)))
    if args.concurrency is not None and args.max_num_seqs is not None and args.concurrency != args.max_num_seqs:
        raise ValueError(f"--concurrency {args.concurrency} and --max-num-seqs {args.max_num_seqs} disagree: "
                         "give one (they are the same setting)")
    model = args.model or default_model_path()
    eval_file = Path(args.eval_file) if args.eval_file else Path(model) / "eval.jsonl"
    if not eval_file.is_file():
        hint = "" if args.eval_file else f" (the {args.suite} suite reads <model>/eval.jsonl; pass --eval-file PATH)"
        raise FileNotFoundError(f"no eval set at {eval_file}{hint}")
    items = load_eval_items(eval_file, args.limit)
    progress = not args.json and sys.stderr.isatty()
    kwargs = engine_kwargs(args)
    kwargs["max_num_seqs"] = args.max_num_seqs or args.concurrency  # None: eval's default, which the GPU's memory
    kwargs["default_max_num_seqs"] = DEFAULT_CONCURRENCY  # plan may lower like the engine's (lamina.engine.memory_plan)
    kwargs["show_progress"] = progress
    with LLM(model, **kwargs) as llm:
        record = evaluate(llm, items, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.sampling_seed, max_tokens=args.max_tokens, progress=progress)
    record = {"suite": args.suite, "eval_file": str(eval_file), **record}
    results = record.pop("results")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({**record, "results": results}, indent=2) + "\n")
    if args.json:
        print(json.dumps(record))
    else:
        print(format_report({**record, "results": results}))
    return 0

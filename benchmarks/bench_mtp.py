"""Added cost per decode step of MTP speculation with K = 1, 2, 3 draft tokens, vs K = 0, at
batch 1 and 64, on a real-width random config (Qwen3.5-35B-A3B shape, few layers + 1 MTP layer).

    python benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --out mtp.json   # GPU, bf16 (docs/PERFORMANCE.md)
    python benchmarks/bench_mtp.py --layers 40 --new-tokens 64 --enforce-eager --out mtp_eager.json  # no graphs
    python benchmarks/bench_mtp.py --device cpu --tiny                          # a quick CPU smoke run

Weights are seeded random (`load_format="dummy"`), so drafts are mostly rejected: the figure is
the cost of proposing and verifying K drafts, not the speed-up a trained checkpoint would get.
Rows: a plain engine (no drafter), then one engine built with K = 3 run at fixed k = 0..3
(k = 0 still runs the drafter's first pass, which keeps its KV history) and with the auto policy
("mtp-*"), then the same engine with every draft replaced by the plain run's next tokens
("oracle-*": all drafts accepted, the ceiling a perfect drafter would reach at this cost).
Every row's greedy output is compared with the plain run's ("identical_to_plain").

`--rounds R` runs the drafter engine's modes R times, alternating (k = 0, 1, .., auto, then again):
a row's `median_step_ms` is then the median of all its rounds' steps, `round_medians_ms` each
round's, and `added_ms_vs_k0` its cost over fixed k = 0 in the same process. The plain engine is
another process-lifetime's model (the two never fit together), and the same command has moved by
up to 50% between processes on the H200 machines (docs/PERFORMANCE.md, session 18): compare K
against k = 0, not against plain, when deciding anything.

`--with-async` adds every "mtp-*" mode with asynchronous scheduling ("mtp-*-async": the next
step planned before this one's accepted counts reach the host, lamina.engine.async_scheduling),
alternating with the synchronous ones; those steps are timed without a device sync, as the wall
time between two `step()` returns.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina import LLM, SamplingParams  # noqa: E402

REAL = dict(
    vocab_size=248320, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
)
TINY = dict(
    vocab_size=1024, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
)


def write_config(path: Path, shape: dict, layers: int, max_positions: int = 4096) -> Path:
    from transformers import Qwen3_5MoeTextConfig

    layer_types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)]
    config = Qwen3_5MoeTextConfig(num_hidden_layers=layers, layer_types=layer_types, max_position_embeddings=max_positions,
                                  eos_token_id=shape["vocab_size"] - 1, mtp_num_hidden_layers=1, **shape)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    config.save_pretrained(path)
    return path


def timed_run(llm: LLM, prompts: list, new_tokens: int) -> dict:
    """Median time of the steps in which every request of the batch decodes (no prefill)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    before = engine.spec_decode_metrics.as_dict() if engine.spec_decode_metrics is not None else None
    for p in prompts:
        engine.add_request(p, params)
    sync = torch.cuda.synchronize if torch.cuda.is_available() and engine.device.type == "cuda" else (lambda: None)
    # Asynchronous scheduling: no device sync around a step (it would undo the overlap); a step's
    # time is then the wall time between two step() returns (in steady decoding, the period).
    if engine.async_scheduling:
        sync = lambda: None  # noqa: E731
    times, ks, lengths, finals = [], [], {}, {}
    overlapped_before = engine.num_overlapped_steps
    window_tokens, window_s = 0, 0.0
    t_end = time.perf_counter()
    while engine.has_unfinished_requests():
        waiting = engine.num_waiting
        sync()
        t0 = t_end if engine.async_scheduling else time.perf_counter()
        outs = engine.step()
        sync()
        t_end = time.perf_counter()
        elapsed = t_end - t0
        new = {o.request_id: len(o.outputs[0].token_ids) for o in outs}
        if waiting == 0 and len(outs) == len(prompts) and all(lengths.get(r, 0) >= 1 for r in new):
            times.append(elapsed)  # every request was decoding: no prompt token in this step
            ks.append(engine.num_draft_tokens)
            window_tokens += sum(n - lengths[r] for r, n in new.items())
            window_s += elapsed
        lengths.update(new)
        for o in outs:
            if o.finished:
                finals[tuple(o.prompt_token_ids)] = list(o.outputs[0].token_ids)
    row = {"step_ms": [t * 1e3 for t in times]}  # popped by `merge_rounds`
    times = sorted(times)
    row |= {"median_step_ms": times[len(times) // 2] * 1e3 if times else float("nan"), "steps_timed": len(times),
           "mean_k": sum(ks) / len(ks) if ks else 0.0,
           "decode_tok_s": window_tokens / window_s if window_s else float("nan"),
           "overlapped_steps": engine.num_overlapped_steps - overlapped_before}
    if before is not None:
        after = engine.spec_decode_metrics.as_dict()
        steps = after["num_steps"] - before["num_steps"]
        drafts = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        row["verify_steps"], row["draft_tokens"], row["accepted_tokens"] = steps, drafts, accepted
    return row, finals


def profile_steps(llm: LLM, prompts: list, out: Path, steps: int = 3, timeline: bool = False) -> None:
    """Operator table (self time, CPU and device) of a few decode steps once the batch decodes;
    with `timeline`, also the Chrome trace (`out` with .trace.json) and its per-step summary
    (`out` with .timeline.json, benchmarks/timeline.py): device busy / idle time of each step and
    the host work its largest idle gaps waited on."""
    from torch.profiler import ProfilerActivity, profile

    from timeline import annotate, summarise

    out.parent.mkdir(parents=True, exist_ok=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8 + steps, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(4):  # prefill and the first decode steps
        engine.step()
    runner = engine.executor.runner if timeline else None  # in-process executors only
    spec = getattr(runner, "spec", None)
    labels = [(engine, "step", "step"), (engine.scheduler, "schedule", "schedule"),
              (runner, "prepare", "runner.prepare"), (runner, "commit_spec_states", "commit_spec_states"),
              (runner, "apply_cache_copies", "apply_cache_copies"), (runner, "replay_decode", "replay_decode"),
              (runner, "_sample_launch", "sample_launch"), (runner.verify_graphs, "run", "verify_graphs.run"),
              (spec, "capture_for", "spec.capture_for"), (spec, "finish_step", "spec.finish_step"),
              (spec, "_verify", "spec.verify"), (spec, "_results", "spec.results"),
              (getattr(spec, "proposer", None), "first_pass", "proposer.first_pass"),
              (getattr(spec, "proposer", None), "propose", "proposer.propose")] if timeline else []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with annotate(labels), profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    sort = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    out.write_text(prof.key_averages().table(sort_by=sort, row_limit=40)
                   + "\n\nby CPU time\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    if timeline:
        trace = out.with_suffix(".trace.json")
        prof.export_chrome_trace(str(trace))
        summary = summarise(trace)
        out.with_suffix(".timeline.json").write_text(json.dumps(summary, indent=1))
        for row in summary["steps"]:
            print(json.dumps({k: v for k, v in row.items() if k != "largest_gaps"}), flush=True)
            for gap in row.get("largest_gaps", [])[:6]:
                print("   ", json.dumps(gap), flush=True)
        print(json.dumps(summary["host_labels_us"]), flush=True)


def merge_rounds(rounds: list[dict]) -> dict:
    """One row from the same mode's rounds: the median over all their timed steps, each round's
    median, and the counters summed (the last round's output is the one compared)."""
    steps = sorted(t for r in rounds for t in r.pop("step_ms"))
    row = dict(rounds[-1])
    row["median_step_ms"] = steps[len(steps) // 2] if steps else float("nan")
    row["steps_timed"] = len(steps)
    if len(rounds) > 1:
        row["round_medians_ms"] = [r["median_step_ms"] for r in rounds]
        row["round_overlapped_steps"] = [r["overlapped_steps"] for r in rounds]
        for key in ("verify_steps", "draft_tokens", "accepted_tokens", "overlapped_steps"):
            if key in row:
                row[key] = sum(r[key] for r in rounds)
    return row


def compare(reference: dict, logprobs: dict, out: dict) -> dict:
    """How a run's greedy sequences compare with the plain run's. At a sequence's first differing
    token both runs had the same context, so the plain run's top-20 logprobs there say whether the
    two choices were a near-tie (rounding) or not: `worst_gap` is the largest plain logprob of
    the plain choice minus that of the other run's choice (None when some choice fell outside the
    top 20)."""
    identical, gaps, first = 0, [], []
    for key, ref in reference.items():
        got = out.get(key, [])
        d = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        if d is None and len(got) == len(ref):
            identical += 1
            continue
        d = min(len(ref), len(got)) if d is None else d
        first.append(d)
        top = logprobs[key][d] if d < len(logprobs[key]) else {}
        gaps.append(top[ref[d]] - top[got[d]] if d < len(got) and got[d] in top else None)
    return {"identical_to_plain": identical == len(reference), "sequences_identical": identical,
            "sequences": len(reference), "first_divergence": min(first) if first else None,
            "worst_gap": None if None in gaps else max(gaps, default=0.0)}


def bench_batch(
    path: Path, device: str, dtype: str, batch: int, new_tokens: int, vocab: int, max_k: int,
    profile_dir: str | None = None, enforce_eager: bool = False, rounds: int = 1, timeline: bool = False,
    with_async: bool = False,
) -> list[dict]:
    """One plain engine (the baseline) and one engine built with K = max_k, switched between
    fixed k = 0..max_k and the auto policy: every row of a batch size comes from the same two
    loaded models, measured one after the other."""
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(0, vocab - 1) for _ in range(64)]} for _ in range(batch)]
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    common = dict(device=device, dtype=dtype, load_format="dummy",
                  max_model_len=1024, max_num_seqs=batch, show_progress=False, enforce_eager=enforce_eager)
    rows = []
    llm = LLM(str(path), **common)
    llm.generate(prompts, warm, use_tqdm=False)
    plain, reference = timed_run(llm, prompts, new_tokens)
    plain.pop("step_ms")
    rows.append({"mode": "plain", "k": 0, "batch": batch, "cuda_graphs": llm.engine.cuda_graphs, **plain})
    # the plain run again, untimed, with top-20 logprobs: judges any later difference
    with_lp = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=20),
                           use_tqdm=False)
    logprobs = {tuple(o.prompt_token_ids): o.outputs[0].logprobs for o in with_lp}
    rows[0]["repeat_identical"] = all(list(o.outputs[0].token_ids) == reference[tuple(o.prompt_token_ids)] for o in with_lp)
    if profile_dir is not None and timeline:  # plain decode steps on the same timeline, for comparison
        profile_steps(llm, prompts, Path(profile_dir) / f"profile_b{batch}_plain.txt", timeline=True)
    llm.shutdown()
    del llm
    gc.collect()  # the two engines are never resident together (a 40-layer model is ~67 GB in bf16)
    if device == "cuda":
        torch.cuda.empty_cache()
        print(f"after releasing the plain engine: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated", flush=True)
    spec = {"method": "mtp", "num_speculative_tokens": max_k}
    llm = LLM(str(path), speculative_config=spec, **common)
    llm.generate(prompts, warm, use_tqdm=False)
    policy = llm.engine.spec_policy
    verify = llm.engine.executor.runner.verify_graphs
    graph_info = {"cuda_graphs": llm.engine.cuda_graphs,
                  "verify_graphs": len(verify.graphs) if verify is not None else 0,
                  "verify_capture_gib": verify.buffers.nbytes / 2**30 if verify is not None and verify.buffers else 0.0}

    def alternate(modes: list[tuple[str, int, bool]], label: str) -> None:
        """Every mode (policy, k, asynchronous scheduling) once a round, `rounds` rounds; one
        merged row per mode."""
        runs: dict[tuple[str, int, bool], list] = {mode: [] for mode in modes}
        for _ in range(rounds):
            for mode, k, overlap in modes:
                policy.set_policy(mode, k)
                llm.engine.async_scheduling = overlap
                runs[(mode, k, overlap)].append(timed_run(llm, prompts, new_tokens))
        llm.engine.async_scheduling = False
        for (mode, k, overlap), done in runs.items():
            row = merge_rounds([r for r, _ in done])
            rows.append({"mode": f"{label}-{mode}{'-async' if overlap else ''}", "k": k, "batch": batch,
                         "async_scheduling": overlap, **graph_info, **compare(reference, logprobs, done[-1][1]), **row})

    overlaps = (False, True) if with_async else (False,)
    alternate([("fixed", k, o) for k in range(max_k + 1) for o in overlaps] + [("auto", max_k, o) for o in overlaps], "mtp")

    def oracle(request, proposed):  # the plain run's next tokens: every draft is right
        ahead = reference[tuple(request.prompt_token_ids)][len(request.output_token_ids):][: len(proposed)]
        return ahead + [0] * (len(proposed) - len(ahead))

    llm.engine.draft_override = oracle
    alternate([("fixed", k, False) for k in range(1, max_k + 1)] + [("auto", max_k, False)], "oracle")
    llm.engine.draft_override = None
    if profile_dir is not None:  # decode steps at fixed k = 1 (and k = 0 with --timeline) under torch.profiler
        for k in ([0, 1] if timeline else [1]):
            policy.set_policy("fixed", min(k, max_k))
            profile_steps(llm, prompts, Path(profile_dir) / f"profile_b{batch}_k{k}.txt", timeline=timeline)
        if with_async:  # k = 1 again, planned ahead
            policy.set_policy("fixed", min(1, max_k))
            llm.engine.async_scheduling = True
            profile_steps(llm, prompts, Path(profile_dir) / f"profile_b{batch}_k1_async.txt", timeline=timeline)
            llm.engine.async_scheduling = False
    llm.shutdown()
    del llm, policy, verify, alternate  # the verify graphs and their buffers too: the next batch size builds two engines
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    base = rows[0]["median_step_ms"]
    k0 = next(r["median_step_ms"] for r in rows if r["mode"] == "mtp-fixed" and r["k"] == 0)
    for r in rows:
        r["added_ms_vs_plain"] = r["median_step_ms"] - base
        if r["mode"] != "plain":
            r["added_ms_vs_k0"] = r["median_step_ms"] - k0
        print(json.dumps(r), flush=True)
    return rows, reference, logprobs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--max-k", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--profile-dir", default=None, help="also write an operator table of k=1 steps here")
    parser.add_argument("--timeline", action="store_true",
                        help="with --profile-dir: also k = 0, Chrome traces and per-step device idle gaps (benchmarks/timeline.py)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the drafter engine's modes this many times, alternating; rows merge the rounds")
    parser.add_argument("--with-async", action="store_true",
                        help="also every MTP mode with asynchronous scheduling (rows `mtp-*-async`; the oracle's "
                             "planted drafts keep steps synchronous)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs (plain decode and MTP verification steps run eagerly)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    shape = TINY if args.tiny else REAL
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    path = write_config(Path(tempfile.mkdtemp()) / "cfg", shape, args.layers)
    rows, plain_runs = [], []
    batches = [int(b) for b in args.batches.split(",")]

    def write(across: list, complete: bool) -> None:
        """The JSON so far: rewritten after every batch size, so a later batch's failure keeps
        the earlier rows (`complete` false until the last)."""
        if args.out:
            result = {"device": args.device, "plain_across_batch_sizes": across,
                      "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                      "torch": torch.__version__, "dtype": dtype,
                      "config": ("tiny" if args.tiny else "Qwen3.5-35B-A3B shape") + f", {args.layers} layers + 1 MTP layer",
                      "enforce_eager": args.enforce_eager, "command": " ".join(sys.argv),
                      "batches_done": [b for b, _, _ in plain_runs], "complete": complete, "rows": rows}
            Path(args.out).write_text(json.dumps(result, indent=2))

    for batch in batches:
        batch_rows, reference, logprobs = bench_batch(path, args.device, dtype, batch, args.new_tokens, shape["vocab_size"], args.max_k, args.profile_dir,
                                                    args.enforce_eager, args.rounds, args.timeline, args.with_async)
        rows += batch_rows
        plain_runs.append((batch, reference, logprobs))
        write([], complete=False)
    # Plain decoding alone, across batch sizes: the first prompts of every batch are the same, so
    # this says how much the output moves when only the batch shape changes (no speculation).
    across = []
    for (b1, ref1, lp1), (b2, ref2, _) in zip(plain_runs, plain_runs[1:]):
        shared = {key: ref1[key] for key in ref1 if key in ref2}
        across.append({"batches": [b1, b2], **compare(shared, lp1, {key: ref2[key] for key in shared})})
    print(json.dumps({"plain_across_batch_sizes": across}), flush=True)
    write(across, complete=True)


if __name__ == "__main__":
    main()

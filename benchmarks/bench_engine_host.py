"""Host time of the engine's own work per step: scheduling, output processing, detokenization.

The model is replaced by an executor that returns its tokens at once (`InstantExecutor`), so
what is timed is everything `LLMEngine.step` does on the host around a forward: planning the
step, advancing the requests, detokenizing and checking stops, building outputs. On a GPU this
work either sits between device steps (MTP steps, which run without asynchronous scheduling) or
must finish within one (asynchronous scheduling), so it bounds high-concurrency decode.

    python benchmarks/bench_engine_host.py --batches 1,64,256 --output-len 256 --out host.json

`--spec-k K` runs the engine with MTP speculative decoding (the demo model has an MTP layer):
every verification accepts `--accepted` of its K drafts. `--path engine` drives
`LLMEngine.step()` directly with the default cumulative outputs (what the server reads);
`generate` (default) goes through `LLM.generate`. Only the lamina on `sys.path` is timed, so
the same script times another tree with `PYTHONPATH=that/tree`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from lamina import LLM, SamplingParams
from lamina.step_plan import SampledToken
from lamina.worker.pending_step import ReadyStep

FIRST_TOKEN = 100  # ordinary vocabulary ids of the demo model's tokenizer (its specials are at 509-511)
NUM_TOKENS = 400


class InstantExecutor:
    """Answers every plan at once with deterministic tokens (and drafts under MTP)."""

    def __init__(self, inner, spec_k: int, accepted: int):
        self.inner = inner
        self.spec_k = spec_k
        self.accepted = accepted
        self.num_steps = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _token(self, i: int) -> int:
        return FIRST_TOKEN + (self.num_steps * 7 + i * 13) % NUM_TOKENS

    def _results(self, plan) -> dict[str, SampledToken]:
        self.num_steps += 1
        results = {}
        for i, chunk in enumerate(plan.chunks):
            if not chunk.sample:
                continue
            accepted = min(self.accepted, chunk.num_draft_tokens)
            results[chunk.request_id] = SampledToken(
                self._token(i), accepted_token_ids=[self._token(i + 1 + j) for j in range(accepted)],
                accepted_logprobs=[None] * accepted, num_draft_tokens=chunk.num_draft_tokens,
                draft_token_ids=[self._token(i + 50 + j) for j in range(plan.num_draft_tokens)],
            )
        return results

    def execute_replicas(self, plans):
        return [self._results(plan) for plan in plans]

    def launch(self, plan):
        return ReadyStep(self._results(plan))


def run_once(llm: LLM, batch: int, output_len: int, path: str) -> tuple[float, int]:
    """(wall seconds, engine steps) of one batch of `batch` requests generating `output_len` tokens."""
    executor = llm.engine.executor
    steps_before = executor.num_steps
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": [FIRST_TOKEN + (i * 31 + j) % NUM_TOKENS for j in range(16)]} for i in range(batch)]
    started = time.perf_counter()
    if path == "generate":
        llm.generate(prompts, params, use_tqdm=False)
    else:
        engine = llm.engine
        for prompt in prompts:
            engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    return time.perf_counter() - started, executor.num_steps - steps_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in demo model)")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spec-k", type=int, default=0)
    parser.add_argument("--accepted", type=int, default=1, help="drafts each verification accepts (MTP)")
    parser.add_argument("--path", choices=("generate", "engine"), default="generate")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import lamina

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": args.spec_k}} if args.spec_k else {}
        llm = LLM(args.model, device="cpu", dtype="float32", show_progress=False, max_num_seqs=batch,
                  max_model_len=args.output_len + 16 + args.spec_k + 1, **spec)
        llm.engine.executor = InstantExecutor(llm.engine.executor, args.spec_k, args.accepted)
        run_once(llm, min(batch, 4), 8, args.path)  # warm-up
        walls, steps = [], 0
        for _ in range(args.repeats):
            wall, steps = run_once(llm, batch, args.output_len, args.path)
            walls.append(wall)
        llm.shutdown()
        wall = statistics.median(walls)
        row = {
            "batch": batch, "output_len": args.output_len, "spec_k": args.spec_k, "path": args.path,
            "steps": steps, "us_per_step": wall / steps * 1e6, "us_per_request_step": wall / steps / batch * 1e6,
            "walls_s": walls,
        }
        rows.append(row)
        print(f"{args.label} batch {batch:4d}  out {args.output_len}  k {args.spec_k}  {args.path}: {steps} steps, "
              f"{row['us_per_step']:.1f} us a step, {row['us_per_request_step']:.2f} us a request-step", flush=True)
    if args.out:
        record = {
            "kind": "engine_host", "label": args.label, "lamina": lamina.__file__, "python": platform.python_version(),
            "machine": platform.processor() or platform.machine(), "args": vars(args), "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

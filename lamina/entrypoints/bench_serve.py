"""`lamina bench serve`: measure a running `lamina serve` (or any OpenAI-compatible server) over HTTP,
as vLLM's `vllm bench serve` does.

`--num-prompts` prompts of exactly `--input-len` random token ids (sent as token-id prompts to
/v1/completions; /v1/chat/completions gets them decoded to text, so there the input length is
approximate and the prompt tokens counted are the server's) each ask for `--output-len` tokens with
`ignore_eos` (exact output lengths), streamed. They arrive all at once (`--request-rate inf`) or as
a seeded Poisson process, at most `--max-concurrency` in flight; each value of `--max-concurrency`
is one run over the same prompts.

Per request: TTFT (to the first chunk with content), ITL (the gaps between content chunks; a chunk
can carry more than one token), TPOT ((e2e - TTFT) / (output tokens - 1), output tokens from the
stream's usage) and the end-to-end latency. Per run: request and token throughput over the run's
wall time, and mean, median, p90 and p99 of each latency. A markdown table is printed; the records
(one per concurrency) go to `--output-json`, and with matplotlib installed `--plot` draws output
tok/s against concurrency. Random ids are drawn from the tokenizer's base vocabulary without its
special tokens: the tokenizer is `--tokenizer`, else the server's model directory (the `root` of
its /v1/models entry) when it is readable from here. Without a tokenizer (`--tokenizer none`,
`--skip-tokenizer-init`, or a server started with `--skip-tokenizer-init` or `--preset`) they are
drawn from [0, vocab_size) of the server's /v1/models entry and sent as token ids to
/v1/completions; see lamina/entrypoints/bench_prompts.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lamina.entrypoints.bench_prompts import PromptSource, choose_source, make_prompts, server_has_tokenizer

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
LATENCIES = ("ttft", "tpot", "itl", "e2e")


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server benchmark")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    g.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS)
    g.add_argument("--model", default=None, help="model name to send (default: the first id of /v1/models)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: the server's model directory, if readable here); 'none': "
                        "random ids of [0, vocab_size) as token-id prompts")
    g.add_argument("--skip-tokenizer-init", action="store_true", help="the same as --tokenizer none")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="without a tokenizer: draw ids from [0, N) (default: the server's reported vocab_size)")
    g.add_argument("--api-key", default=os.environ.get("LAMINA_API_KEY"), help="bearer key (default: $LAMINA_API_KEY)")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                   help="most requests in flight; several values: one run each (default: no limit)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so every output is exactly --output-len tokens (default: on)")
    g.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds to wait for each read of a response (default: %(default)s)")
    g.add_argument("--output-json", default=None, help="write the records (a JSON list) here")
    g.add_argument("--plot", default=None, help="write a PNG of output tok/s against concurrency (needs matplotlib)")


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0


def _has_content(choice: dict) -> bool:
    if choice.get("text") or choice.get("token_ids"):  # token ids: a server without a tokenizer
        return True
    delta = choice.get("delta") or {}
    return any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))


async def _request(client, url: str, payload: dict) -> Result:
    res = Result()
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return res
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"].get("prompt_tokens")
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                if any(_has_content(c) for c in obj.get("choices") or []):
                    chunks += 1
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal to the run
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks  # no usage in the stream: count content chunks
    if res.ttft is None:
        res.error = "the stream carried no content"
    else:
        res.ok = True
    return res


def _payload(args, model: str, prompt: list[int] | str, token_ids: bool = False) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
            "max_tokens": args.output_len, "ignore_eos": args.ignore_eos}
    if token_ids:  # no tokenizer: the chunks carry token ids, not text
        body["return_token_ids"] = True
    if args.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _client(args):
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout, connect=args.connect_timeout, pool=None)
    # no pool limit: the concurrency under test is the benchmark's semaphore, never httpx's pool (100)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, timeout=timeout, limits=limits)


async def _server_card(client, args) -> dict:
    import httpx

    try:
        resp = await client.get("/v1/models")
    except httpx.TransportError as e:
        raise ConnectionError(f"cannot reach the server at {args.base_url} ({type(e).__name__}: {e or 'no answer'}); "
                              "start one with `lamina serve MODEL` or pass --base-url") from None
    if resp.status_code != 200:
        raise ConnectionError(f"{args.base_url}/v1/models answered HTTP {resp.status_code}: {resp.text[:300]}")
    cards = resp.json().get("data") or []
    if not cards:
        raise ValueError(f"{args.base_url}/v1/models lists no model")
    chosen = next((c for c in cards if c.get("id") == args.model), None) if args.model else cards[0]
    if chosen is None:
        raise ValueError(f"the server does not serve {args.model!r}; it serves {[c.get('id') for c in cards]}")
    return chosen


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0, or a Poisson process of `rate`/s."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    t, times = 0.0, []
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def _run_one(client, args, model: str, prompts, concurrency: int | None,
                   token_ids: bool = False) -> tuple[list[Result], float]:
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    times = arrival_times(len(prompts), args.request_rate, args.seed)
    start = time.perf_counter()

    async def one(prompt, at: float) -> Result:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        if limit is None:
            return await _request(client, args.endpoint, _payload(args, model, prompt, token_ids))
        async with limit:
            return await _request(client, args.endpoint, _payload(args, model, prompt, token_ids))

    results = await asyncio.gather(*(one(p, at) for p, at in zip(prompts, times)))
    return list(results), time.perf_counter() - start


def _stats(values: list[float]) -> tuple[float | None, dict]:
    import numpy as np

    if not values:
        return None, {"median": None, "p90": None, "p99": None}
    ms = np.asarray(values) * 1e3
    return float(ms.mean()), {"median": float(np.median(ms)), "p90": float(np.percentile(ms, 90)),
                              "p99": float(np.percentile(ms, 99))}


def summarize(args, model: str, results: list[Result], duration: float, concurrency: int | None,
              card: dict | None = None, source: PromptSource | None = None) -> dict:
    from lamina.entrypoints.bench import command_line, with_shared_keys

    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else args.input_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    latencies = {
        "ttft": [r.ttft for r in done], "e2e": [r.e2e for r in done],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
    }
    record = {
        "kind": "serve", "command": command_line(args), "gpu": (card or {}).get("device_name"), "model": model,
        "dtype": (card or {}).get("dtype"), "prompt_source": source.describe() if source else None,
        "base_url": args.base_url, "endpoint": args.endpoint, "concurrency": concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "num_prompts": len(results), "completed": len(done), "failed": len(results) - len(done),
        "input_len": args.input_len, "output_len": args.output_len, "ignore_eos": args.ignore_eos,
        "input_tokens": input_tokens, "output_tokens": output_tokens, "duration_s": duration,
        "request_throughput": len(done) / duration, "output_tok_per_s": output_tokens / duration,
        "total_tok_per_s": (input_tokens + output_tokens) / duration,
    }
    for name in LATENCIES:
        record[f"{name}_ms"], record[f"{name}_ms_percentiles"] = _stats(latencies[name])
    errors = sorted({r.error for r in results if r.error})
    if errors:
        record["errors"] = errors[:5]
    return with_shared_keys(record)  # hbm_roofline_fraction, bytes_per_step, baseline...: latency-bench figures


async def _bench(args) -> list[dict]:
    async with _client(args) as client:
        card = await _server_card(client, args)
        model = args.model or card["id"]
        limit = card.get("max_model_len")
        if limit and args.input_len + args.output_len > limit:
            raise ValueError(f"--input-len + --output-len = {args.input_len + args.output_len} is more than the "
                             f"server's max_model_len {limit}")
        source = choose_source(args, card, await server_has_tokenizer(client))
        as_text = args.endpoint.endswith("/chat/completions")
        prompts = make_prompts(source, args.num_prompts, args.input_len, args.seed, as_text)
        ids = not source.has_tokenizer
        print(f"lamina bench serve: {model} at {args.base_url}, prompts: {source.describe()}", file=sys.stderr)
        probe = await _request(client, args.endpoint, _payload(args, model, prompts[0], ids))  # checks and warms up
        if not probe.ok:
            raise ValueError(f"the test request to {args.base_url}{args.endpoint} failed: {probe.error}")
        records = []
        for concurrency in args.max_concurrency:
            results, duration = await _run_one(client, args, model, prompts, concurrency, ids)
            records.append(summarize(args, model, results, duration, concurrency, card, source))
        return records


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["concurrency"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["concurrency"] for r in rows], [r["output_tok_per_s"] for r in rows], "o-", label="output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{records[0]['model']} ({records[0]['endpoint']}, in {records[0]['input_len']} / "
                 f"out {records[0]['output_len']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


TABLE = ("concurrency", "request_rate", "num_prompts", "completed", "failed", "input_len", "output_len", "ttft_ms",
         "ttft_p99_ms", "tpot_ms", "tpot_p99_ms", "itl_ms", "e2e_ms", "e2e_p99_ms", "request_throughput",
         "output_tok_per_s", "total_tok_per_s")


def serve_table(records: list[dict]) -> str:
    """The markdown table `lamina bench serve` prints (benchmarks/gpu_serve.sh joins several runs' records)."""
    from lamina.entrypoints.bench import markdown_table

    rows = [{**r, "concurrency": "no limit" if r["concurrency"] is None else r["concurrency"],
             **{f"{n}_p99_ms": r[f"{n}_ms_percentiles"]["p99"] for n in LATENCIES}} for r in records]
    return markdown_table(rows, TABLE)


def run_serve_bench(args) -> int:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if any(c is not None and c < 1 for c in args.max_concurrency) or not args.request_rate > 0:
        raise ValueError("--max-concurrency and --request-rate must be positive")
    if args.plot and all(c is None for c in args.max_concurrency):
        raise ValueError("--plot draws output tok/s against --max-concurrency: give at least one value")
    records = asyncio.run(_bench(args))
    print(serve_table(records))
    for r in records:
        if r["failed"]:
            print(f"lamina bench serve: {r['failed']} of {r['num_prompts']} requests failed at concurrency "
                  f"{r['concurrency']}: {r['errors'][0]}", file=sys.stderr)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(records, indent=2))
    if args.plot:
        try:
            plot(records, args.plot)
        except ImportError:
            print("lamina bench: matplotlib is not installed; no plot written", file=sys.stderr)
    return 0 if all(r["completed"] for r in records) else 1

"""The engine-wide `vllm:*` metrics as plain values: what `LLM.get_metrics()` returns (vLLM's
`vllm.v1.metrics.reader` types: Counter, Gauge, Vector, Histogram) and what the server's `/metrics`
exports (lamina.entrypoints.openai.metrics_vllm turns them into Prometheus families at scrape time).

Names, labels (`model_name`, `engine`; lamina runs its data-parallel replicas inside one engine, so
`engine` is "0") and meanings are vLLM's. Per-request histograms (TTFT, inter-token latency, ...) are
the server's: they are timed from arrival over HTTP, so the offline LLM has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINE = "0"
# vllm:cache_config_info's labels (vLLM's names); lamina has no CPU blocks
CACHE_INFO_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                     "num_gpu_blocks", "num_cpu_blocks")


@dataclass
class Metric:
    name: str
    labels: dict[str, str]
    doc: str = field(default="", repr=False, compare=False)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    """A counter per position (vLLM's reader: the `position` label's values, in order)."""

    values: list[int] = field(default_factory=list)


@dataclass
class Histogram(Metric):
    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)  # upper bound ("+Inf" last) -> cumulative count


def engine_metrics(engine, model_name: str, *, num_running: int, num_waiting: int, cache_usage: float) -> list[Metric]:
    """The engine-wide metrics of `engine` (an LLMEngine) now; the request counts and the cache usage
    are passed in (the server reads them from its engine thread's last snapshot)."""
    labels = {"model_name": model_name, "engine": ENGINE}
    out: list[Metric] = [
        Gauge("vllm:num_requests_running", labels, "Requests in the running batch.", num_running),
        Gauge("vllm:num_requests_waiting", labels, "Requests queued for the running batch.", num_waiting),
        Gauge("vllm:kv_cache_usage_perc", labels, "Fraction of KV-cache blocks in use (1 = all).", cache_usage),
        Gauge("vllm:gpu_cache_usage_perc", labels, "Fraction of KV-cache blocks in use (1 = all); the name "
              "before vllm:kv_cache_usage_perc.", cache_usage),
        Counter("vllm:num_preemptions", labels, "Requests preempted since start.", getattr(engine, "num_preemptions", 0)),
        Counter("vllm:prompt_tokens", labels, "Prompt tokens of requests that reached their first token.",
                getattr(engine, "num_prompt_tokens_processed", 0)),
        Counter("vllm:generation_tokens", labels, "Tokens generated.", getattr(engine, "num_generation_tokens_processed", 0)),
    ]
    if getattr(engine, "prefix_caching", False):
        out += [Counter("vllm:prefix_cache_queries", labels, "Prompt tokens looked up in the prefix cache.",
                        engine.num_prefix_cache_queries),
                Counter("vllm:prefix_cache_hits", labels, "Prompt tokens served from kept prefixes.",
                        engine.num_prefix_cache_hits)]
    steps = getattr(engine, "iteration_tokens", None)
    if steps is not None:
        cumulative = steps.cumulative()
        out.append(Histogram("vllm:iteration_tokens_total", labels, "Tokens run by each engine step.",
                             count=cumulative[-1][1], sum=steps.total, buckets=dict(cumulative)))
    args = getattr(engine, "args", None)
    info = dict(zip(CACHE_INFO_LABELS, (
        str(getattr(args, "block_size", "")), str(getattr(args, "kv_cache_dtype", "auto")),  # as configured
        str(bool(getattr(engine, "prefix_caching", False))), str(getattr(args, "gpu_memory_utilization", "")),
        str(getattr(engine, "num_kv_blocks", "")), "None")))
    out.append(Gauge("vllm:cache_config_info", {**labels, **info}, "The KV cache's configuration (value 1).", 1.0))
    spec = getattr(engine, "spec_decode_metrics", None)
    if spec is not None:  # as vLLM: only with speculative decoding
        out += [Counter("vllm:spec_decode_num_drafts", labels, "Verification steps with drafts.", spec.num_steps),
                Counter("vllm:spec_decode_num_draft_tokens", labels, "Draft tokens proposed.", spec.num_draft_tokens),
                Counter("vllm:spec_decode_num_accepted_tokens", labels, "Draft tokens accepted.",
                        spec.num_accepted_tokens),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels,
                       "Draft tokens accepted, by draft position.", list(spec.accepted_per_position))]
    return out

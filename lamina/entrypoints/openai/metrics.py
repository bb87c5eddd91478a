"""Prometheus metrics of one server (its own registry, so several servers can live in one process):
lamina's `lamina_*` series here, vLLM's `vllm:*` names beside them (metrics_vllm.py)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from lamina.engine.async_engine import AsyncEngine
from lamina.entrypoints.openai.metrics_vllm import VllmMetrics

OUTCOMES = ("success", "bad_request", "rejected", "aborted", "error")

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class _EngineCountersCollector(Collector):
    """The engine's preemption and speculative (MTP) decoding counters, read at scrape time (spec decode:
    0 when it does not draft)."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        llm = self.engine.engine
        yield CounterMetricFamily("lamina_num_preemptions", "Requests preempted (cache freed, to be recomputed)",
                                  value=float(getattr(llm, "num_preemptions", 0)))
        yield CounterMetricFamily(
            "lamina_preemption_recompute_tokens", "Computed tokens whose KV cache preemption dropped; each is "
            "computed again when its request resumes", value=float(getattr(llm, "num_preemption_recompute_tokens", 0)))
        spec = getattr(llm, "spec_decode_metrics", None)
        for name, attr, doc in (
            ("lamina_spec_decode_draft_tokens", "num_draft_tokens", "Speculative (MTP) draft tokens proposed"),
            ("lamina_spec_decode_accepted_tokens", "num_accepted_tokens", "Speculative (MTP) draft tokens accepted"),
            ("lamina_spec_decode_verification_steps", "num_steps", "Request-steps that verified drafts"),
        ):
            yield CounterMetricFamily(name, doc, value=float(getattr(spec, attr, 0) or 0))


class ServerMetrics:
    """`lamina_*` series. Counters and histograms move as requests end; gauges read the engine's
    latest stats at scrape time."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lamina_requests", "Requests by endpoint and outcome "
            "(success, bad_request: 4xx, rejected: 503 at admission, aborted: client gone or shutdown, "
            "error: engine failure)", ["endpoint", "outcome"], registry=r,
        )
        for endpoint in ("completions", "chat"):
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        self.prompt_tokens = Counter("lamina_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("lamina_generation_tokens", "Generated tokens of finished requests", registry=r)
        self.ttft = Histogram(
            "lamina_time_to_first_token_seconds", "From request arrival to its first generated token",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "lamina_time_per_output_token_seconds", "Mean time between generated tokens, per request",
            buckets=_TPOT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "lamina_e2e_request_latency_seconds", "From request arrival to its last token",
            buckets=_E2E_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            "lamina_request_queue_time_seconds", "Time a finished request waited for the running batch: its first "
            "wait plus every wait after a preemption", buckets=_WAIT_BUCKETS, registry=r,
        )
        self.prefill_time = Histogram(
            "lamina_request_prefill_time_seconds", "From a finished request's first scheduling to its first token "
            "(prefill, including recomputation after a preemption during it)", buckets=_WAIT_BUCKETS, registry=r,
        )
        r.register(_EngineCountersCollector(engine))
        Gauge("lamina_num_requests_waiting", "Requests queued, not yet scheduled", registry=r).set_function(
            lambda: engine.stats.num_waiting)
        Gauge("lamina_num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: engine.stats.num_running)
        Gauge("lamina_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1)", registry=r).set_function(
            lambda: engine.stats.cache_usage)
        Gauge("lamina_engine_healthy", "1 while the engine loop runs, 0 once it has died", registry=r).set_function(
            lambda: 1.0 if engine.is_healthy else 0.0)
        Gauge("lamina_num_requests_in_flight", "Requests the server is answering", registry=r).set_function(
            lambda: engine.num_in_flight)
        info = Gauge("lamina_model_info", "The served model", ["model_name"], registry=r)
        info.labels(model_name).set(1)
        self.vllm = VllmMetrics(r, engine, model_name)

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()
        if outcome == "aborted":
            self.vllm.count_aborted()

    def observe_finished(self, arrival: float, output) -> None:
        """Record the timing and token counts of a finished request (`output` a RequestOutput)."""
        m = output.metrics
        completion = output.outputs[0]
        num_out = len(completion.token_ids)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(num_out)
        self.vllm.observe_finished(arrival, output)
        if m is None or m.first_token_time is None:
            return
        self.queue_time.observe(m.queue_time)
        if m.first_scheduled_time is not None:
            self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        self.ttft.observe(max(0.0, m.first_token_time - arrival))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - arrival))
            if num_out > 1:
                self.tpot.observe(max(0.0, (m.finished_time - m.first_token_time) / (num_out - 1)))

    def render(self) -> bytes:
        return generate_latest(self.registry)

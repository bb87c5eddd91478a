"""vLLM's `/metrics` series (`vllm:*`), exported beside lamina's own so that dashboards and alerts
written for vLLM work unchanged.

Names, types, labels (`model_name`, `engine`) and histogram buckets are vLLM's (v1 engine). lamina
runs its data-parallel replicas inside one engine, so `engine` is always "0". Gauges and the
engine-wide counters are read from the engine at scrape time; per-request histograms move when a
request finishes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from lamina.engine.async_engine import AsyncEngine

LABELS = ("model_name", "engine")
ENGINE = "0"
FINISH_REASONS = ("stop", "length", "abort", "error")
# vllm:cache_config_info's labels (vLLM's names); lamina has no CPU blocks
CACHE_INFO_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                     "num_gpu_blocks", "num_cpu_blocks")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineCollector(Collector):
    """`vllm:*` gauges and engine-wide counters, read from the engine at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.labels = [model_name, ENGINE]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float, extra: dict[str, str] | None = None) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS + tuple(extra or ()))
        c.add_metric(self.labels + list((extra or {}).values()), value)
        return c

    def collect(self):
        stats = self.engine.stats
        llm = self.engine.engine
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.",
                          stats.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests queued for the running batch.",
                          stats.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all).",
                          stats.cache_usage)
        yield self._gauge("vllm:gpu_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all); the name "
                          "before vllm:kv_cache_usage_perc.", stats.cache_usage)
        yield self._counter("vllm:num_preemptions", "Requests preempted since start.",
                            getattr(llm, "num_preemptions", 0))
        yield self._counter("vllm:prompt_tokens", "Prompt tokens of requests that reached their first token.",
                            getattr(llm, "num_prompt_tokens_processed", 0))
        yield self._counter("vllm:generation_tokens", "Tokens generated.",
                            getattr(llm, "num_generation_tokens_processed", 0))
        if getattr(llm, "prefix_caching", False):
            yield self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                llm.num_prefix_cache_queries)
            yield self._counter("vllm:prefix_cache_hits", "Prompt tokens served from kept prefixes.",
                                llm.num_prefix_cache_hits)
        steps = getattr(llm, "iteration_tokens", None)
        if steps is not None:
            h = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens run by each engine step.", labels=LABELS)
            h.add_metric(self.labels, steps.cumulative(), sum_value=steps.total)
            yield h
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration (value 1).",
                                 labels=LABELS + CACHE_INFO_LABELS)
        args = getattr(llm, "args", None)
        info.add_metric(self.labels + [
            str(getattr(args, "block_size", "")), str(getattr(args, "kv_cache_dtype", "auto")),  # as configured
            str(bool(getattr(llm, "prefix_caching", False))), str(getattr(args, "gpu_memory_utilization", "")), str(getattr(llm, "num_kv_blocks", "")),
            "None"], 1.0)
        yield info
        spec = getattr(llm, "spec_decode_metrics", None)
        if spec is not None:  # as vLLM: only with speculative decoding
            yield self._counter("vllm:spec_decode_num_drafts", "Verification steps with drafts.", spec.num_steps)
            yield self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens)
            yield self._counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                spec.num_accepted_tokens)
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by draft position.", labels=LABELS + ("position",))
            for position, accepted in enumerate(spec.accepted_per_position):
                per_pos.add_metric(self.labels + [str(position)], accepted)
            yield per_pos


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, engine: AsyncEngine, model_name: str):
        r = registry
        r.register(_EngineCollector(engine, model_name))
        max_model_len = getattr(engine.engine, "max_model_len", 1 << 20)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(model_name, ENGINE)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Server arrival to first token, seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Gap between steps that gave a request tokens, seconds.", ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Same as vllm:inter_token_latency_seconds "
                              "(the older name).", ITL_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Per request: decode time over its generated tokens after "
                                      "the first, seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Server arrival to last token, seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Engine arrival to first scheduling, seconds.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "First scheduling to last token, seconds.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "First scheduling to first token, seconds.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "First token to last token, seconds.", REQUEST_LATENCY_BUCKETS)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                                    buckets_1_2_5(max_model_len))
        self.generation_len = histogram("vllm:request_generation_tokens", "Generated tokens per finished request.",
                                        buckets_1_2_5(max_model_len))
        self.max_generation_len = histogram("vllm:request_max_num_generation_tokens",
                                            "Tokens of a finished request's longest completion.",
                                            buckets_1_2_5(max_model_len))
        self.params_n = histogram("vllm:request_params_n", "Completions per finished request.", (1, 2, 5, 10, 20))
        success = Counter("vllm:request_success", "Finished requests by finish reason.",
                          LABELS + ("finished_reason",), registry=r)
        self.success = {reason: success.labels(model_name, ENGINE, reason) for reason in FINISH_REASONS}

    def count_aborted(self) -> None:
        self.success["abort"].inc()

    def observe_finished(self, arrival: float, output) -> None:
        """Record a finished request (`output` a RequestOutput; `arrival` when the server received it)."""
        completion = output.outputs[0]
        num_out = len(completion.token_ids)
        reason = completion.finish_reason if completion.finish_reason in self.success else "stop"
        self.success[reason].inc()
        self.prompt_len.observe(len(output.prompt_token_ids))
        self.generation_len.observe(num_out)
        self.max_generation_len.observe(max(len(c.token_ids) for c in output.outputs))
        self.params_n.observe(len(output.outputs))
        m = output.metrics
        if m is None or m.first_token_time is None or m.finished_time is None:
            return
        self.ttft.observe(max(0.0, m.first_token_time - arrival))
        self.e2e.observe(max(0.0, m.finished_time - arrival))
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
            self.tpot.observe(gap)
        decode = max(0.0, m.finished_time - m.first_token_time)
        self.decode.observe(decode)
        self.request_tpot.observe(decode / (num_out - 1) if num_out > 1 else 0.0)
        if m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            self.prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
            self.inference.observe(max(0.0, m.finished_time - m.first_scheduled_time))

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
from lamina.engine import metrics_reader as reader

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")

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
    """`vllm:*` gauges and engine-wide counters (lamina.engine.metrics_reader), read from the engine
    at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats
        for metric in reader.engine_metrics(self.engine.engine, self.model_name, num_running=stats.num_running,
                                     num_waiting=stats.num_waiting, cache_usage=stats.cache_usage):
            names, values = list(metric.labels), list(metric.labels.values())
            if isinstance(metric, reader.Gauge):
                family = GaugeMetricFamily(metric.name, metric.doc, labels=names)
                family.add_metric(values, metric.value)
            elif isinstance(metric, reader.Counter):
                family = CounterMetricFamily(metric.name, metric.doc, labels=names)
                family.add_metric(values, metric.value)
            elif isinstance(metric, reader.Vector):  # one counter per position
                family = CounterMetricFamily(metric.name, metric.doc, labels=names + ["position"])
                for position, value in enumerate(metric.values):
                    family.add_metric(values + [str(position)], value)
            else:
                family = HistogramMetricFamily(metric.name, metric.doc, labels=names)
                family.add_metric(values, list(metric.buckets.items()), sum_value=metric.sum)
            yield family


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, engine: AsyncEngine, model_name: str):
        r = registry
        r.register(_EngineCollector(engine, model_name))
        max_model_len = getattr(engine.engine, "max_model_len", 1 << 20)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(model_name, reader.ENGINE)

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
        self.success = {reason: success.labels(model_name, reader.ENGINE, reason) for reason in FINISH_REASONS}

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

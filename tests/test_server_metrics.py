"""`/metrics` under a KV cache too small for the load: preemptions and the tokens they cost to
recompute show up, queue and prefill times are recorded, and vLLM's metric names are exported beside
lamina's with vLLM's types, labels and buckets (parsed with prometheus_client's own parser)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lamina import LLM
from lamina.entrypoints.openai.metrics_vllm import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from tests.server_harness import MODEL_NAME, RunningServer

NUM_REQUESTS = 8
MAX_TOKENS = 40
LABELS = {"model_name": MODEL_NAME, "engine": "0"}

# name -> type, as vLLM exports them (prometheus_client strips a counter's _total from the family name)
VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
}
BUCKETS = {
    "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
    "vllm:inter_token_latency_seconds": ITL_BUCKETS,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
}


@pytest.fixture(scope="module")
def server(qwen3_next_dir):
    # 40 blocks of 4 tokens: two 60-token sequences fit, eight do not
    with LLM(str(qwen3_next_dir), device="cpu", max_model_len=96, block_size=4, num_gpu_blocks_override=40,
             max_num_batched_tokens=64, max_num_seqs=NUM_REQUESTS, show_progress=False) as llm, \
            RunningServer(llm.engine) as srv:
        yield srv


def _families(server) -> dict:
    text = httpx.get(f"{server.url}/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families, name: str, suffix: str = "", **labels) -> float:
    family = families[name]
    matches = [s.value for s in family.samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, suffix, labels, family.samples)
    return matches[0]


def _run_load(server) -> list:
    prompts = [f"river baker bread number {i} " * 3 for i in range(NUM_REQUESTS)]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(
                client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True}) for p in prompts))

    return asyncio.run(run())


def test_preemptions_and_vllm_names_under_a_tiny_cache(server):
    before = _families(server)
    for name, kind in VLLM_SERIES.items():
        assert name in before and before[name].type == kind, (name, before.get(name))
    assert _value(before, "vllm:num_preemptions", "_total", **LABELS) == 0

    outs = _run_load(server)
    assert all(o.usage.completion_tokens == MAX_TOKENS for o in outs)
    after = _families(server)
    engine = server.async_engine.engine

    # lamina's own: how often, and what it cost
    preemptions = _value(after, "lamina_num_preemptions", "_total")
    recompute = _value(after, "lamina_preemption_recompute_tokens", "_total")
    assert preemptions > 0 and preemptions == engine.num_preemptions
    assert recompute > 0 and recompute == engine.num_preemption_recompute_tokens
    assert _value(after, "lamina_request_queue_time_seconds", "_count") == NUM_REQUESTS
    assert _value(after, "lamina_request_prefill_time_seconds", "_count") == NUM_REQUESTS
    # a request preempted and requeued waits again: lamina's queue time counts every wait, vLLM's the first
    assert _value(after, "lamina_request_queue_time_seconds", "_sum") >= \
        _value(after, "vllm:request_queue_time_seconds", "_sum", **LABELS) - 1e-6

    # vLLM's names, types, labels
    for name, kind in VLLM_SERIES.items():
        family = after[name]
        assert family.type == kind, name
        for sample in family.samples:
            assert {k: sample.labels[k] for k in LABELS} == LABELS, (name, sample)
    assert _value(after, "vllm:num_preemptions", "_total", **LABELS) == preemptions
    prompt_tokens = sum(o.usage.prompt_tokens for o in outs)
    assert _value(after, "vllm:prompt_tokens", "_total", **LABELS) == prompt_tokens
    assert _value(after, "vllm:generation_tokens", "_total", **LABELS) == NUM_REQUESTS * MAX_TOKENS
    assert _value(after, "vllm:request_success", "_total", finished_reason="length", **LABELS) == NUM_REQUESTS
    assert _value(after, "vllm:request_success", "_total", finished_reason="stop", **LABELS) == 0
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens"):
        assert _value(after, name, "_count", **LABELS) == NUM_REQUESTS, name
    # one inter-token latency per step after the first token (no speculative decoding here)
    gaps = NUM_REQUESTS * (MAX_TOKENS - 1)
    assert _value(after, "vllm:inter_token_latency_seconds", "_count", **LABELS) == gaps
    assert _value(after, "vllm:time_per_output_token_seconds", "_count", **LABELS) == gaps
    for name, buckets in BUCKETS.items():
        bounds = [float(s.labels["le"]) for s in after[name].samples if s.name == name + "_bucket"]
        assert bounds == [*map(float, buckets), float("inf")], name
    e2e = _value(after, "vllm:e2e_request_latency_seconds", "_sum", **LABELS)
    parts = (_value(after, "vllm:time_to_first_token_seconds", "_sum", **LABELS)
             + _value(after, "vllm:request_decode_time_seconds", "_sum", **LABELS))
    assert parts == pytest.approx(e2e, rel=1e-6, abs=1e-6)  # ttft + decode = e2e, request by request
    assert _value(after, "vllm:request_generation_tokens", "_sum", **LABELS) == NUM_REQUESTS * MAX_TOKENS
    assert _value(after, "vllm:request_max_num_generation_tokens", "_sum", **LABELS) == NUM_REQUESTS * MAX_TOKENS
    assert _value(after, "vllm:request_params_n", "_sum", **LABELS) == NUM_REQUESTS
    assert _value(after, "vllm:num_requests_running", **LABELS) == 0
    assert _value(after, "vllm:kv_cache_usage_perc", **LABELS) == 0
    # tokens each engine step ran (monitors read its _count as the engine's heartbeat): every step
    # counted, the tokens summed, vLLM's buckets
    steps = "vllm:iteration_tokens_total"
    assert _value(after, steps, "_count", **LABELS) - _value(before, steps, "_count", **LABELS) >= MAX_TOKENS
    ran = _value(after, steps, "_sum", **LABELS) - _value(before, steps, "_sum", **LABELS)
    assert ran >= prompt_tokens + NUM_REQUESTS * (MAX_TOKENS - 1)  # preempted requests run their tokens again
    bounds = [float(s.labels["le"]) for s in after[steps].samples if s.name == steps + "_bucket"]
    assert bounds[:3] == [1.0, 8.0, 16.0] and bounds[-1] == float("inf")
    info = [s for s in after["vllm:cache_config_info"].samples][0]
    assert info.value == 1 and info.labels["block_size"] == "4" and info.labels["num_gpu_blocks"] == "40"
    assert info.labels["enable_prefix_caching"] == "False"


def test_spec_decode_series_only_with_speculative_decoding():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from lamina.entrypoints.openai.metrics_vllm import VllmMetrics
    from lamina.engine.async_engine import EngineStats
    from lamina.outputs import SpecDecodeMetrics

    def scrape(spec) -> dict:
        llm = SimpleNamespace(max_model_len=64, num_preemptions=3, num_prompt_tokens_processed=5,
                              num_generation_tokens_processed=7, spec_decode_metrics=spec)
        registry = CollectorRegistry()
        VllmMetrics(registry, SimpleNamespace(engine=llm, stats=EngineStats(1, 2, 0.5)), "m")
        return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}

    plain = scrape(None)
    assert not [name for name in plain if name.startswith("vllm:spec_decode")]
    assert _value(plain, "vllm:num_preemptions", "_total", model_name="m", engine="0") == 3
    assert _value(plain, "vllm:num_requests_running", model_name="m", engine="0") == 2
    spec = SpecDecodeMetrics()
    spec.record(3, 2)
    spec.record(2, 0)
    families = scrape(spec)
    assert _value(families, "vllm:spec_decode_num_drafts", "_total") == 2
    assert _value(families, "vllm:spec_decode_num_draft_tokens", "_total") == 5
    assert _value(families, "vllm:spec_decode_num_accepted_tokens", "_total") == 2
    per_pos = {s.labels["position"]: s.value for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
               if s.name.endswith("_total")}
    assert per_pos == {"0": 1, "1": 1, "2": 0}

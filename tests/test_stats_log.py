"""The server's periodic engine-statistics line (`lamina serve --log-stats-interval`, vLLM's stats log)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import httpx
import pytest

from lamina import LLM
from lamina.engine.stats_log import EngineStatsLogger
from tests.server_harness import MODEL_NAME, RunningServer


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _engine(prompt=0, generation=0):
    return SimpleNamespace(num_prompt_tokens_processed=prompt, num_generation_tokens_processed=generation,
                           num_running=3, num_waiting=2, cache_usage=lambda: 0.25)


def test_stats_line_rates_and_step_times():
    clock, lines = FakeClock(), []
    stats = EngineStatsLogger(2.0, clock=clock, log=lines.append)
    engine = _engine(prompt=500, generation=40)
    stats.start(engine)  # counters from before the window are not counted
    clock.now += 1.0
    stats.observe_step(0.010)
    engine.num_prompt_tokens_processed, engine.num_generation_tokens_processed = 1500, 60
    assert not stats.maybe_log(engine) and lines == []  # the interval has not passed
    clock.now += 1.0
    stats.observe_step(0.030)
    engine.num_generation_tokens_processed = 80
    assert stats.maybe_log(engine)
    assert lines == ["engine: prompt 500.0 tok/s, generation 20.0 tok/s, running 3, waiting 2, KV cache 25.0%, "
                     "2 steps (mean 20.0 ms, max 30.0 ms)"]
    # the next window starts at the logged counters; an idle window logs nothing
    clock.now += 5.0
    assert not stats.maybe_log(engine) and len(lines) == 1
    clock.now += 2.0
    stats.observe_step(0.005)
    engine.num_generation_tokens_processed = 84
    assert stats.maybe_log(engine)
    assert lines[1].startswith("engine: prompt 0.0 tok/s, generation 2.0 tok/s,") and "1 steps (mean 5.0 ms" in lines[1]


@pytest.mark.parametrize("interval", [0, -1.0])
def test_stats_interval_must_be_positive(interval):
    with pytest.raises(ValueError, match=f"must be > 0 seconds, got {interval}"):
        EngineStatsLogger(interval)


def test_server_logs_engine_stats_while_it_works(qwen3_next_dir, caplog):
    llm = LLM(str(qwen3_next_dir), device="cpu", max_model_len=128, show_progress=False)
    try:
        with caplog.at_level(logging.INFO, logger="lamina.engine"):
            with RunningServer(llm.engine, log_stats_interval_s=0.01) as server:
                r = httpx.post(f"{server.base_url}/completions", timeout=60,
                               json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12,
                                     "ignore_eos": True})
                assert r.status_code == 200
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "lamina.engine"]
        assert lines, "no engine-statistics line was logged"
        assert all(line.startswith("engine: prompt ") and " steps (mean " in line for line in lines)
        generated = [float(line.split("generation ")[1].split(" tok/s")[0]) for line in lines]
        assert max(generated) > 0
    finally:
        llm.shutdown()


def test_stats_line_reports_the_windows_prefix_cache_hit_rate():
    """With prefix caching, vLLM's 'prefix cache hit rate': tokens found over tokens looked up, this window."""
    clock, lines = FakeClock(), []
    stats = EngineStatsLogger(1.0, clock=clock, log=lines.append)
    engine = _engine()
    engine.prefix_caching, engine.num_prefix_cache_queries, engine.num_prefix_cache_hits = True, 100, 90
    stats.start(engine)
    clock.now += 1.0
    stats.observe_step(0.01)
    engine.num_prefix_cache_queries, engine.num_prefix_cache_hits = 300, 140
    assert stats.maybe_log(engine)
    assert "KV cache 25.0%, prefix cache hit rate 25.0%, 1 steps" in lines[0]
    clock.now += 1.0
    stats.observe_step(0.01)
    assert stats.maybe_log(engine) and "prefix cache hit rate -," in lines[1]  # no lookups this window

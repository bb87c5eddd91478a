"""The server's periodic engine-statistics line (vLLM's "Avg prompt throughput ..." log): what the engine
thread did since the last line, logged every `interval_s` while there is work.

One line reads, e.g.:
    engine: prompt 8190.3 tok/s, generation 3100.0 tok/s, running 64, waiting 0, KV cache 41.2%,
    97 steps (mean 20.6 ms, max 310.2 ms)

The step times are wall times of `LLMEngine.step()` on the engine thread (host planning, the launch
and, with asynchronous scheduling, the wait for the step before), so the gaps the event loop's
streaming leaves between steps show in the rate but not in the step times."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("lamina.engine")

DEFAULT_LOG_STATS_INTERVAL_S = 10.0


class EngineStatsLogger:
    def __init__(self, interval_s: float, clock=time.monotonic, log=logger.info):
        if not interval_s > 0:
            raise ValueError(f"the stats interval must be > 0 seconds, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._log = log
        self._since = clock()
        self._prompt_tokens = 0  # the engine's counters when the window began
        self._generation_tokens = 0
        self._prefix: tuple[int, int] | None = None  # prefix-cache lookups and hits when the window began
        self._step_seconds: list[float] = []

    def start(self, engine) -> None:
        """Begin a window at the engine's current counters (the logger's first call)."""
        self._since = self._clock()
        self._prompt_tokens = engine.num_prompt_tokens_processed
        self._generation_tokens = engine.num_generation_tokens_processed
        self._prefix = self._prefix_counts(engine)
        self._step_seconds = []

    @staticmethod
    def _prefix_counts(engine) -> tuple[int, int] | None:
        """(prompt tokens looked up, tokens found) in the prefix cache; None without prefix caching."""
        if not getattr(engine, "prefix_caching", False):
            return None
        return engine.num_prefix_cache_queries, engine.num_prefix_cache_hits

    def observe_step(self, seconds: float) -> None:
        self._step_seconds.append(seconds)

    def line(self, engine, now: float) -> str:
        elapsed = max(now - self._since, 1e-9)
        prompt = (engine.num_prompt_tokens_processed - self._prompt_tokens) / elapsed
        generation = (engine.num_generation_tokens_processed - self._generation_tokens) / elapsed
        steps = self._step_seconds
        step_part = (f"{len(steps)} steps (mean {1e3 * sum(steps) / len(steps):.1f} ms, max {1e3 * max(steps):.1f} ms)"
                     if steps else "0 steps")
        prefix_part = ""
        counts = self._prefix_counts(engine)
        if counts is not None and self._prefix is not None:  # vLLM's hit rate: over this window's lookups
            queries, hits = counts[0] - self._prefix[0], counts[1] - self._prefix[1]
            prefix_part = f", prefix cache hit rate {100 * hits / queries:.1f}%" if queries else ", prefix cache hit rate -"
        return (f"engine: prompt {prompt:.1f} tok/s, generation {generation:.1f} tok/s, running {engine.num_running}, "
                f"waiting {engine.num_waiting}, KV cache {100 * engine.cache_usage():.1f}%{prefix_part}, {step_part}")

    def maybe_log(self, engine) -> bool:
        """Log a line when the interval has passed and steps ran in it; returns whether it logged."""
        now = self._clock()
        if now - self._since < self.interval_s:
            return False
        logged = bool(self._step_seconds)
        if logged:
            self._log(self.line(engine, now))
        self.start(engine)
        return logged


# vLLM's buckets of vllm:iteration_tokens_total (tokens an engine step runs)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class TokenCountHistogram:
    """Cumulative counts of the tokens each engine step ran, in ITERATION_TOKEN_BUCKETS (the server's
    /metrics reads them at scrape time: the engine thread only adds)."""

    def __init__(self, buckets: tuple[int, ...] = ITERATION_TOKEN_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket, the last one past the largest bound
        self.total = 0  # the sum of the observed counts

    def observe(self, tokens: int) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if tokens <= bound), len(self.buckets))
        self.counts[index] += 1
        self.total += tokens

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' (le, cumulative count) pairs, "+Inf" last."""
        out, running = [], 0
        for bound, count in zip([*map(str, map(float, self.buckets)), "+Inf"], list(self.counts)):
            running += count
            out.append((bound, running))
        return out

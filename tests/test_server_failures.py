"""Failure paths of `lamina serve`: clients that go away, a full queue, an engine loop that dies, and the
drain before shutdown. Steps are slowed down so that requests are reliably in flight."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from lamina import LLM
from tests.server_harness import MODEL_NAME, RunningServer

STEP_DELAY_S = 0.02


def _slow_steps(engine, delay=STEP_DELAY_S):
    step = engine.step

    def slow_step():
        time.sleep(delay)
        return step()

    engine.step = slow_step  # instance attribute: shadows LLMEngine.step for this engine only


def _wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _body(**kw):
    return {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, **kw}


@pytest.fixture
def make_server(qwen3_next_dir):
    started = []

    def make(llm_kwargs=None, **config):
        llm = LLM(str(qwen3_next_dir), device="cpu", max_model_len=256, show_progress=False, **(llm_kwargs or {}))
        _slow_steps(llm.engine)
        server = RunningServer(llm.engine, **config).start()
        started.append((server, llm))
        return server

    yield make
    for server, llm in started:
        server.stop()
        llm.shutdown()


def _aborted(server, endpoint="completions"):
    return server.state.metrics.requests.labels(endpoint, "aborted")._value.get()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
def test_client_disconnect_frees_the_request(make_server, overlap):
    """A hung-up client aborts its request; with asynchronous scheduling the abort lands while a
    step of it is in flight, and its cache is still freed."""
    server = make_server({"async_scheduling": overlap})
    engine = server.async_engine
    # streaming: read two events, then hang up
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.base_url}/completions", json=_body(stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip((ln for ln in lines if ln.startswith("data:")), range(2))]
            assert len(got) == 2
            assert engine.stats.cache_usage > 0 and engine.num_in_flight == 1
    _wait_for(lambda: engine.num_in_flight == 0 and engine.stats.cache_usage == 0, what="the stream's abort")
    assert _aborted(server) == 1
    # not streaming: the client gives up (timeout) and closes the connection
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/chat/completions", timeout=0.5,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "ignore_eos": True})
    _wait_for(lambda: engine.num_in_flight == 0 and engine.stats.cache_usage == 0, what="the chat request's abort")
    _wait_for(lambda: _aborted(server, "chat") == 1, what="the aborted count")
    assert not engine.engine.has_unfinished_requests()
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_full_queue_answers_503_with_retry_after(make_server):
    server = make_server(llm_kwargs={"max_num_seqs": 1}, max_waiting_requests=2)

    async def burst():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/completions", json=_body(max_tokens=20)) for _ in range(8)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and codes.count(503) >= 1 and set(codes) <= {200, 503}, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
    rejected = server.state.metrics.requests.labels("completions", "rejected")._value.get()
    assert rejected == codes.count(503)
    # the official client honours Retry-After and gets through once the queue drains
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=5) as client:
        out = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3)
        assert out.usage.completion_tokens >= 1


def test_engine_death_fails_requests_and_health(make_server):
    server = make_server()
    engine = server.async_engine
    results: dict[str, object] = {}

    def stream_client():
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30) as client:
            try:
                for _ in client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=200,
                                                   stream=True, extra_body={"ignore_eos": True}):
                    pass
                results["stream"] = "finished"
            except openai.APIError as e:
                results["stream"] = e

    def plain_client():
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30) as client:
            try:
                client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=200, extra_body={"ignore_eos": True})
                results["plain"] = "finished"
            except openai.APIError as e:
                results["plain"] = e

    threads = [threading.Thread(target=stream_client), threading.Thread(target=plain_client)]
    for t in threads:
        t.start()
    _wait_for(lambda: engine.num_in_flight == 2 and engine.stats.num_steps >= 3, what="both requests running")
    killed_at = time.monotonic()
    engine.fail_after_steps = engine.stats.num_steps + 2  # the loop raises two steps from now
    for t in threads:
        t.join(15)
    assert not any(t.is_alive() for t in threads), "a client hangs after the engine died"
    assert time.monotonic() - killed_at < 10
    assert isinstance(results["stream"], openai.APIError) and "engine" in str(results["stream"]).lower()
    assert isinstance(results["plain"], openai.InternalServerError)
    assert results["plain"].body["code"] == "engine_dead"
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "injected engine failure" in health.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/completions", json=_body(max_tokens=2))
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "lamina_engine_healthy 0.0" in metrics
    assert server.state.metrics.requests.labels("completions", "error")._value.get() == 1
    assert server.state.metrics.requests.labels("chat", "error")._value.get() == 1


def test_drain_finishes_short_requests_and_ends_long_ones_with_an_error(make_server):
    server = make_server(drain_timeout_s=3.0)  # the long request needs >= 240 * STEP_DELAY_S = 4.8 s
    engine = server.async_engine
    events: dict[str, list[str]] = {"short": [], "long": []}

    def reader(name, max_tokens):
        with httpx.stream("POST", f"{server.base_url}/completions", timeout=30,
                          json=_body(stream=True, max_tokens=max_tokens)) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events[name].append(line[5:].strip())

    threads = [threading.Thread(target=reader, args=("short", 10)), threading.Thread(target=reader, args=("long", 240))]
    for t in threads:
        t.start()
    _wait_for(lambda: engine.num_in_flight == 2, what="both requests running")
    stopper = threading.Thread(target=server.stop)
    started = time.monotonic()
    stopper.start()
    _wait_for(lambda: engine.draining, what="the drain")
    try:  # no new work while draining: the listener is closed (or, racing it, /health says so)
        refused = httpx.get(f"{server.url}/health", timeout=2).status_code == 503
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        refused = True
    assert refused
    stopper.join(30)
    for t in threads:
        t.join(10)
    assert time.monotonic() - started < 15
    assert events["short"][-1] == "[DONE]" and '"finish_reason":"length"' in events["short"][-2]
    assert events["long"][-1] == "[DONE]" and "shutting down" in events["long"][-2]
    assert '"error"' in events["long"][-2]


def test_killed_rank_process_fails_requests_and_health(make_server):
    """A real worker process (rank 1 of TP2) is killed mid-generation."""
    import os
    import signal

    server = make_server(llm_kwargs={"tensor_parallel_size": 2, "dtype": "float32"})
    engine = server.async_engine
    outcome: dict[str, object] = {}

    def stream_client():
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30) as client:
            try:
                for _ in client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=200,
                                                   stream=True, extra_body={"ignore_eos": True}):
                    pass
                outcome["stream"] = "finished"
            except openai.APIError as e:
                outcome["stream"] = e

    def plain_client():
        r = httpx.post(f"{server.base_url}/completions", json=_body(max_tokens=200), timeout=30)
        outcome["plain"] = r

    threads = [threading.Thread(target=stream_client), threading.Thread(target=plain_client)]
    for t in threads:
        t.start()
    _wait_for(lambda: engine.num_in_flight == 2 and engine.stats.num_steps >= 3, what="both requests running")
    rank1 = engine.engine.executor.procs.procs[1]
    killed_at = time.monotonic()
    os.kill(rank1.pid, signal.SIGKILL)
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a client hangs after a rank died"
    assert time.monotonic() - killed_at < 15
    assert isinstance(outcome["stream"], openai.APIError)
    assert outcome["plain"].status_code == 500 and outcome["plain"].json()["error"]["code"] == "engine_dead"
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
    assert not any(p.is_alive() for p in engine.engine.executor.procs.procs.values())


def test_non_streaming_disconnect_logs_no_unretrieved_gather(make_server, caplog):
    """A client that hangs up on a non-streaming request used to leave `_GatheringFuture exception was never
    retrieved ... CancelledError` in the log (asyncio reports it when the cancelled gather is collected)."""
    import gc

    server = make_server()
    engine = server.async_engine
    with caplog.at_level("ERROR", logger="asyncio"):
        for path, body in (("/completions", _body()),
                           ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                                                  "ignore_eos": True})):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.base_url}{path}", timeout=0.5, json=body)
            _wait_for(lambda: engine.num_in_flight == 0, what="the abort")
        time.sleep(0.3)
        gc.collect()
        time.sleep(0.2)
    assert "never retrieved" not in caplog.text, caplog.text
    assert httpx.get(f"{server.url}/health").status_code == 200

"""The engine loop on a thread of its own, fed from and feeding an asyncio event loop.

`AsyncEngine` wraps an `LLMEngine`. One background thread owns it: it applies queued commands
(add, abort), runs `step()` while there is work, and hands each step's outputs to the event loop
with one `call_soon_threadsafe`. New requests join the running batch at the next step.

On the event-loop side every request has a `RequestStream`; outputs are cumulative (full text and
token ids so far), so a stream keeps only the newest one and a slow reader never falls behind.

Failure: an exception out of `step()` kills the loop. Every open stream then fails with
`EngineDeadError`, `is_healthy` turns False, and new requests are refused at once. The test hook
`LAMINA_TEST_FAIL_AFTER_STEPS=N` (or `fail_after_steps`) raises inside the loop after N steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

from lamina.engine.gc_heap import frozen_heap
from lamina.engine.llm_engine import LLMEngine
from lamina.engine.stats_log import EngineStatsLogger
from lamina.outputs import RequestOutput
from lamina.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FAIL_AFTER_STEPS_ENV = "LAMINA_TEST_FAIL_AFTER_STEPS"


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (an exception out of `step()`, or shutdown)."""


class EngineOverloadedError(RuntimeError):
    """More requests are waiting than `max_waiting_requests` allows."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down and takes no new requests."""


class RequestAbortedError(RuntimeError):
    """The request was ended before it finished (client gone, or server shutting down)."""


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int = 0
    num_running: int = 0
    cache_usage: float = 0.0
    num_steps: int = 0


class RequestStream:
    """Event-loop side of one request: the newest cumulative output, or the error that ended it."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False  # a finished output or an error has arrived

    def put(self, output: RequestOutput) -> None:
        if self.finished:
            return
        self._latest = output
        self.finished = output.finished
        self._event.set()

    def fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self._error = error
        self.finished = True
        self._event.set()

    async def get(self) -> RequestOutput:
        """The newest output not yet returned; raises the error that ended the request."""
        while self._latest is None and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._latest is not None:
            latest, self._latest = self._latest, None
            return latest
        raise self._error  # type: ignore[misc]

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            output = await self.get()
            yield output
            if output.finished:
                return


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting_requests: int | None = None,
        fail_after_steps: int | None = None,
        log_stats_interval_s: float | None = None,
    ):
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1 (or None: no limit), got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        if fail_after_steps is None and os.environ.get(FAIL_AFTER_STEPS_ENV):
            fail_after_steps = int(os.environ[FAIL_AFTER_STEPS_ENV])
        self.fail_after_steps = fail_after_steps
        # the periodic engine-statistics line (None: none), see lamina.engine.stats_log
        self.stats_logger = EngineStatsLogger(log_stats_interval_s) if log_stats_interval_s is not None else None
        self.stats = EngineStats()
        self.dead_error: str | None = None
        self.draining = False
        self._cv = threading.Condition()
        self._commands: deque[tuple[str, str, object]] = deque()  # (kind, request_id, payload)
        self._pending_adds = 0
        self._published_waiting = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side only

    # ---- lifetime (event loop) ------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        driver = getattr(self.engine, "_async_driver", None)
        if driver is not None and driver is not self and driver.is_running:
            # two engine threads stepping one LLMEngine take each other's outputs: one driver at a time
            raise RuntimeError("this LLMEngine is already driven by another running AsyncEngine (another "
                               "server on the same engine); stop it first, or give the new one an engine of its own")
        self.engine._async_driver = self
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="lamina-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread and wait for it (any thread; safe to call more than once). Open
        streams are not touched: follow with `fail_all` on the event loop."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def fail_all(self, reason: str) -> None:
        """End every open stream with EngineDeadError(reason) (event loop)."""
        self._fail_all(EngineDeadError(self.dead_error or reason))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def is_healthy(self) -> bool:
        return self.is_running and not self._stop

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests (event loop) ------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a validated request; the returned stream yields its outputs.

        Raises EngineDeadError, EngineDrainingError or EngineOverloadedError without queueing."""
        if not self.is_healthy:
            raise EngineDeadError(self.dead_error or "the engine is not running")
        if self.draining:
            raise EngineDrainingError("the server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        with self._cv:
            limit = self.max_waiting_requests
            waiting = self._pending_adds + self._published_waiting
            if limit is not None and waiting >= limit:
                raise EngineOverloadedError(
                    f"{waiting} requests are already waiting (--max-waiting-requests {limit}); retry later"
                )
            stream = RequestStream(request_id)
            self._streams[request_id] = stream
            payload = {"prompt": prompt, "prompt_token_ids": list(prompt_token_ids)}
            if cache_salt is not None:
                payload["cache_salt"] = cache_salt
            self._commands.append(("add", request_id, (payload, params)))
            self._pending_adds += 1
            self._cv.notify()
        return stream

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """End a request: its stream fails (with `error`, default RequestAbortedError) and the engine
        frees its cache. No-op for a request that already finished."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.fail(error or RequestAbortedError(f"request {request_id} was aborted"))
        with self._cv:
            self._commands.append(("abort", request_id, None))
            self._cv.notify()

    def abort_all(self, reason: str) -> int:
        """Abort every open request with `reason`; returns how many there were."""
        ids = list(self._streams)
        for request_id in ids:
            self.abort(request_id, RequestAbortedError(reason))
        return len(ids)

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with frozen_heap(collect=True):  # collections skip the loaded engine's objects (lamina.engine.gc_heap)
                self._loop_forever()
        except BaseException as e:  # noqa: BLE001 - the loop must report any death
            self.dead_error = f"the engine loop failed: {type(e).__name__}: {e}"
            logger.exception("engine loop died")
            self._post(self._fail_all, EngineDeadError(self.dead_error))
        finally:
            if self.dead_error is None and not self._stop:
                self.dead_error = "the engine loop exited"
                self._post(self._fail_all, EngineDeadError(self.dead_error))

    def _loop_forever(self) -> None:
        engine = self.engine
        flush = False  # aborted requests to report to the workers in an (empty) step
        num_steps = 0
        stats_logger = self.stats_logger
        if stats_logger is not None:
            stats_logger.start(engine)
        while True:
            with self._cv:
                while not (self._commands or self._stop or flush or engine.has_unfinished_requests()):
                    self._cv.wait(timeout=1.0)
                    if stats_logger is not None:  # idle: the burst's last window, then empty ones (no line)
                        stats_logger.maybe_log(engine)
                if self._stop:
                    return
                commands = list(self._commands)
                self._commands.clear()
                failed: list[tuple[str, BaseException]] = []
                for kind, request_id, payload in commands:
                    if kind == "add":
                        self._pending_adds -= 1
                        prompt, params = payload  # type: ignore[misc]
                        try:
                            engine.add_request(prompt, params, request_id=request_id)
                        except (ValueError, TypeError) as e:
                            failed.append((request_id, e))
                    else:
                        engine.abort_request(request_id)
                        flush = True
                self._published_waiting = engine.num_waiting
            if failed:
                self._post(self._deliver, [], failed)
            if engine.has_unfinished_requests() or flush:
                if self.fail_after_steps is not None and num_steps >= self.fail_after_steps:
                    raise RuntimeError(f"injected engine failure after {num_steps} steps ({FAIL_AFTER_STEPS_ENV})")
                started = time.perf_counter()
                outputs = engine.step()
                if stats_logger is not None:
                    stats_logger.observe_step(time.perf_counter() - started)
                num_steps += 1
                flush = False
                if outputs:
                    self._post(self._deliver, outputs, [])
            with self._cv:
                self._published_waiting = engine.num_waiting
            self.stats = EngineStats(
                num_waiting=engine.num_waiting, num_running=engine.num_running,
                cache_usage=engine.cache_usage(), num_steps=num_steps,
            )
            if stats_logger is not None:
                stats_logger.maybe_log(engine)

    def _post(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed in between
            pass

    # ---- event loop callbacks -------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput], failed: list[tuple[str, BaseException]]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]
        for request_id, error in failed:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.fail(error)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(error)

"""What completions and chat share: errors, model names, sampling parameters, admission, waiting for
outputs while watching for a client that went away, logprob and SSE formatting."""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from lamina.engine.async_engine import (
    AsyncEngine, EngineDeadError, EngineDrainingError, EngineOverloadedError, RequestAbortedError, RequestStream,
)
from lamina.entrypoints.openai.metrics import ServerMetrics
from lamina.entrypoints.openai.protocol import MAX_STOP_STRINGS
from lamina.entrypoints.openai.token_text import logprob_token_text, token_bytes
from lamina.outputs import RequestOutput
from lamina.sampling_params import SamplingParams
from lamina.structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256  # a client's X-Request-Id (the body's request_id: the same bound, in protocol.py)

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
    415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    500: "server_error", 503: "service_unavailable",
}

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids", "stop",
    "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "allowed_token_ids", "bad_words", "best_of", "n",
)


class APIError(Exception):
    """An error answered as an OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


def finite(logprob: float | None) -> float:
    """JSON has no infinities or NaN: an impossible token's logprob is sent as -9999.0."""
    return logprob if logprob is not None and math.isfinite(logprob) else -9999.0


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


@dataclass
class FrontendOptions:
    """vLLM's frontend flags that shape answers and logs (`lamina serve --help` names them)."""

    force_include_usage: bool = False  # --enable-force-include-usage: streams end with usage whatever they ask
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details (usage's cached prompt tokens)
    request_id_headers: bool = False  # --enable-request-id-headers: every answer carries X-Request-Id (app.py)
    response_role: str = "assistant"  # --response-role: the answer's role when add_generation_prompt
    log_requests: bool = False  # --enable-log-requests: each request's prompt and parameters logged
    max_log_len: int | None = None  # --max-log-len: prompt characters / token ids a log line shows


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str], metrics: ServerMetrics,
                 *, retry_after_s: int = 1):
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.async_engine = engine
        self.engine = engine.engine
        self.served_model_names = list(served_model_names)
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.created = int(time.time())
        self._token_text_cache: dict[int, str] = {}
        self.return_tokens_as_token_ids = False  # the server's default (--return-tokens-as-token-ids)
        self.frontend = FrontendOptions()

    # ---- model, tokenizer ------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def resolve_model(self, name: str | None) -> str:
        if name is None or name == "":
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.served_model_names)}", param="model",
                           code="model_not_found")
        return name

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs; a token that is not whole UTF-8 (part of a character) is written
        as its bytes, `bytes:\\xe4\\xbd` (see lamina.entrypoints.openai.token_text)."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = logprob_token_text(self.tokenizer, token_id)
            if len(self._token_text_cache) < 1 << 20:
                self._token_text_cache[token_id] = text
        return text

    def tokens_as_ids(self, req) -> bool:
        """Whether `req`'s logprobs name tokens `token_id:N` (vLLM's `return_tokens_as_token_ids`: the
        request's field, else the server's flag)."""
        asked = getattr(req, "return_tokens_as_token_ids", None)
        return self.return_tokens_as_token_ids if asked is None else bool(asked)

    def logprob_token(self, token_id: int, as_id: bool) -> str:
        """A token as a logprobs answer names it: `token_id:N` when `as_id`, else its text."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)

    def token_byte_list(self, token_id: int) -> list[int]:
        """A token's UTF-8 bytes for chat logprobs (the raw bytes of a partial character)."""
        text = self.token_text(token_id)
        if text.startswith("bytes:") and self.tokenizer is not None:
            raw = token_bytes(self.tokenizer, token_id)
            if raw is not None:
                return list(raw)
        return list(text.encode())

    async def run_blocking(self, fn: Callable, *args, param: str | None = None):
        """Run CPU work (tokenizing, chat templates) off the event loop; bad input becomes a 400."""
        try:
            return await asyncio.to_thread(fn, *args)
        except APIError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, LookupError) as e:
            raise APIError(400, str(e) or type(e).__name__, param=param) from e

    # ---- request checks ------------------------------------------------------------------
    def require_tokenizer(self, what: str, param: str | None) -> None:
        """400 `no_tokenizer` when the server runs without a tokenizer (skip_tokenizer_init, or none
        next to the checkpoint) and the request asks for something that needs one."""
        if self.tokenizer is not None:
            return
        reason = getattr(self.engine, "no_tokenizer_reason", "") or "this model has no tokenizer"
        raise APIError(400, f"{what} needs a tokenizer, and {reason}; "
                       "send token ids (a list of ints as prompt) to /v1/completions", param=param,
                       code="no_tokenizer")

    def check_tokenizer_needs(self, req) -> None:
        """The request fields that need text: stop strings, bad words, structured output."""
        if self.tokenizer is not None:
            return
        if req.stop:
            self.require_tokenizer("stop (stop strings; use stop_token_ids)", "stop")
        if req.bad_words:
            self.require_tokenizer("bad_words", "bad_words")
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):
            value = getattr(req, name, None)
            if value is not None and not (name == "response_format" and value.type == "text"):
                self.require_tokenizer(f"{name} (structured output)", name)

    def check_unsupported(self, req) -> None:
        if req.use_beam_search:
            raise APIError(400, "use_beam_search: the server has no beam search (offline, LLM.beam_search has); n / best_of give "
                           "several samples",
                           param="use_beam_search")
        if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:
            # vLLM's rule: a non-empty stream_options needs stream = true ({} passes)
            raise APIError(400, "stream_options needs stream = true (as in OpenAI's API and vLLM)", param="stream_options")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs is not available with stream = true (as in vLLM); on "
                           "/v1/completions a stream sends the prompt's logprobs with echo = true and logprobs = k",
                           param="prompt_logprobs")
        if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop has {len(req.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                           param="stop")

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, *, prompt_param: str,
                           max_tokens_param: str = "max_tokens") -> int | None:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, and the prompt has "
                           f"{prompt_len} tokens, which leaves no room to generate", param=prompt_param,
                           code="context_length_exceeded")
        room = limit - prompt_len
        if requested is not None and requested > room:
            raise APIError(400, f"{max_tokens_param} = {requested} is too large: this model's maximum context "
                           f"length is {limit} tokens and the prompt has {prompt_len}, so at most {room} tokens "
                           f"can be generated", param=max_tokens_param, code="context_length_exceeded")
        default = self.engine.default_sampling.get("max_tokens")  # the generation config's max_new_tokens
        if default is not None:  # a cap, also of what the request asks (vLLM's get_max_tokens)
            return min(default, room if requested is None else requested)
        return requested

    def check_logprobs_counts(self, **asked: int | None) -> None:
        """Each request field of logprobs counts (-1: the vocabulary) within the engine's max_logprobs."""
        for name, value in asked.items():
            error = self.engine.logprobs_limit_error(name, value)
            if error is not None:
                raise APIError(400, error, param=name)

    @staticmethod
    def check_truncate_prompt_tokens(req) -> None:
        if req.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens must be >= 1, or -1 (the last max_model_len tokens)",
                           param="truncate_prompt_tokens")

    def validate_prompt(self, token_ids: list[int], params: SamplingParams, param: str) -> None:
        try:
            self.engine.validate_request(token_ids, params)
        except (ValueError, TypeError) as e:
            message = str(e)
            named = next((f for f in ("logit_bias", "allowed_token_ids", "bad_words") if message.startswith(f)), None)
            raise APIError(400, message, param=named or param) from e

    def sampling_params(self, req, *, max_tokens: int | None, logprobs: int | None,
                        best_of: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        if req.stream and best_of is not None and best_of != (req.n or 1):
            raise APIError(400, f"best_of = {best_of} with n = {req.n or 1} cannot be streamed: the best "
                           "candidates are known only at the end (use best_of = n, or stream = false)", param="best_of")
        structured = self.structured_outputs(req)
        default = self.engine.default_sampling  # the generation config's, for fields the request leaves out

        def pick(value, name: str, fallback):
            return value if value is not None else default.get(name, fallback)

        try:
            return SamplingParams(
                structured_outputs=structured,
                n=req.n or 1, best_of=best_of,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
                logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                prompt_logprobs=prompt_logprobs,
                temperature=pick(req.temperature, "temperature", 1.0),
                top_p=pick(req.top_p, "top_p", 1.0),
                top_k=pick(req.top_k, "top_k", 0),
                min_p=pick(req.min_p, "min_p", 0.0),
                seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                logprobs=logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
            )
        except (ValueError, TypeError) as e:
            message = str(e)
            param = next((f for f in _SAMPLING_FIELDS if message.startswith(f)), None)
            raise APIError(400, message, param=param) from e

    def structured_outputs(self, req) -> StructuredOutputsParams | None:
        """The request's output constraint from response_format, structured_outputs or guided_*
        (at most one of them), compiled once here so that a bad schema is a 400 naming its field."""
        given: list[tuple[str, dict]] = []
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format type 'json_schema' needs json_schema.schema", param="response_format")
            given.append(("response_format", {"json": fmt.json_schema.schema_}))
        if req.structured_outputs is not None:
            given.append(("structured_outputs", dict(req.structured_outputs)))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(req, f"guided_{kind}")
            if value is not None:
                given.append((f"guided_{kind}", {kind: value}))
        if not given:
            return None
        if len(given) > 1:
            raise APIError(400, f"give one output constraint, not {' and '.join(name for name, _ in given)}",
                           param=given[1][0])
        param, fields = given[0]
        try:
            spec = StructuredOutputsParams.coerce(fields)
            self.engine.structured.compile(spec)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=param) from e
        return spec

    # ---- running requests ----------------------------------------------------------------
    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def request_ids(self, prefix: str, req, raw: Request) -> tuple[str, str]:
        """(the answer's id, the engine's request id). As vLLM: `<prefix>-<X-Request-Id header>`, else
        `<prefix>-<the body's request_id>`, else a random id; the engine's id adds a random suffix to a
        client's, so two requests sending the same id never collide in the engine."""
        header = raw.headers.get("x-request-id")
        if header is not None and len(header) > MAX_REQUEST_ID_CHARS:
            raise APIError(400, f"the X-Request-Id header has {len(header)} characters; at most "
                           f"{MAX_REQUEST_ID_CHARS}", param="X-Request-Id")
        given = header or getattr(req, "request_id", None)
        if not given:
            request_id = self.new_id(prefix)
            return request_id, request_id
        request_id = f"{prefix}-{given}"
        return request_id, f"{request_id}-{uuid.uuid4().hex[:8]}"

    def stream_usage(self, req) -> tuple[bool, bool]:
        """(usage in a stream's last chunk, usage on every chunk) as vLLM decides them: stream_options'
        include_usage (default true once stream_options is given) or --enable-force-include-usage;
        continuous_usage_stats only with usage."""
        options = req.stream_options
        include = (bool(options.include_usage) if options is not None else False) or self.frontend.force_include_usage
        return include, include and options is not None and bool(options.continuous_usage_stats)

    def log_request(self, request_id: str, prompt: str | None, token_ids: Sequence[int], params: SamplingParams) -> None:
        """--enable-log-requests: the request's prompt, token ids and parameters at INFO (--max-log-len
        cuts the prompt's characters and the ids shown)."""
        if not self.frontend.log_requests:
            return
        cut = self.frontend.max_log_len
        shown_ids = list(token_ids if cut is None else token_ids[:cut])
        logger.info("request %r: prompt %r, params %s, prompt_token_ids %s%s", request_id,  # %r: ids are the client's
                    prompt if prompt is None or cut is None else prompt[:cut], params, shown_ids,
                    "" if len(shown_ids) == len(token_ids) else f" (first {len(shown_ids)} of {len(token_ids)})")

    def submit(self, items: Sequence[tuple[str, list[int], SamplingParams, str | None]],
               cache_salt: str | None = None) -> list[RequestStream]:
        """Queue (request_id, token_ids, params, prompt_text) items, all or none."""
        streams: list[RequestStream] = []
        try:
            for request_id, token_ids, params, text in items:
                streams.append(self.async_engine.add_request(request_id, token_ids, params, text, cache_salt=cache_salt))
        except (EngineOverloadedError, EngineDrainingError, EngineDeadError) as e:
            for stream in streams:
                self.async_engine.abort(stream.request_id)
            code = {EngineOverloadedError: "overloaded", EngineDrainingError: "shutting_down"}.get(type(e), "engine_dead")
            raise APIError(503, str(e), code=code, headers={"Retry-After": str(self.retry_after_s)}) from e
        return streams

    def abort_unfinished(self, streams: Sequence[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.async_engine.abort(stream.request_id)

    @staticmethod
    def engine_error(e: BaseException) -> APIError:
        """An APIError for an exception that ended an admitted request."""
        if isinstance(e, EngineDeadError):
            return APIError(500, str(e), code="engine_dead", type="server_error")
        if isinstance(e, RequestAbortedError):
            return APIError(503, str(e), code="aborted")
        if isinstance(e, (ValueError, TypeError)):
            return APIError(400, str(e))
        return APIError(500, f"{type(e).__name__}: {e}", type="server_error")

    @staticmethod
    async def wait_disconnect(raw: Request) -> None:
        """Return once the client has closed the connection (the body must already be read)."""
        try:
            while True:
                message = await raw.receive()
                if message["type"] == "http.disconnect":
                    return
        except Exception:  # noqa: BLE001 - a transport that cannot receive any more is a gone client
            return

    async def collect(self, streams: Sequence[RequestStream], raw: Request) -> list[RequestOutput]:
        """The final output of every stream; aborts them all if the client goes away first."""

        async def last(stream: RequestStream) -> RequestOutput:
            output = None
            async for output in stream:
                pass
            return output  # type: ignore[return-value]

        gathered = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        watcher = asyncio.ensure_future(self.wait_disconnect(raw))
        try:
            await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if gathered.done():
                try:
                    return gathered.result()
                except Exception as e:  # noqa: BLE001
                    raise self.engine_error(e) from e
            raise ClientDisconnected()
        finally:
            watcher.cancel()
            if not gathered.done():
                # a cancelled gather ends with CancelledError set as its exception (not as a cancelled
                # state); retrieve it when it lands, or asyncio logs "exception was never retrieved"
                gathered.add_done_callback(_retrieve)
                gathered.cancel()
            self.abort_unfinished(streams)

    async def merged(self, streams: Sequence[RequestStream], raw: Request) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) from all streams as they come; raises what ended a stream (ClientDisconnected
        when the client went away, after aborting every stream)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output, None))
            except Exception as e:  # noqa: BLE001
                queue.put_nowait((index, None, e))

        async def watch() -> None:
            await self.wait_disconnect(raw)
            queue.put_nowait((-1, None, ClientDisconnected()))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        tasks.append(asyncio.ensure_future(watch()))
        remaining = len(streams)
        try:
            while remaining:
                index, output, error = await queue.get()
                if error is not None:
                    raise error
                if output.finished:
                    remaining -= 1
                yield index, output
        finally:
            for task in tasks:
                task.cancel()
            self.abort_unfinished(streams)

    def record(self, endpoint: str, arrival: float, outputs: Sequence[RequestOutput]) -> None:
        self.metrics.count(endpoint, "success")
        self.record_finished(arrival, outputs)

    def record_finished(self, arrival: float, outputs: Sequence[RequestOutput]) -> None:
        for output in outputs:
            self.metrics.observe_finished(arrival, output)

    # ---- formatting ------------------------------------------------------------------------
    @staticmethod
    def holdback(params: SamplingParams) -> int:
        """Characters a stream holds back so that a stop string found later can still be cut off."""
        return max(0, params.max_stop_len - 1)

    @staticmethod
    def top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
        """The `n` likeliest of an entry (all of them for -1), best first."""
        return [(t, finite(lp)) for t, lp in sorted(entry.items(), key=lambda kv: -finite(kv[1]))[:n if n >= 0 else None]]

    def prompt_logprobs_field(self, output, k: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt position, None for the first, then `{token id:
        {"logprob", "rank", "decoded_token"}}` holding the prompt's token and the `k` likeliest. A
        top-k token's rank is 1 + the top tokens likelier than it; the prompt token's comes from
        the engine (it may lie outside the top k)."""
        entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        ranks = output.prompt_logprob_ranks or [None] * len(entries)
        field: list[dict[str, dict[str, Any]] | None] = []
        for token, entry, rank in zip(output.prompt_token_ids, entries, ranks):
            if entry is None:
                field.append(None)
                continue
            top = self.top(entry, k)  # the k likeliest, best first (the entry holds them and the prompt token)
            negated = [-lp for _, lp in top]  # ascending: bisect counts the likelier tokens (k may be the vocabulary)
            item: dict[str, dict[str, Any]] = {}
            for t, lp in [(token, finite(entry[token]))] + [(t, lp) for t, lp in top if t != token]:
                own = rank if t == token and rank is not None else 1 + bisect.bisect_left(negated, -lp)
                item[str(t)] = {"logprob": lp, "rank": own, "decoded_token": self.token_text(t) if self.tokenizer is not None else None}
            field.append(item)
        return field

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}
        # --enable-prompt-tokens-details: as vLLM, prompt_tokens_details only when some prompt tokens
        # came from kept prefixes (--enable-prefix-caching)
        if self.frontend.prompt_tokens_details and cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage

    @staticmethod
    def error_event(error: APIError) -> str:
        return sse(error.body())

"""The FastAPI application: routes, the auth and body-size guard, OpenAI-shaped errors, the engine's
lifetime, and the drain that runs before the server stops."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

import lamina
from lamina.engine.async_engine import AsyncEngine
from lamina.engine.llm_engine import LLMEngine
from lamina.entrypoints.openai.chat_tools import ChatOptions
from lamina.entrypoints.openai.metrics import ServerMetrics
from lamina.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelList
from lamina.entrypoints.openai.serving import APIError, FrontendOptions, OpenAIServing
from lamina.entrypoints.openai.serving_chat import create_chat_completion
from lamina.entrypoints.openai.serving_completions import create_completion
from lamina.entrypoints.openai.serving_tokens import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, create_detokenize, create_tokenize,
    tokenizer_info,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}
# OpenAI routes lamina does not serve, and why (docs/SERVING.md says more)
_NOT_SERVED = {
    "/v1/responses": "lamina does not serve the Responses API: it keeps no conversations or responses on the "
                     "server (previous_response_id, store, background) and runs no built-in tools; use "
                     "/v1/chat/completions",
    "/v1/embeddings": "lamina serves generation models only: the Qwen hybrid MoE checkpoints have no embedding "
                      "(pooling) head; use an embedding model with a server made for it",
}


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | tuple[str, ...] | None = None  # several: a request may carry any of them
    max_waiting_requests: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = 30.0
    retry_after_s: int = 1
    model_root: str | None = None
    chat: ChatOptions | None = None  # tool-call and reasoning parsers, chat template override
    log_stats_interval_s: float | None = None  # the engine-statistics line every this many seconds (None: off)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens 'token_id:N' unless a request says otherwise
    # CORS (vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials and
    # their defaults: any origin, method and header, no credentials)
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    fastapi_docs: bool = True  # /docs, /redoc and /openapi.json (vLLM's --disable-fastapi-docs turns them off)
    frontend: FrontendOptions = field(default_factory=FrontendOptions)  # usage, request ids, role, request logs


class ServerState:
    """What the routes share: the async engine, the serving logic, metrics and config."""

    def __init__(self, engine: LLMEngine, config: ServerConfig, async_engine: AsyncEngine | None = None):
        self.config = config
        self.async_engine = async_engine or AsyncEngine(
            engine, max_waiting_requests=config.max_waiting_requests, log_stats_interval_s=config.log_stats_interval_s)
        self.metrics = ServerMetrics(self.async_engine, config.served_model_names[0])
        self.serving = OpenAIServing(self.async_engine, config.served_model_names, self.metrics,
                                     retry_after_s=config.retry_after_s)
        self.serving.chat_options = config.chat or ChatOptions()
        self.serving.return_tokens_as_token_ids = config.return_tokens_as_token_ids
        self.serving.frontend = config.frontend

    async def drain(self, timeout_s: float | None = None, give_up=lambda: False) -> None:
        """Refuse new requests, give in-flight ones `timeout_s` to finish (or until `give_up()`), then end
        the rest with an error."""
        engine = self.async_engine
        engine.draining = True
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if engine.num_in_flight:
            logger.info("draining: waiting up to %.0f s for %d request(s)", timeout_s, engine.num_in_flight)
        while engine.num_in_flight and time.monotonic() < deadline and not give_up():
            await asyncio.sleep(0.05)
        aborted = engine.abort_all("the server is shutting down")
        if aborted:
            logger.warning("draining: aborted %d unfinished request(s)", aborted)
            await asyncio.sleep(0.2)  # let their handlers send the error


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class GuardMiddleware:
    """Plain ASGI middleware: API-key check on /v1 routes and /invocations, then a bound on request bodies (read here in
    full, up to the limit, and replayed to the app; the client's disconnect still reaches the app)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def _reply(self, send, error: APIError) -> None:
        response = _error_response(error)
        await response({"type": "http"}, None, send)  # type: ignore[arg-type]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        config = self.state.config
        headers = dict(scope.get("headers") or [])
        # the route's own path: uvicorn puts --root-path in front of it (ASGI's root_path rule)
        path = scope["path"]
        root = scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):]
        if config.api_key and (path.startswith("/v1") or path == "/invocations"):
            given = headers.get(b"authorization", b"")
            keys = (config.api_key,) if isinstance(config.api_key, str) else config.api_key
            # every key compared (no early exit), each in constant time
            if not sum(hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys):
                return await self._reply(send, APIError(
                    401, "a valid API key is needed: send 'Authorization: Bearer <key>'", code="invalid_api_key"))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = config.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size <= limit:
                chunks.append(body)
            if not message.get("more_body", False) or size > 8 * limit:
                break
        if size > limit:
            return await self._reply(send, APIError(
                413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large"))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class RequestIdHeaderMiddleware:
    """vLLM's --enable-request-id-headers: every HTTP answer carries `X-Request-Id`, the request's own
    header when it sent one (the answer's id then holds it too), else a new random id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        return await self.app(scope, receive, send_with_id)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "the request body is not valid", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    # drop union-member tags such as 'str' or 'list[int]' from the location
    path = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool", "dict")]
    param = path[0] if path else None
    where = ".".join(path) or "body"
    got = first.get("input")
    shown = json.dumps(got)[:80] if isinstance(got, (str, int, float, bool, type(None))) else type(got).__name__
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg')} (got {shown}){more}", param


def _engine_facts(engine: LLMEngine) -> dict:
    """lamina's fields of a model card: the vocabulary size (token-id prompts draw from [0, vocab_size)),
    the dtype the weights run in and the device's name (benchmark records carry both)."""
    import torch

    device = getattr(engine, "device", None)
    dtype = getattr(engine, "dtype", None)
    if device is not None and device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = None if device is None else device.type
    return {"vocab_size": getattr(getattr(engine, "model_config", None), "vocab_size", None),
            "dtype": None if dtype is None else str(dtype).removeprefix("torch."), "device_name": device_name}


def build_app(engine: LLMEngine, config: ServerConfig, *, async_engine: AsyncEngine | None = None) -> FastAPI:
    state = ServerState(engine, config, async_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.async_engine.stop)
            state.async_engine.fail_all("the server has shut down")

    docs = {} if config.fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="lamina", version=lamina.__version__, lifespan=lifespan,
                  summary="OpenAI-compatible server for the Qwen hybrid MoE models", **docs)
    app.state.lamina = state
    app.add_middleware(GuardMiddleware, state=state)
    if config.frontend.request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    # added last, so outermost: a browser's preflight (OPTIONS) is answered before the API key check
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                       allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)

    def count_error(request: Request, error: APIError) -> None:
        endpoint = _ENDPOINTS.get(request.url.path)
        if endpoint is None:
            return
        if error.code == "aborted":
            outcome = "aborted"
        elif error.status == 503:
            outcome = "rejected"
        else:
            outcome = "bad_request" if error.status < 500 else "error"
        state.metrics.count(endpoint, outcome)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        count_error(request, exc)
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        error = APIError(400, message, param=param)
        count_error(request, error)
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        error = APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
        return _error_response(error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error answering %s %s", request.method, request.url.path)
        error = APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
        count_error(request, error)
        return _error_response(error)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        engine_ = state.async_engine
        if not engine_.is_healthy:
            return _error_response(APIError(503, engine_.dead_error or "the engine is not running", code="engine_dead"))
        if engine_.draining:
            return _error_response(APIError(503, "the server is shutting down", code="shutting_down"))
        return {"status": "ok"}

    # vLLM's /ping (SageMaker's health check): /health's answer, to GET and POST
    app.add_api_route("/ping", health, methods=["GET", "POST"], responses={503: {"model": ErrorResponse}})

    @app.get("/version")
    async def version():
        return {"version": lamina.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    facts = _engine_facts(engine)

    def model_cards() -> list[dict]:
        # vLLM's card: root (the model's path), parent (a LoRA's base: none here), one permission entry
        permission = {"id": f"modelperm-{state.serving.created:x}", "object": "model_permission",
                      "created": state.serving.created, "allow_create_engine": False, "allow_sampling": True,
                      "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                      "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
        return [{"id": name, "object": "model", "created": state.serving.created, "owned_by": "lamina",
                 "root": config.model_root, "parent": None, "max_model_len": engine.max_model_len,
                 "permission": [permission], **facts}
                for name in config.served_model_names]

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def list_models():
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model_id:path}", responses=_ERROR_RESPONSES)
    async def get_model(model_id: str):
        for card in model_cards():
            if card["id"] == model_id:
                return card
        raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state.serving, body, request)

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state.serving, body, request)

    @app.post("/invocations", responses=_ERROR_RESPONSES)
    async def invocations(request: Request):
        """vLLM's SageMaker route: a chat request (with `messages`) or a completion request (with
        `prompt`), answered as /v1/chat/completions or /v1/completions would."""
        try:
            body = await request.json()
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        kind = ("chat" if isinstance(body, dict) and "messages" in body else
                "completions" if isinstance(body, dict) and "prompt" in body else None)
        if kind is None:
            raise APIError(400, "an /invocations body is a chat request (with 'messages') or a completion request "
                           "(with 'prompt')")
        model_cls, create = ((ChatCompletionRequest, create_chat_completion) if kind == "chat"
                             else (CompletionRequest, create_completion))
        try:
            parsed = model_cls.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
        return await create(state.serving, parsed, request)

    # vLLM's tokenizer routes (at the root, as vLLM's: lm-evaluation-harness looks for them there)
    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        return await create_tokenize(state.serving, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        return await create_detokenize(state.serving, body)

    @app.get("/tokenizer_info", responses=_ERROR_RESPONSES)
    async def get_tokenizer_info():
        return tokenizer_info(state.serving)

    def not_served(reason: str):
        async def refuse():
            raise APIError(404, reason, code="not_supported")
        return refuse

    for path, reason in _NOT_SERVED.items():
        app.add_api_route(path, not_served(reason), methods=["POST"], include_in_schema=False)

    return app

"""`POST /v1/completions`: one choice per prompt (a string, token ids, or a list of either)."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lamina.entrypoints.openai.protocol import MAX_BATCH_PROMPTS, CompletionRequest
from lamina.entrypoints.openai.serving import APIError, ClientDisconnected, OpenAIServing, finite, sse
from lamina.outputs import RequestOutput

ENDPOINT = "completions"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _prompts(prompt) -> list[str | list[int]]:
    """The request's prompts: a string or a token-id list is one prompt; a list of either is several."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: give a string, a list of token ids, or a list of those",
                       param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise APIError(400, f"{len(prompt)} prompts in one request; at most {MAX_BATCH_PROMPTS}", param="prompt")
    return list(prompt)


class _LogprobsBuilder:
    """OpenAI's completions logprobs (tokens, token_logprobs, top_logprobs, text_offset), built
    incrementally so a stream can send each token's entry once."""

    def __init__(self, serving: OpenAIServing, num: int, offset: int = 0):
        self.serving = serving
        self.num = num
        self.offset = offset
        self.done = 0

    def take(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        entries = entries or []
        end = min(len(token_ids), len(entries))
        for token_id, entry in zip(token_ids[self.done:end], entries[self.done:end]):
            text = self.serving.token_text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(finite(entry.get(token_id)))
            top: dict[str, float] = {}
            for t, lp in self.serving.top(entry, self.num):
                top.setdefault(self.serving.token_text(t), lp)  # distinct ids may share a text: keep the likelier
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        self.done = max(self.done, end)
        return out


async def create_completion(serving: OpenAIServing, req: CompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    model = serving.resolve_model(req.model)
    serving.check_unsupported(req)
    if req.best_of not in (None, 1):
        raise APIError(400, f"best_of = {req.best_of} is not supported (only 1)", param="best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (it needs prompt logprobs)", param="echo")
    prompts = _prompts(req.prompt)
    prepared = await serving.run_blocking(lambda: [serving.engine.prepare_prompt(p) for p in prompts], param="prompt")
    items = []
    request_id = serving.new_id("cmpl")
    for i, (text, token_ids) in enumerate(prepared):
        max_tokens = serving.resolve_max_tokens(len(token_ids), req.max_tokens, prompt_param="prompt")
        params = serving.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs)
        serving.validate_prompt(token_ids, params, "prompt")
        items.append((f"{request_id}-{i}", token_ids, params, text))
    echo_texts = [_echo_text(serving, text, ids) if req.echo else "" for text, ids in prepared]
    streams = serving.submit(items)
    created = int(time.time())

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(serving, streams, items, raw, request_id, created, model, req, echo_texts, include_usage, arrival),
            media_type="text/event-stream", headers=SSE_HEADERS,
        )

    try:
        outputs = await serving.collect(streams, raw)
    except ClientDisconnected:
        serving.metrics.count(ENDPOINT, "aborted")
        return Response(status_code=400)
    choices = []
    prompt_tokens = completion_tokens = 0
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        logprobs = None
        if req.logprobs is not None:
            logprobs = _LogprobsBuilder(serving, req.logprobs).take(completion.token_ids, completion.logprobs)
        choices.append({
            "index": i, "text": echo_texts[i] + completion.text, "logprobs": logprobs,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
        })
        prompt_tokens += len(output.prompt_token_ids)
        completion_tokens += len(completion.token_ids)
    serving.record(ENDPOINT, arrival, outputs)
    return JSONResponse({
        "id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
        "usage": serving.usage(prompt_tokens, completion_tokens), "system_fingerprint": None,
    })


def _echo_text(serving: OpenAIServing, text: str | None, token_ids: list[int]) -> str:
    if text is not None:
        return text
    return serving.tokenizer.decode(token_ids) if serving.tokenizer is not None else ""


async def _stream(serving: OpenAIServing, streams, items, raw: Request, request_id: str, created: int, model: str,
                  req: CompletionRequest, echo_texts: list[str], include_usage: bool, arrival: float):
    n = len(streams)
    sent_chars = [0] * n
    holdback = [serving.holdback(params) for _, _, params, _ in items]
    builders = [_LogprobsBuilder(serving, req.logprobs, len(echo_texts[i])) if req.logprobs is not None else None
                for i in range(n)]
    finals: list[RequestOutput | None] = [None] * n

    def chunk(choices: list[dict], usage=None) -> str:
        body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "system_fingerprint": None}
        if include_usage:
            body["usage"] = usage
        return sse(body)

    outcome = "aborted"  # unless it ends otherwise: the client went away mid-stream
    try:
        for i, echo in enumerate(echo_texts):
            if echo:
                yield chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])
        async with aclosing(serving.merged(streams, raw)) as updates:
            async for i, output in updates:
                completion = output.outputs[0]
                safe = len(completion.text) if output.finished else len(completion.text) - holdback[i]
                delta = completion.text[sent_chars[i]:safe] if safe > sent_chars[i] else ""
                sent_chars[i] = max(sent_chars[i], safe)
                logprobs = builders[i].take(completion.token_ids, completion.logprobs) if builders[i] else None
                if not delta and not output.finished and not (logprobs and logprobs["tokens"]):
                    continue
                choice = {"index": i, "text": delta, "logprobs": logprobs,
                          "finish_reason": completion.finish_reason if output.finished else None}
                if output.finished:
                    choice["stop_reason"] = completion.stop_reason
                    finals[i] = output
                yield chunk([choice])
        if include_usage:
            prompt_tokens = sum(len(o.prompt_token_ids) for o in finals if o)
            completion_tokens = sum(len(o.outputs[0].token_ids) for o in finals if o)
            yield chunk([], serving.usage(prompt_tokens, completion_tokens))
        outcome = "success"
        serving.record_finished(arrival, [o for o in finals if o])
        yield sse("[DONE]")
    except ClientDisconnected:
        pass
    except Exception as e:  # noqa: BLE001 - a stream ends with an error event, never a dropped connection
        error = serving.engine_error(e)
        outcome = "aborted" if error.code == "aborted" else "error"
        yield serving.error_event(error)
        yield sse("[DONE]")
    finally:
        serving.abort_unfinished(streams)
        serving.metrics.count(ENDPOINT, outcome)

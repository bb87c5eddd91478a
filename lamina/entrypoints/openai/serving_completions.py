"""`POST /v1/completions`: `n` choices per prompt (a string, token ids, or a list of either); choice
`i * n + j` is completion j of prompt i. `echo` with `logprobs` returns the prompt's logprobs first
(the first prompt token's logprob is null), also with `max_tokens = 0` (the prompt alone), which is
what lm-evaluation-harness's loglikelihood requests send."""

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
    incrementally so a stream can send each token's entry once. An entry of None (the first prompt
    token under echo) gives a null logprob and null top_logprobs, as vLLM answers.

    `top_logprobs` holds the position's own token (sampled, or the prompt's under echo) and the `num`
    likeliest: `num + 1` entries when that token is not among them, `num` when it is (`logprobs: 0`
    gives the token alone), as OpenAI's legacy completions and vLLM answer; the token first, then the
    others likeliest first (vLLM's order). The engine's entry holds the token's logprob even when it
    lies outside the top `num`. `as_ids` (vLLM's `return_tokens_as_token_ids`): tokens are named
    `token_id:N`; `text_offset` still counts the tokens' text."""

    def __init__(self, serving: OpenAIServing, num: int, offset: int = 0, as_ids: bool = False):
        self.serving = serving
        self.num = num
        self.offset = offset
        self.as_ids = as_ids
        self.done = 0

    def take(self, token_ids: list[int], entries: list[dict[int, float] | None] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        entries = entries or []
        end = min(len(token_ids), len(entries))
        for token_id, entry in zip(token_ids[self.done:end], entries[self.done:end]):
            text = self.serving.token_text(token_id)
            name = self.serving.logprob_token(token_id, self.as_ids)
            out["tokens"].append(name)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                own = finite(entry.get(token_id))
                out["token_logprobs"].append(own)
                top: dict[str, float] = {name: own} if token_id in entry else {}
                for t, lp in self.serving.top(entry, self.num):
                    if t != token_id:  # distinct ids may share a text: keep the first (the token's own, or likelier)
                        top.setdefault(self.serving.logprob_token(t, self.as_ids), lp)
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        self.done = max(self.done, end)
        return out


def _merge_logprobs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {key: a[key] + b[key] for key in a}


class _Choice:
    """One choice of the answer: completion `completion_index` of prompt `prompt_index`, with what a
    stream has sent of it so far."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, index: int, echo_text: str,
                 prompt_ids: list[int], holdback: int, generate: bool):
        self.index = index
        self.echo_text = echo_text
        self.prompt_ids = prompt_ids
        self.holdback = holdback
        self.generate = generate  # False for echo with max_tokens = 0: the generated token is dropped
        self.builder = (_LogprobsBuilder(serving, req.logprobs, as_ids=serving.tokens_as_ids(req))
                        if req.logprobs is not None else None)
        self.echo_logprobs = req.echo and req.logprobs is not None
        # token ids in the answer: asked for, or the only output there is without a tokenizer
        self.with_ids = bool(req.return_token_ids) or serving.tokenizer is None
        self.sent_chars = 0
        self.generated = 0  # tokens generated so far (continuous usage stats)
        self.sent_ids = 0
        self.sent_prompt_ids = False
        self.echoed = False
        self.done = False

    def prompt_logprobs(self, output: RequestOutput) -> dict[str, Any] | None:
        """The prompt's logprobs under echo (first token None), once."""
        if not self.echo_logprobs or self.builder is None:
            return None
        entries = output.prompt_logprobs or [None] * len(self.prompt_ids)
        prompt = _LogprobsBuilder(self.builder.serving, self.builder.num, as_ids=self.builder.as_ids)
        out = prompt.take(self.prompt_ids, entries)
        self.builder.offset = prompt.offset
        return out

    def update(self, completion, finished: bool) -> tuple[str, dict[str, Any] | None]:
        """(new text, new logprobs) of this choice since the last call."""
        if not self.generate:
            return "", None
        safe = len(completion.text) if finished else len(completion.text) - self.holdback
        delta = completion.text[self.sent_chars:safe] if safe > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, safe)
        logprobs = self.builder.take(completion.token_ids, completion.logprobs) if self.builder else None
        return delta, logprobs

    def token_id_fields(self, completion, *, final: bool) -> dict[str, Any]:
        """`prompt_token_ids` (once) and the generated ids not sent yet (all of them when `final`),
        when this choice returns token ids; nothing otherwise."""
        if not self.with_ids:
            return {}
        ids = list(completion.token_ids) if self.generate and completion is not None else []
        fields: dict[str, Any] = {}
        if not self.sent_prompt_ids:
            self.sent_prompt_ids = True
            fields["prompt_token_ids"] = self.prompt_ids
        fields["token_ids"] = ids if final else ids[self.sent_ids:]
        self.sent_ids = len(ids)
        return fields


async def create_completion(serving: OpenAIServing, req: CompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    model = serving.resolve_model(req.model)
    serving.check_unsupported(req)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    echo_only = req.max_tokens == 0
    if echo_only and not req.echo:
        raise APIError(400, "max_tokens = 0 needs echo = true (the prompt alone is the answer)", param="max_tokens")
    n = req.n or 1
    prompts = _prompts(req.prompt)
    if any(isinstance(p, str) for p in prompts):
        serving.require_tokenizer("a text prompt", "prompt")
    serving.check_tokenizer_needs(req)
    if len(prompts) * max(n, req.best_of or 1) > MAX_BATCH_PROMPTS:
        raise APIError(400, f"{len(prompts)} prompts x {max(n, req.best_of or 1)} completions is more than "
                       f"{MAX_BATCH_PROMPTS} sequences in one request", param="n")
    serving.check_truncate_prompt_tokens(req)
    serving.check_logprobs_counts(logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs)
    prepared = await serving.run_blocking(lambda: [serving.engine.prepare_request_prompt(p, req.truncate_prompt_tokens)
                                                   for p in prompts], param="prompt")
    items = []
    request_id, engine_id = serving.request_ids("cmpl", req, raw)
    for i, (text, token_ids) in enumerate(prepared):
        max_tokens = serving.resolve_max_tokens(len(token_ids), 1 if echo_only else req.max_tokens,
                                                prompt_param="prompt")
        params = serving.sampling_params(
            req, max_tokens=max_tokens, logprobs=req.logprobs, best_of=req.best_of,
            prompt_logprobs=_prompt_logprobs_wanted(req),
        )
        serving.validate_prompt(token_ids, params, "prompt")
        items.append((f"{engine_id}-{i}", token_ids, params, text))
    for item_id, token_ids, params, text in items:
        serving.log_request(item_id, text, token_ids, params)
    # echo shows the prompt the model ran: with truncate_prompt_tokens, the kept tokens' text
    echo_texts = [_echo_text(serving, None if req.truncate_prompt_tokens is not None else text, ids) if req.echo
                  else "" for text, ids in prepared]
    choices = [[_Choice(serving, req, i * n + j, echo_texts[i], prepared[i][1], serving.holdback(items[i][2]),
                        not echo_only) for j in range(n)] for i in range(len(prepared))]
    streams = serving.submit(items, cache_salt=req.cache_salt)
    created = int(time.time())

    if req.stream:
        include_usage, continuous_usage = serving.stream_usage(req)
        return StreamingResponse(
            _stream(serving, streams, choices, raw, request_id, created, model, include_usage, arrival, echo_only,
                    continuous_usage),
            media_type="text/event-stream", headers=SSE_HEADERS,
        )

    try:
        outputs = await serving.collect(streams, raw)
    except ClientDisconnected:
        serving.metrics.count(ENDPOINT, "aborted")
        return Response(status_code=400)
    body_choices = []
    prompt_tokens = completion_tokens = 0
    for i, output in enumerate(outputs):
        for choice, completion in zip(choices[i], output.outputs):
            echo_logprobs = choice.prompt_logprobs(output)
            text, logprobs = choice.update(completion, True)
            if echo_logprobs is not None:
                logprobs = _merge_logprobs(echo_logprobs, logprobs) if logprobs is not None else echo_logprobs
            body_choices.append({
                "index": choice.index, "text": choice.echo_text + text, "logprobs": logprobs,
                "finish_reason": "length" if echo_only else completion.finish_reason,
                "stop_reason": None if echo_only else completion.stop_reason,
                **choice.token_id_fields(completion, final=True),
            })
            if req.prompt_logprobs is not None:  # vLLM's field, on each choice of the prompt
                body_choices[-1]["prompt_logprobs"] = serving.prompt_logprobs_field(output, req.prompt_logprobs)
            completion_tokens += 0 if echo_only else len(completion.token_ids)
        prompt_tokens += len(output.prompt_token_ids)
    serving.record(ENDPOINT, arrival, outputs)
    return JSONResponse({
        "id": request_id, "object": "text_completion", "created": created, "model": model, "choices": body_choices,
        "usage": serving.usage(prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in outputs)),
        "system_fingerprint": None,
    })


def _prompt_logprobs_wanted(req: CompletionRequest) -> int | None:
    """The engine's prompt_logprobs: vLLM's field, and echo's prompt entries (echo with logprobs)."""
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    if -1 in wanted:  # the whole vocabulary
        return -1
    return max(wanted) if wanted else None


def _echo_text(serving: OpenAIServing, text: str | None, token_ids: list[int]) -> str:
    if text is not None:
        return text
    return serving.tokenizer.decode(token_ids) if serving.tokenizer is not None else ""


async def _stream(serving: OpenAIServing, streams, choices: list[list[_Choice]], raw: Request, request_id: str,
                  created: int, model: str, include_usage: bool, arrival: float, echo_only: bool,
                  continuous_usage: bool):
    """`continuous_usage` (vLLM's stream_options.continuous_usage_stats): every chunk carries its
    choice's usage so far, as vLLM counts it: `prompt_tokens` of that choice's prompt, and
    `completion_tokens` of that choice alone (with several prompts or n > 1 too); the last chunk
    (no choices) carries the totals over all prompts and choices."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    by_index = {choice.index: choice for row in choices for choice in row}

    def chunk(body_choices: list[dict], usage=None) -> str:
        body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": body_choices, "system_fingerprint": None}
        if include_usage:
            if usage is None and continuous_usage:  # one choice per chunk: its own numbers
                mine = [by_index[c["index"]] for c in body_choices]
                usage = serving.usage(sum(len(c.prompt_ids) for c in mine),
                                      0 if echo_only else sum(c.generated for c in mine))
            body["usage"] = usage
        return sse(body)

    outcome = "aborted"  # unless it ends otherwise: the client went away mid-stream
    try:
        for row in choices:
            for choice in row:
                if choice.echo_text and not choice.echo_logprobs:
                    choice.echoed = True
                    yield chunk([{"index": choice.index, "text": choice.echo_text, "logprobs": None,
                                  "finish_reason": None}])
        async with aclosing(serving.merged(streams, raw)) as updates:
            async for i, output in updates:
                for completion in output.outputs:
                    choice = choices[i][completion.index]
                    choice.generated = len(completion.token_ids)
                    if choice.done or (choice.echo_logprobs and not choice.echoed and output.prompt_logprobs is None):
                        continue  # (the prompt's logprobs come with the first child's first token)
                    finished = completion.finish_reason is not None
                    echo_text, echo_logprobs = "", None
                    if not choice.echoed:  # echo with logprobs: the prompt's logprobs are known now
                        choice.echoed = True
                        # first: the generated tokens' text offsets count from the prompt's end
                        echo_text, echo_logprobs = choice.echo_text, choice.prompt_logprobs(output)
                    text, logprobs = choice.update(completion, finished)
                    text = echo_text + text
                    if echo_logprobs is not None:
                        logprobs = _merge_logprobs(echo_logprobs, logprobs) if logprobs else echo_logprobs
                    ids = choice.token_id_fields(completion, final=False)
                    news = text or (logprobs and logprobs["tokens"]) or ids.get("token_ids") or "prompt_token_ids" in ids
                    if not news and not finished:
                        continue
                    body = {"index": choice.index, "text": text, "logprobs": logprobs,
                            "finish_reason": None, **ids}
                    if finished:
                        choice.done = True
                        body["finish_reason"] = "length" if echo_only else completion.finish_reason
                        body["stop_reason"] = None if echo_only else completion.stop_reason
                    yield chunk([body])
                if output.finished:
                    finals[i] = output
        if include_usage:
            prompt_tokens = sum(len(o.prompt_token_ids) for o in finals if o)
            completion_tokens = 0 if echo_only else sum(len(c.token_ids) for o in finals if o for c in o.outputs)
            yield chunk([], serving.usage(prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in finals if o)))
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

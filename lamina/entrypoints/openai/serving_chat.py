"""`POST /v1/chat/completions`: the tokenizer's chat template over the messages, then one choice."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lamina.entrypoints.chat_messages import MessageError, normalize_messages
from lamina.entrypoints.openai.chat_output import REASONING_FIELDS, ChatOutputParser
from lamina.entrypoints.openai.chat_tools import (ENFORCED_CHOICES, RESERVED_TEMPLATE_KWARGS, ChatOptions, output_parser,
                                                  resolve_tool_choice, tool_choice_structured_output)
from lamina.entrypoints.openai.protocol import ChatCompletionRequest
from lamina.entrypoints.openai.reasoning_parser import THINK_END
from lamina.entrypoints.openai.serving import APIError, ClientDisconnected, OpenAIServing, finite, sse
from lamina.entrypoints.openai.serving_completions import SSE_HEADERS

ENDPOINT = "chat"

def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat templates read them (lamina.entrypoints.chat_messages);
    a message the template cannot take is a 400 naming it."""
    try:
        return normalize_messages([m.model_dump(exclude_none=True) for m in req.messages])
    except MessageError as e:
        raise APIError(400, str(e), param=e.param) from None


def _check_chat_options(req: ChatCompletionRequest, options: ChatOptions) -> None:
    if req.chat_template is not None and not options.trust_request_chat_template:
        raise APIError(400, "a chat_template in the request needs the server started with "
                       "--trust-request-chat-template (as in vLLM); or start it with --chat-template",
                       param="chat_template")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs = true", param="top_logprobs")
    bad = RESERVED_TEMPLATE_KWARGS.intersection(req.chat_template_kwargs or {})
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(sorted(bad))}", param="chat_template_kwargs")


def chat_options(serving: OpenAIServing) -> ChatOptions:
    return getattr(serving, "chat_options", None) or ChatOptions()


def _apply_template(serving: OpenAIServing, req: ChatCompletionRequest, messages: list[dict]) -> list[int]:
    tokenizer = serving.tokenizer
    options = chat_options(serving)
    template = req.chat_template if options.trust_request_chat_template and req.chat_template else options.chat_template
    if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
        raise APIError(400, "this model has no chat template (start the server with --chat-template); use "
                       "/v1/completions", param="messages")
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=req.tools, chat_template=template, tokenize=True,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **((options.default_chat_template_kwargs or {}) | (req.chat_template_kwargs or {})),
        )
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template failing on these messages is the request's problem
        raise APIError(400, f"the chat template could not be applied to these messages: {type(e).__name__}: {e}",
                       param="messages") from e
    if hasattr(ids, "keys") and "input_ids" in ids:  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _logprobs_entries(serving: OpenAIServing, token_ids: list[int], entries, start: int, num: int,
                      as_ids: bool = False) -> list[dict]:
    """Chat logprobs of tokens `start:`; `as_ids`: tokens named `token_id:N` (their `bytes` stay the
    token's own)."""
    content = []
    for token_id, entry in zip(token_ids[start:], (entries or [])[start:]):
        content.append({
            "token": serving.logprob_token(token_id, as_ids), "logprob": finite(entry.get(token_id)),
            "bytes": serving.token_byte_list(token_id),
            "top_logprobs": [{"token": serving.logprob_token(tid, as_ids), "logprob": lp,
                              "bytes": serving.token_byte_list(tid)} for tid, lp in serving.top(entry, num)],
        })
    return content


def _enforce_after_reasoning(serving: OpenAIServing, structured) -> None:
    """The prompt opened a think block and the reasoning parser is on: the request's own constraint
    (response_format, structured_outputs, guided_*) applies after the reasoning, from the token after
    `</think>` (vLLM's rule), so the model thinks freely and the constrained answer is the content.
    Without a single `</think>` token in the vocabulary the constraint applies from the start."""
    end_id = serving.tokenizer.convert_tokens_to_ids(THINK_END)
    if isinstance(end_id, int) and end_id != serving.tokenizer.unk_token_id and \
            serving.tokenizer.convert_ids_to_tokens(end_id) == THINK_END:
        structured.enforce_after_token_id = end_id


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    model = serving.resolve_model(req.model)
    serving.require_tokenizer("/v1/chat/completions (its chat template)", "messages")
    serving.check_unsupported(req)
    options = chat_options(serving)
    _check_chat_options(req, options)
    choice, function = resolve_tool_choice(options, req.tools, req.tool_choice)
    tool_constraint = None
    if choice in ENFORCED_CHOICES:  # compiling the tools' grammar: off the event loop
        tool_constraint = await serving.run_blocking(tool_choice_structured_output, options, req, choice, function,
                                                     serving.engine, param="tools")
    messages = _messages(req)
    # vLLM's echo: the answer's content starts with the last message's when that is the assistant's
    echo = messages[-1]["content"] if req.echo and messages[-1].get("role") == "assistant" else ""
    serving.check_truncate_prompt_tokens(req)
    token_ids = await serving.run_blocking(_apply_template, serving, req, messages, param="messages")
    token_ids = serving.engine.truncate_prompt(token_ids, req.truncate_prompt_tokens)
    prompt_tail = serving.tokenizer.decode(token_ids[-8:]) if options.reasoning_parser else ""
    parser = output_parser(options, req.tools, choice, function, prompt_tail, req.parallel_tool_calls)
    # both given: max_completion_tokens (OpenAI's current name) wins, as in vLLM
    requested, name = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                       else (req.max_tokens, "max_tokens"))
    max_tokens = serving.resolve_max_tokens(len(token_ids), requested, prompt_param="messages", max_tokens_param=name)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    serving.check_logprobs_counts(top_logprobs=num_logprobs, prompt_logprobs=req.prompt_logprobs)
    params = serving.sampling_params(req, max_tokens=max_tokens, logprobs=num_logprobs, best_of=getattr(req, "best_of", None),
                                     prompt_logprobs=req.prompt_logprobs)
    if tool_constraint is not None:  # the request has no other constraint (tool_choice_structured_output)
        params.structured_outputs = tool_constraint
    elif params.structured_outputs is not None and parser.reasoning is not None and parser.reasoning.opened_in_prompt:
        _enforce_after_reasoning(serving, params.structured_outputs)
    serving.validate_prompt(token_ids, params, "messages")
    request_id, engine_id = serving.request_ids("chatcmpl", req, raw)
    serving.log_request(request_id, None, token_ids, params)
    [stream] = serving.submit([(engine_id, token_ids, params, None)], cache_salt=req.cache_salt)
    created = int(time.time())
    # vLLM's role rule: the server's response role after a generation prompt, else the last message's
    role = serving.frontend.response_role if req.add_generation_prompt else messages[-1].get("role", "assistant")
    with_ids = bool(req.return_token_ids)

    if req.stream:
        include_usage, continuous_usage = serving.stream_usage(req)
        return StreamingResponse(
            _stream(serving, stream, params, raw, request_id, created, model, num_logprobs, include_usage, arrival,
                    continuous_usage, token_ids, echo,
                    [output_parser(options, req.tools, choice, function, prompt_tail, req.parallel_tool_calls)
                     for _ in range(params.n)], serving.tokens_as_ids(req), role, with_ids),
            media_type="text/event-stream", headers=SSE_HEADERS,
        )

    try:
        [output] = await serving.collect([stream], raw)
    except ClientDisconnected:
        serving.metrics.count(ENDPOINT, "aborted")
        return Response(status_code=400)
    choices = []
    for completion in output.outputs:  # n choices, each parsed on its own (reasoning, tool calls)
        logprobs = None
        if num_logprobs is not None:
            logprobs = {"content": _logprobs_entries(serving, completion.token_ids, completion.logprobs, 0,
                                                     num_logprobs, serving.tokens_as_ids(req)), "refusal": None}
        message: dict[str, Any] = {"role": role, "content": completion.text, "refusal": None, "tool_calls": []}
        finish_reason = completion.finish_reason
        if parser.active:
            fields = parser.parse(completion.text)
            message.update(content=fields.content, tool_calls=fields.tool_calls)
            if options.reasoning_parser is not None:  # null when an enforced tool choice leaves no reasoning
                message.update(dict.fromkeys(REASONING_FIELDS, fields.reasoning_content))
            finish_reason = parser.finish_reason(finish_reason, bool(fields.tool_calls))
        if echo:
            message["content"] = echo + (message["content"] or "")
        choices.append({
            "index": completion.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": completion.stop_reason, **({"token_ids": list(completion.token_ids)} if with_ids else {}),
        })
    serving.record(ENDPOINT, arrival, [output])
    body = {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": choices,
        "usage": serving.usage(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs),
                               output.num_cached_tokens),
        "system_fingerprint": None,
    }
    if req.prompt_logprobs is not None:  # vLLM's field: the templated prompt's tokens
        body["prompt_logprobs"] = serving.prompt_logprobs_field(output, req.prompt_logprobs)
    if with_ids:  # vLLM's return_token_ids: the templated prompt's ids
        body["prompt_token_ids"] = list(output.prompt_token_ids)
    return JSONResponse(body)


async def _stream(serving: OpenAIServing, stream, params, raw: Request, request_id: str, created: int, model: str,
                  num_logprobs: int | None, include_usage: bool, arrival: float, continuous_usage: bool,
                  prompt_ids: list[int], echo: str, parsers: list[ChatOutputParser], tokens_as_ids: bool = False,
                  role: str = "assistant", with_ids: bool = False):
    """`parsers`: one output parser per choice (streamed parsing keeps state); `tokens_as_ids`: logprobs
    name tokens `token_id:N`; `role`: the first chunk's; `with_ids` (vLLM's return_token_ids): the
    stream's first chunk carries `prompt_token_ids` (at its top level, as vLLM's chat), every later
    choice its new `token_ids`. `continuous_usage`
    (vLLM's stream_options.continuous_usage_stats): every chunk carries its choice's usage so far (the
    prompt's tokens and that choice's tokens, as vLLM counts them with n > 1); the last chunk, the
    totals over all choices."""
    holdback = serving.holdback(params)
    n = params.n
    sent_chars, sent_tokens, done = [0] * n, [0] * n, [False] * n
    generated = [0] * n  # tokens of each choice so far
    sent_ids = [0] * n  # generated ids sent (with_ids)
    prompt_tokens = len(prompt_ids)

    def new_ids(j: int, token_ids) -> dict:
        if not with_ids:
            return {}
        ids = list(token_ids[sent_ids[j]:])
        sent_ids[j] = len(token_ids)
        return {"token_ids": ids}

    def chunk(choices: list[dict], usage=None, top: dict | None = None) -> str:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, "system_fingerprint": None, **(top or {})}
        if include_usage:
            if usage is None and continuous_usage:  # one choice per chunk: its own numbers
                usage = serving.usage(prompt_tokens, sum(generated[c["index"]] for c in choices))
            body["usage"] = usage
        return sse(body)

    outcome = "aborted"  # unless it ends otherwise: the client went away mid-stream
    try:
        for index in range(n):
            yield chunk([{"index": index, "delta": {"role": role, "content": ""}, "logprobs": None,
                          "finish_reason": None}], top=({"prompt_token_ids": list(prompt_ids)} if with_ids and index == 0
                                                       else None))
            if echo:  # vLLM's echo: the final assistant message's content first
                yield chunk([{"index": index, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}])
        final = None
        async with aclosing(serving.merged([stream], raw)) as updates:
            async for _, output in updates:
                if output.finished:
                    final = output
                for completion in output.outputs:
                    generated[completion.index] = len(completion.token_ids)
                for completion in output.outputs:
                    j = completion.index
                    if done[j]:
                        continue
                    finished = completion.finish_reason is not None
                    safe = len(completion.text) if finished else len(completion.text) - holdback
                    chooser = parsers[j]
                    if chooser.active:  # reasoning / tool calls: the parser's deltas of the text so far
                        deltas = chooser.deltas(completion.text[:max(safe, sent_chars[j])], finished)
                    else:
                        deltas = [{"content": completion.text[sent_chars[j]:safe]}] if safe > sent_chars[j] else []
                    sent_chars[j] = max(sent_chars[j], safe)
                    logprobs = None
                    if num_logprobs is not None:
                        entries = _logprobs_entries(serving, completion.token_ids, completion.logprobs, sent_tokens[j],
                                                    num_logprobs, tokens_as_ids)
                        sent_tokens[j] += len(entries)
                        logprobs = {"content": entries, "refusal": None} if entries else None
                    if not deltas and not finished and logprobs is None:
                        continue
                    for delta in deltas[:-1]:
                        yield chunk([{"index": j, "delta": delta, "logprobs": None, "finish_reason": None}])
                    choice: dict[str, Any] = {"index": j, "delta": deltas[-1] if deltas else {},
                                              "logprobs": logprobs, "finish_reason": None,
                                              **new_ids(j, completion.token_ids)}
                    if finished:
                        done[j] = True
                        choice["finish_reason"] = chooser.finish_reason(completion.finish_reason, chooser.called_tools)
                        choice["stop_reason"] = completion.stop_reason
                    yield chunk([choice])
        if include_usage and final is not None:
            yield chunk([], serving.usage(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs),
                                          final.num_cached_tokens))
        outcome = "success"
        if final is not None:
            serving.record_finished(arrival, [final])
        yield sse("[DONE]")
    except ClientDisconnected:
        pass
    except Exception as e:  # noqa: BLE001 - a stream ends with an error event, never a dropped connection
        error = serving.engine_error(e)
        outcome = "aborted" if error.code == "aborted" else "error"
        yield serving.error_event(error)
        yield sse("[DONE]")
    finally:
        serving.abort_unfinished([stream])
        serving.metrics.count(ENDPOINT, outcome)

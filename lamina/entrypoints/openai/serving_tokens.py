"""vLLM's tokenizer endpoints: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Same request and response shapes as vLLM's, so that clients written for it (lm-evaluation-harness's
remote tokenizer backend among them) use the server's tokenizer instead of fetching one from a hub.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from lamina.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, TokenId, _Request
from lamina.entrypoints.openai.serving import APIError, OpenAIServing
from lamina.entrypoints.openai.serving_chat import _apply_template, _check_chat_options, _messages, chat_options

MAX_DETOKENIZE_TOKENS = 1 << 20


# ---- bodies ------------------------------------------------------------------------------
class TokenizeRequest(_Request):
    """A text `prompt`, or chat `messages` (run through the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # default as vLLM: True for a prompt, False for messages (the template writes the special tokens)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as on /v1/chat/completions (needs --trust-request-chat-template)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- handlers ----------------------------------------------------------------------------
def _tokenizer(serving: OpenAIServing, route: str):
    tokenizer = serving.tokenizer
    if tokenizer is None:
        if getattr(serving.engine, "args", None) is not None and serving.engine.args.skip_tokenizer_init:
            why = "the server runs without one (--skip-tokenizer-init)"
        else:
            why = "this model has none (no tokenizer files next to the checkpoint, and no --tokenizer)"
        raise APIError(400, f"{route} needs a tokenizer, and {why}; send token ids to /v1/completions instead",
                       code="no_tokenizer")
    return tokenizer


def _special_tokens_around(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer adds around any text (BOS / EOS; none for Qwen's)."""
    ids = list(tokenizer.encode("", add_special_tokens=True))
    bos = [t for t in ids[:1] if t == tokenizer.bos_token_id]
    return bos, ids[len(bos):]


def _tokenize_chat(serving: OpenAIServing, req: TokenizeRequest) -> list[int]:
    if req.add_generation_prompt and req.continue_final_message:
        raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true; set "
                       "add_generation_prompt to false to continue the last message", param="continue_final_message")
    chat = ChatCompletionRequest(
        messages=req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, chat_template_kwargs=req.chat_template_kwargs,
        chat_template=req.chat_template,
    )
    _check_chat_options(chat, chat_options(serving))  # the same template arguments as a chat request may give
    ids = _apply_template(serving, chat, _messages(chat))
    if req.add_special_tokens:
        before, after = _special_tokens_around(serving.tokenizer)
        ids = before + ids + after
    return ids


async def create_tokenize(serving: OpenAIServing, req: TokenizeRequest) -> dict:
    serving.resolve_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt (a string) or messages (a chat)",
                       param="prompt" if req.prompt is None else "messages")
    tokenizer = _tokenizer(serving, "/tokenize")
    if req.messages is not None:
        ids = await serving.run_blocking(_tokenize_chat, serving, req, param="messages")
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await serving.run_blocking(
            lambda: list(tokenizer.encode(req.prompt, add_special_tokens=add_special)), param="prompt")
    ids = [int(t) for t in ids]
    token_strs = None
    if req.return_token_strs:
        token_strs = [str(t) for t in await serving.run_blocking(tokenizer.convert_ids_to_tokens, ids)]
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": token_strs}


async def create_detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> dict:
    serving.resolve_model(req.model)
    vocab = serving.engine.model_config.vocab_size
    bad = [t for t in req.tokens if t >= vocab]
    if bad:
        raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
    tokenizer = _tokenizer(serving, "/detokenize")
    text = await serving.run_blocking(lambda: tokenizer.decode(req.tokens, skip_special_tokens=False), param="tokens")
    return {"prompt": text}


def _jsonable(value: Any, depth: int = 0) -> Any:
    """A tokenizer-config value as JSON (an AddedToken becomes its text); None for what has no JSON form."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "content") and isinstance(value.content, str):  # tokenizers.AddedToken
        return value.content
    if depth < 4 and isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if depth < 4 and isinstance(value, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in value]
    return None


def tokenizer_info(serving: OpenAIServing) -> dict:
    """The tokenizer's configuration (its tokenizer_config.json as loaded), the special tokens and the
    chat template: what lm-evaluation-harness's remote tokenizer reads (`eos_token`, `bos_token`,
    `pad_token`, `chat_template`). `chat_template` is the one /v1/chat/completions and /tokenize
    apply: `--chat-template` when the server has one, else the tokenizer's."""
    tokenizer = _tokenizer(serving, "/tokenizer_info")
    info = {str(k): _jsonable(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = _jsonable(getattr(tokenizer, name, None))
    template = chat_options(serving).chat_template or getattr(tokenizer, "chat_template", None)
    info["chat_template"] = _jsonable(template)
    info["tokenizer_class"] = type(tokenizer).__name__
    return info

"""Request and response bodies of the OpenAI wire format (the subset lamina serves), as pydantic models.

Requests are validated strictly: a string where a number belongs, a bool where an int belongs, NaN or
infinity all fail validation (and become a 400). Fields lamina does not know are ignored, as the
OpenAI clients send many optional ones. Ranges that need the model (context length, vocabulary) are
checked by the serving layer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from lamina.sampling_params import MAX_LOGIT_BIAS

MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 64
MAX_BATCH_PROMPTS = 1024
MAX_N = 64  # n and best_of: completions per prompt
MAX_LOGIT_BIAS_ENTRIES = 4096
MAX_BAD_WORDS = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 18


def _integral_float_to_int(value: Any) -> Any:
    """JSON has one number type: 16.0 is an integer in JSON Schema, so accept it where an int belongs
    (16.5, strings and booleans still fail)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(**constraints) -> Any:
    """An int field type (integral floats accepted) with its range constraints inside the type, so the
    OpenAPI schema shows them as minimum/maximum even within `| None`."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral_float_to_int)]


def _float(**constraints) -> Any:
    return Annotated[float, Field(**constraints)]


Int = _int()
TokenId = _int(ge=0)
NonEmptyStr = Annotated[str, Field(min_length=1)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# ---- requests ----------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool | None = True  # vLLM's default: `stream_options: {}` asks for usage
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, usage on every chunk too


class _SamplingFields(_Request):
    """Fields shared by completions and chat (OpenAI names, then vLLM's extras)."""

    model: str | None = None
    n: _int(ge=1, le=MAX_N) | None = 1
    temperature: _float(ge=0.0) | None = None
    top_p: _float(gt=0.0, le=1.0) | None = None
    seed: Int | None = None
    stop: str | list[str] | None = Field(default=None)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: _float(ge=-2.0, le=2.0) | None = None
    frequency_penalty: _float(ge=-2.0, le=2.0) | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    user: str | None = None
    # vLLM extras
    top_k: _int(ge=-1) | None = None
    min_p: _float(ge=0.0, le=1.0) | None = None
    min_tokens: _int(ge=0) = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: _int(ge=-1) | None = None  # vLLM's: the last k prompt tokens (-1: max_model_len)
    repetition_penalty: _float(gt=0.0) | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[NonEmptyStr], Field(max_length=MAX_BAD_WORDS)] | None = None
    prompt_logprobs: _int(ge=-1) | None = None  # -1: the whole vocabulary (within the engine's max_logprobs)
    # vLLM's extra: logprobs name each token `token_id:N` (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool = False  # vLLM's: refused (the server has no beam search), never silently sampled
    # vLLM's: the response id becomes `<prefix>-<request_id>` (an X-Request-Id header wins)
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # vLLM's: with --enable-prefix-caching, kept prompt prefixes are shared only between requests
    # with the same salt (tenants that must not learn of each other's prompts by timing)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's extra: the response carries `prompt_token_ids`, each choice its generated `token_ids`; always on
    # when the server runs without a tokenizer (completions: its text is empty then)
    return_token_ids: bool | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():  # OpenAI's range (offline, SamplingParams takes any finite bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r} "
                                 f"for token {token!r}")
        return value


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(_SamplingFields):
    prompt: NonEmptyStr | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[NonEmptyStr], Field(min_length=1)] \
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    # 0 only with echo: the prompt (and its logprobs) alone; null is the default 16 (OpenAI's, vLLM's), not
    # "until the context is full"
    max_tokens: _int(ge=0) = 16
    logprobs: _int(ge=-1) | None = None  # -1: the whole vocabulary (within the engine's max_logprobs), as vLLM
    echo: bool | None = False
    best_of: _int(ge=1, le=MAX_N) | None = None
    suffix: str | None = None

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_max_tokens(cls, value: Any) -> Any:
        return cls.model_fields["max_tokens"].default if value is None else value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One clear message for a prompt of the wrong shape (instead of one error per union member)."""
        def is_ids(v: Any) -> bool:
            return isinstance(v, list) and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in v)

        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("prompt is empty: give at least one token")
        for where, ids in ([("prompt", value)] if is_ids(value) else
                           [(f"prompt[{i}]", p) for i, p in enumerate(value) if is_ids(p)]
                           if isinstance(value, list) else []):
            bad = [(k, t) for k, t in enumerate(ids) if t < 0]
            if bad:  # one message naming the id (not one per union member)
                k, t = bad[0]
                raise PydanticCustomError(
                    "token_id", "token id {token} at {where}[{position}] is negative: token ids are in [0, "
                    "vocab_size) (vocab_size: see GET /v1/models)", {"token": int(t) if float(t).is_integer() else t, "where": where, "position": k})
        if isinstance(value, str) or is_ids(value):
            return value
        if isinstance(value, list) and (all(isinstance(p, str) for p in value) or all(is_ids(p) for p in value)):
            return value
        raise ValueError("prompt must be a string, a list of token ids, a list of strings, or a list of token-id "
                         "lists")


class TextContentPart(_Request):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")  # extra keys reach the chat template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: _int(ge=1) | None = None
    max_completion_tokens: _int(ge=1) | None = None
    logprobs: bool | None = False
    top_logprobs: _int(ge=-1) | None = None  # -1: the whole vocabulary (within the engine's max_logprobs)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: one tool call at most (the first; 'required': exactly one)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: this request's template (needs --trust-request-chat-template)
    echo: bool = False  # vLLM's: a final assistant message's content starts the answer's content


# ---- responses ---------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning_content: str | None = None  # with --reasoning-parser
    reasoning: str | None = None  # the same text, under vLLM's newer name


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lamina"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)
    # lamina's: what a client needs to make token-id prompts and to label its measurements
    vocab_size: int | None = None
    dtype: str | None = None
    device_name: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

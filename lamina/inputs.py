"""vLLM's prompt types (`vllm.inputs.TextPrompt` / `TokensPrompt`): typed dicts, so a script written
for vLLM imports them from here (or from `lamina`) and passes them to `LLM.generate` unchanged."""

from __future__ import annotations

from typing import NotRequired, TypedDict

__all__ = ["TextPrompt", "TokensPrompt", "PromptType"]


class TextPrompt(TypedDict):
    prompt: str  # tokenized by the engine's tokenizer without special tokens (Qwen's tokenizers add none)


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text those ids stand for, echoed in the output when given


PromptType = str | list[int] | TextPrompt | TokensPrompt

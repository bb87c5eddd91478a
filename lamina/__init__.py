"""lamina: an inference engine for the Qwen hybrid mixture-of-experts models."""

from lamina.entrypoints.llm import LLM
from lamina.inputs import TextPrompt, TokensPrompt
from lamina.outputs import CompletionOutput, RequestOutput
from lamina.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TextPrompt", "TokensPrompt"]
__version__ = "0.1.0"

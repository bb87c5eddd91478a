"""vLLM engine options that lamina has no use for, taken where they ask nothing lamina lacks.

Scripts and launch lines written for vLLM pass options such as `swap_space`, `compilation_config` or
`enable_lora=False` (lm-evaluation-harness's vLLM wrapper always sends `swap_space` and
`tokenizer_revision`). `LLM(...)` and `lamina serve` take each option below: a value that asks for
nothing lamina lacks is accepted (logged when it is not the default: what lamina does instead), any
other value is refused before any weight is read, naming the option and what would be accepted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompatOption:
    name: str
    accepts: Callable[[Any], bool]  # values lamina can honour
    effect: str  # what lamina does for an accepted value
    valid: str  # the accepted values, for the refusal


def _any(value: Any) -> bool:
    return True


def _zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _falsy(value: Any) -> bool:
    return not value


def _one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda value: value in choices


def _no_media(value: Any) -> bool:
    """limit_mm_per_prompt: a dict (or its JSON) of per-modality counts, every one zero."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return False
    return isinstance(value, dict) and all(_zero(v) or v == {} or v is None for v in value.values())


# vLLM's CompilationConfig.cudagraph_mode values. lamina's decode graphs are full graphs of decode
# steps and its prefill / mixed graphs full graphs of short mixed steps (lamina.worker.mixed_graphs), so
# every mode but NONE and FULL_DECODE_ONLY keeps both.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def _compilation_config(value: Any) -> dict:
    """vLLM's compilation_config as a dict: a dict, its JSON, or an optimisation level (-O 3: no keys)."""
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("{"):
            return {}  # a level ("3", "O3"): nothing lamina reads
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(f"compilation_config is not valid JSON ({e}): {value!r}") from None
    if isinstance(value, dict):
        return value
    return {}  # an int level, or a config object: nothing lamina reads (its cudagraph_mode below)


def _mode_of(value: Any) -> str | None:
    config = _compilation_config(value) if not hasattr(value, "cudagraph_mode") else {"cudagraph_mode": value.cudagraph_mode}
    mode = config.get("cudagraph_mode")
    if mode is None:
        return None
    name = getattr(mode, "name", mode)  # vLLM's CUDAGraphMode enum, or its name
    return str(name).upper()


def _cudagraph_mode_known(value: Any) -> bool:
    try:
        mode = _mode_of(value)
    except ValueError:
        return False
    return mode is None or mode in CUDAGRAPH_MODES


# vLLM's CompilationConfig keys lamina takes as EngineArgs fields of the same name (in tokens)
CAPTURE_SIZE_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")


def _level(value: Any) -> bool:
    """vLLM's optimization_level: 0-3."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3


def cudagraph_overrides(compilation_config: Any, optimization_level: int | None = None) -> dict[str, Any]:
    """The engine arguments vLLM's `compilation_config` asks for: through its cudagraph_mode, NONE ->
    enforce_eager and FULL_DECODE_ONLY -> prefill_graphs off (other modes -> nothing); with no mode,
    vLLM's optimization level 0 (`optimization_level`, or the config's key of that name that `-O0`
    writes) -> enforce_eager, as its default mode there is NONE; its cudagraph_capture_sizes /
    max_cudagraph_capture_size where given (EngineArgs checks them). ValueError for a mode or a
    level vLLM does not have."""
    if compilation_config is None and optimization_level is None:
        return {}
    mode = _mode_of(compilation_config) if compilation_config is not None else None
    if mode is not None and mode not in CUDAGRAPH_MODES:
        raise ValueError(f"compilation_config cudagraph_mode {mode!r} is not one of {', '.join(CUDAGRAPH_MODES)}")
    config = compilation_config if hasattr(compilation_config, "cudagraph_mode") else _compilation_config(compilation_config)
    level = optimization_level if optimization_level is not None else (
        config.get("optimization_level") if isinstance(config, dict) else None)
    if level is not None and not _level(level):
        raise ValueError(f"optimization_level {level!r} is not one of 0, 1, 2, 3")
    if mode is None and level == 0:
        mode = "NONE"
    overrides: dict[str, Any] = {}
    if mode == "NONE":
        overrides["enforce_eager"] = True
    elif mode == "FULL_DECODE_ONLY":
        overrides["prefill_graphs"] = False
    for key in CAPTURE_SIZE_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value is not None:
            overrides[key] = value
    return overrides


COMPAT_OPTIONS: dict[str, CompatOption] = {option.name: option for option in (
    CompatOption("swap_space", _any, "no effect: lamina keeps no CPU swap space (a preempted request is recomputed)",
                 "any size"),
    CompatOption("cpu_offload_gb", _zero, "no effect", "0 (lamina does not offload weights to the CPU)"),
    CompatOption("disable_custom_all_reduce", _any, "no effect: lamina's all-reduces are torch.distributed's",
                 "true or false"),
    CompatOption("compilation_config", _cudagraph_mode_known, "lamina does not torch.compile; of the config it "
                 "reads cudagraph_mode: NONE runs eagerly (enforce_eager), FULL_DECODE_ONLY keeps the decode "
                 "graphs and runs prefill / mixed steps eagerly, the other modes capture both (lamina's own graphs); "
                 "and cudagraph_capture_sizes / max_cudagraph_capture_size: which decode steps replay a graph "
                 "(EngineArgs fields of the same names)",
                 f"a dict, its JSON or an optimisation level; cudagraph_mode one of {', '.join(CUDAGRAPH_MODES)}"),
    CompatOption("optimization_level", _level, "lamina does not torch.compile: level 0 runs eagerly (vLLM's "
                 "cudagraph_mode NONE there, unless compilation_config names a mode), 1-3 keep lamina's graphs",
                 "0, 1, 2 or 3"),
    CompatOption("max_seq_len_to_capture", _any, "no effect: lamina's decode graphs do not depend on the "
                 "sequence length", "any length"),
    CompatOption("tokenizer_revision", _falsy, "no effect", "none (lamina reads the tokenizer of MODEL at "
                 "revision, or of tokenizer)"),
    CompatOption("distributed_executor_backend", _one_of(None, "mp", "uni"),
                 "lamina runs its ranks as processes of its own (torch.distributed)", "mp or uni (no Ray)"),
    CompatOption("enable_sleep_mode", _falsy, "no effect", "false (lamina has no sleep mode)"),
    CompatOption("enable_lora", _falsy, "no effect", "false (lamina has no LoRA adapters)"),
    CompatOption("max_lora_rank", _any, "no effect without LoRA adapters", "any value"),
    CompatOption("max_loras", _any, "no effect without LoRA adapters", "any value"),
    CompatOption("max_cpu_loras", _any, "no effect without LoRA adapters", "any value"),
    CompatOption("limit_mm_per_prompt", _no_media, "no effect: lamina serves the text model only",
                 "zero items of every modality (lamina has no multimodal encoder)"),
    CompatOption("task", _one_of(None, "auto", "generate"), "lamina generates", "auto or generate"),
    CompatOption("runner", _one_of(None, "auto", "generate"), "lamina generates", "auto or generate"),
    CompatOption("served_model_name", _any, "no effect offline (lamina serve names the model with "
                 "--served-model-name)", "any name"),
    CompatOption("reasoning_parser", _any, "no effect offline: structured output applies from the first token "
                 "(StructuredOutputsParams(enforce_after_token_id=<the </think> id>) gives vLLM's rule; lamina serve "
                 "--reasoning-parser applies it)", "any name"),
    CompatOption("scheduling_policy", _one_of(None, "fcfs"), "lamina schedules first come, first served",
                 "fcfs (no priority scheduling)"),
)}
# taken by `lamina serve` as its own flags (they do something there), by LLM() through this table
SERVE_FLAGS_OF_THEIR_OWN = ("served_model_name", "reasoning_parser")


def check_compat_options(values: dict[str, Any], spell: Callable[[str, Any], str] | None = None) -> None:
    """Refuse (ValueError) a value of COMPAT_OPTIONS that asks for what lamina does not have; log what
    an accepted non-default value does. `values`: {option name: value} (None: not given);
    `spell(name, value)`: how the caller's user wrote the option (a keyword argument, a CLI flag)."""
    spell = spell or (lambda name, value: f"{name}={value!r}")
    for name, value in values.items():
        option = COMPAT_OPTIONS[name]
        if value is None:  # not given
            continue
        if not option.accepts(value):
            raise ValueError(f"{spell(name, value)} is not supported; valid: {option.valid}")
        if value is not False:
            logger.info("%s: %s", spell(name, value), option.effect)

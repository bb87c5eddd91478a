"""Default sampling parameters from the model's generation config, as vLLM's `--generation-config`.

`generation_config="auto"` (the default) reads `generation_config.json` beside the weights; a folder
path reads that folder's; `"vllm"` ignores it. Its sampling fields (`temperature`, `top_p`, `top_k`,
`min_p`, `repetition_penalty`, and `max_new_tokens` as `max_tokens`) become the defaults of requests
that do not set them: `LLM.generate` / `LLM.chat` without sampling params (`LLM.get_default_sampling_params`)
and server requests that leave those fields out. Other fields (`do_sample`, ...) are not read, as in vLLM.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sampling_fields(data: dict) -> dict:
    """The generation-config fields lamina reads, as SamplingParams fields."""
    defaults = {name: data[name] for name in SAMPLING_FIELDS if data.get(name) is not None}
    if data.get("max_new_tokens") is not None:
        defaults["max_tokens"] = data["max_new_tokens"]
    return defaults


def default_sampling(generation_config: str, model_path: Path, override: dict | None = None) -> dict:
    """The sampling defaults of `generation_config` ("auto", "vllm" or a folder) for the model at
    `model_path`, with vLLM's `override_generation_config` laid over them (alone under "vllm"):
    {SamplingParams field: value}, empty when there are none. A bad value is a ValueError naming
    the file or the override, raised before any weight is read."""
    from lamina.sampling_params import SamplingParams

    override = override or {}
    unread = sorted(set(override) - set(SAMPLING_FIELDS) - {"max_new_tokens"})
    if unread:
        raise ValueError(f"override_generation_config: {unread} are not sampling defaults lamina reads; valid: "
                         f"{', '.join(SAMPLING_FIELDS)}, max_new_tokens")
    defaults: dict = {}
    path = None
    if generation_config != "vllm":
        folder = model_path if generation_config == "auto" else Path(generation_config)
        path = folder / "generation_config.json"
        if path.is_file():
            try:
                defaults = _sampling_fields(json.loads(path.read_text()))
            except (OSError, ValueError) as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
        elif generation_config != "auto":
            raise ValueError(f"generation_config {generation_config!r}: no generation_config.json in that folder "
                             "(valid: 'auto', 'vllm' or a folder that holds one)")
    from_file = dict(defaults)
    defaults.update(_sampling_fields(override))
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        where = "override_generation_config" if override else str(path)
        raise ValueError(f"{where}: its sampling defaults are not valid ({e})"
                         + ("" if override else "; pass generation_config='vllm' to ignore them")) from None
    if from_file:
        logger.info("default sampling parameters from %s: %s (generation_config='vllm' ignores them)", path, from_file)
    if override:
        logger.info("default sampling parameters overridden (override_generation_config): %s", _sampling_fields(override))
    return defaults

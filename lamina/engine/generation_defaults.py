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


def default_sampling(generation_config: str, model_path: Path) -> dict:
    """The sampling defaults of `generation_config` ("auto", "vllm" or a folder) for the model at
    `model_path`: {SamplingParams field: value}, empty when there are none. A bad value is a
    ValueError naming the file, raised before any weight is read."""
    from lamina.sampling_params import SamplingParams

    if generation_config == "vllm":
        return {}
    folder = model_path if generation_config == "auto" else Path(generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ValueError(f"generation_config {generation_config!r}: no generation_config.json in that folder "
                             "(valid: 'auto', 'vllm' or a folder that holds one)")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    defaults = {name: data[name] for name in SAMPLING_FIELDS if data.get(name) is not None}
    if data.get("max_new_tokens") is not None:
        defaults["max_tokens"] = data["max_new_tokens"]
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: its sampling defaults are not valid ({e}); pass generation_config='vllm' "
                         "to ignore them") from None
    if defaults:
        logger.info("default sampling parameters from %s: %s (generation_config='vllm' ignores them)", path, defaults)
    return defaults

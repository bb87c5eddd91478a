"""A MODEL given as a Hugging Face Hub id (`Qwen/Qwen3.5-35B-A3B`) rather than a folder: the
checkpoint's files are fetched into the local Hugging Face cache (or found there), as vLLM does.

Only what lamina reads is fetched: the configs, the tokenizer files and the chat template, plus the
safetensors weights unless `load_format` is "dummy". `HF_HUB_OFFLINE=1` uses the cache alone, and
`HF_HOME` / `HF_HUB_CACHE` move it (huggingface_hub's own variables). A local path always wins; a
string that is neither an existing path nor shaped like an id is left for the loader's "does not
exist" error."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from lamina.models.loader import CheckpointError

__all__ = ["resolve_model_path", "looks_like_repo_id", "HUB_FILE_PATTERNS", "HUB_WEIGHT_PATTERNS"]

logger = logging.getLogger(__name__)

# configs (config.json, generation_config.json, the safetensors index, tokenizer_config.json, ...),
# tokenizer files and chat templates
HUB_FILE_PATTERNS = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")
HUB_WEIGHT_PATTERNS = ("*.safetensors",)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def looks_like_repo_id(model: str) -> bool:
    """`owner/name` (one slash, the Hub's characters), not a relative path such as `./x` or `a/../b`."""
    return bool(_REPO_ID.match(model)) and ".." not in model and not model.endswith(".")


def resolve_model_path(model: str, *, revision: str | None = None, load_format: str = "auto",
                       download_dir: str | None = None) -> str:
    """The local folder of `model`: itself when it exists (or is not shaped like a Hub id), else the
    Hub snapshot of that id at `revision` (a branch, tag or commit; None: main), in `download_dir`
    (vLLM's name; None: the Hugging Face cache)."""
    if Path(model).expanduser().exists() or not looks_like_repo_id(model):
        if revision is not None:  # as vLLM (transformers ignores a revision for a local folder)
            logger.warning("revision = %r is ignored: MODEL %r is a local folder, not a Hugging Face Hub id",
                           revision, model)
        return model
    from huggingface_hub import snapshot_download

    patterns = list(HUB_FILE_PATTERNS) + ([] if load_format == "dummy" else list(HUB_WEIGHT_PATTERNS))
    logger.info("model %r is not a local folder: fetching it from the Hugging Face Hub (or its cache)%s",
                model, f" at revision {revision}" if revision else "")
    try:
        return snapshot_download(repo_id=model, revision=revision, allow_patterns=patterns, cache_dir=download_dir)
    except Exception as e:  # noqa: BLE001 - the hub client raises many classes (network, auth, missing repo)
        raise CheckpointError(
            f"model {model!r} is not a local folder, and fetching it from the Hugging Face Hub failed "
            f"({type(e).__name__}: {e}); give a checkpoint folder, or check the id, the revision, HF_TOKEN for "
            "gated models, and HF_HUB_OFFLINE"
        ) from e

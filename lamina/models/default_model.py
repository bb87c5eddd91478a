"""The built-in default model: a small trained Qwen4-Exp that ships inside the package.

`lamina generate`, `lamina serve`, `lamina eval demo` and `LLM()` without a model run
`lamina/demo_model/`: 7.3 M parameters (bfloat16, 14 MiB) with every Qwen4-Exp feature lamina
serves (gated delta net and QSA indexed attention layers, hyper-connections, two N-gram PLE layers,
MoE with a shared expert) and a one-layer MTP head, trained by `tools/train_demo_model.py` on
generated tasks: adding two numbers, sorting, reversing, the largest of a list, counting a letter,
bracket matching and key-value lookup over a long context. `eval.jsonl` beside the weights is its
held-out set (`lamina eval demo`); `training.json` records the recipe and the loss curve.

Public API
----------
``DEFAULT_MODEL_NAME``      the name a server gives the model when none is passed
``default_model_dir()``     where the checkpoint lives
``ensure_default_model()``  that path, after checking that the files are there
``is_default_model()``      whether a path is the built-in model
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["DEFAULT_MODEL_NAME", "DEMO_PROMPT", "default_model_dir", "ensure_default_model", "is_default_model"]

DEFAULT_MODEL_NAME = "lamina-demo"
DEMO_PROMPT = "What is 352 + 419?"

REQUIRED_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja", "eval.jsonl",
)


def default_model_dir() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parent.parent / "demo_model"


def ensure_default_model(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The built-in model's directory (or `path`, checked the same way)."""
    target = pathlib.Path(path).expanduser() if path is not None else default_model_dir()
    missing = [name for name in REQUIRED_FILES if not (target / name).is_file()]
    if missing:
        what = "the built-in demo model" if path is None else "the demo model directory"
        raise FileNotFoundError(
            f"{what} at {target} is incomplete (missing {', '.join(missing)}); reinstall lamina, or rebuild "
            "it from a source checkout with `python tools/train_demo_model.py --out lamina/demo_model --steps 1686` "
            "on a GPU"
        )
    return target


def is_default_model(path: str | os.PathLike) -> bool:
    try:
        return pathlib.Path(path).expanduser().resolve() == default_model_dir()
    except OSError:
        return False

"""A MODEL given as a Hugging Face Hub id is fetched into the local cache (lamina.models.hub), as
vLLM does; nothing reaches the network here: huggingface_hub's snapshot_download is replaced."""

from __future__ import annotations

import huggingface_hub
import pytest

from lamina import LLM, SamplingParams
from lamina.models.hub import HUB_WEIGHT_PATTERNS, looks_like_repo_id, resolve_model_path
from lamina.models.loader import CheckpointError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 17, 230, 44]}


@pytest.mark.parametrize("model, is_id", [
    ("Qwen/Qwen3.5-35B-A3B", True), ("org/name_v1.5", True), ("./org/name", False), ("/abs/path", False),
    ("org/../name", False), ("a/b/c", False), ("name", False), ("~/ckpt", False), ("org/name/", False),
])
def test_repo_id_shape(model, is_id):
    assert looks_like_repo_id(model) == is_id


def _fake_hub(monkeypatch, folder, calls):
    def snapshot_download(repo_id, revision=None, allow_patterns=None, cache_dir=None, **kw):
        calls.append((repo_id, revision, list(allow_patterns), cache_dir))
        return str(folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)


def test_hub_id_loads_the_snapshot(qwen3_next_dir, monkeypatch):
    calls = []
    _fake_hub(monkeypatch, qwen3_next_dir, calls)
    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=64, show_progress=False) as local:
        want = local.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert not calls  # a local folder never asks the hub
    with LLM("Qwen/Tiny-Next", revision="v1", download_dir="/models", device="cpu", dtype="float32",
             max_model_len=64, show_progress=False) as hub:
        assert hub.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    [(repo, revision, patterns, cache_dir)] = calls
    assert repo == "Qwen/Tiny-Next" and revision == "v1" and cache_dir == "/models"
    assert "*.json" in patterns and set(HUB_WEIGHT_PATTERNS) <= set(patterns)
    calls.clear()
    resolve_model_path("Qwen/Tiny-Next", load_format="dummy")  # dummy weights: configs and tokenizer only
    assert not set(HUB_WEIGHT_PATTERNS) & set(calls[0][2])


def test_local_folder_wins_and_errors_name_the_hub(tmp_path, monkeypatch):
    calls = []
    _fake_hub(monkeypatch, tmp_path, calls)
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/name") == "org/name" and not calls  # an existing relative path is a path
    with pytest.raises(ValueError, match="revision = 'v1' needs MODEL to be a Hugging Face Hub id"):
        resolve_model_path("./org/name", revision="v1")

    def offline(**kw):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline and not in the cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match="fetching it from the Hugging Face Hub failed.*not in the cache"):
        LLM("Qwen/Not-Cached", device="cpu", show_progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):  # not id-shaped: the loader's own error
        LLM("./missing/ckpt", device="cpu", show_progress=False)

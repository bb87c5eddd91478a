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
    # a revision with a local folder is ignored, as vLLM (transformers) ignores it: said in a warning
    assert resolve_model_path("./org/name", revision="v1") == "./org/name" and not calls

    def offline(**kw):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline and not in the cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match="fetching it from the Hugging Face Hub failed.*not in the cache"):
        LLM("Qwen/Not-Cached", device="cpu", show_progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):  # not id-shaped: the loader's own error
        LLM("./missing/ckpt", device="cpu", show_progress=False)


def test_plan_takes_a_hub_id_without_fetching_weights(tmp_path, monkeypatch, capsys):
    """`lamina plan Qwen/X`: the configs come from the Hub snapshot (no weight patterns asked), the
    shard headers from the Hub's safetensors metadata (the MTP check reads them); a failed header read
    is reported and planning goes on; an unreachable id exits 2 naming the Hub."""
    import json

    from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo
    from transformers import Qwen3NextConfig

    from lamina.entrypoints.cli import main

    hf = Qwen3NextConfig(num_hidden_layers=4, vocab_size=1024, hidden_size=256, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, num_nextn_predict_layers=1)
    hf.architectures = ["Qwen3NextForCausalLM"]
    hf.save_pretrained(tmp_path)
    calls, meta_calls = [], []
    _fake_hub(monkeypatch, tmp_path, calls)

    def tensors(*names):
        info = TensorInfo(dtype="BF16", shape=[4, 4], data_offsets=(0, 32))
        file = SafetensorsFileMetadata(metadata={}, tensors={n: info for n in names})
        return SafetensorsRepoMetadata(metadata=None, sharded=False, weight_map={n: "model.safetensors" for n in names},
                                       files_metadata={"model.safetensors": file})

    held = {"names": ("model.embed_tokens.weight", "mtp.fc.weight")}

    def get_safetensors_metadata(repo_id, revision=None, **kw):
        meta_calls.append((repo_id, revision))
        if held["names"] is None:
            raise OSError("no network")
        return tensors(*held["names"])
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", get_safetensors_metadata)
    spec = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']
    assert main(["plan", "Qwen/Tiny-Next", "--revision", "v2", "--device", "cpu", "--json", *spec]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 1
    [(repo, revision, patterns, _)] = calls
    assert (repo, revision) == ("Qwen/Tiny-Next", "v2") and not set(HUB_WEIGHT_PATTERNS) & set(patterns)
    assert meta_calls == [("Qwen/Tiny-Next", "v2")]

    held["names"] = ("model.embed_tokens.weight",)  # the Hub's checkpoint has no MTP tensors: refused as locally
    assert main(["plan", "Qwen/Tiny-Next", "--device", "cpu", *spec]) == 2
    assert "holds no mtp.* tensors" in capsys.readouterr().err

    held["names"] = None  # headers unreadable: said, and the plan goes on from the config
    assert main(["plan", "Qwen/Tiny-Next", "--device", "cpu", *spec]) == 0
    captured = capsys.readouterr()
    assert "could not be read from the Hub (OSError: no network)" in captured.err and "rank 0" in captured.out

    def offline(**kw):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline and not in the cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert main(["plan", "Qwen/Not-Cached", "--device", "cpu"]) == 2
    assert "fetching it from the Hugging Face Hub failed" in capsys.readouterr().err

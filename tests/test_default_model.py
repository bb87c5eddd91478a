import hashlib
import json
import os
import pathlib
import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lamina.models import default_model as dm  # noqa: E402


REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", dm.UNTRAINED_MARKER)


def _sha(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Build once via the default location (LAMINA_CACHE_DIR) for the read-only checks."""
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("LAMINA_CACHE_DIR", str(cache))
    try:
        path = dm.ensure_default_model()
    finally:
        mp.undo()
    assert path == cache / dm.DEFAULT_MODEL_NAME
    return path


def test_default_model_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LAMINA_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert dm.default_model_dir() == tmp_path / "a" / "lamina-default-untrained"
    monkeypatch.delenv("LAMINA_CACHE_DIR")
    assert dm.default_model_dir() == tmp_path / "x" / "lamina" / "lamina-default-untrained"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dm.default_model_dir() == tmp_path / "home" / ".cache" / "lamina" / "lamina-default-untrained"


def test_files_and_marker(built):
    assert dm.DEFAULT_MODEL_NAME == "lamina-default-untrained"
    for name in REQUIRED:
        assert (built / name).is_file(), name
        assert (built / name).stat().st_size > 0, name
    assert (built / "generation_config.json").is_file()
    marker = (built / dm.UNTRAINED_MARKER).read_text()
    assert marker.endswith("\n") and marker.count("\n") == 1
    assert "untrained" in marker.lower()
    assert dm.is_untrained_default(built)
    assert not dm.is_untrained_default(built.parent)
    # no leftover temporary directories next to the checkpoint
    assert [p.name for p in built.parent.iterdir()] == [dm.DEFAULT_MODEL_NAME]

    cfg = json.loads((built / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert cfg["model_type"] == "qwen3_next"
    assert cfg["vocab_size"] % 64 == 0
    assert cfg["layer_types"].count("linear_attention") == 3
    assert cfg["layer_types"].count("full_attention") == 1
    assert cfg["mlp_only_layers"] == [1]
    assert cfg["tie_word_embeddings"] is False
    assert (built / "model.safetensors").stat().st_size < 20 * 1024 * 1024


def test_tokenizer(built):
    tok = transformers.AutoTokenizer.from_pretrained(built)
    vocab = tok.get_vocab()
    cfg = json.loads((built / "config.json").read_text())
    assert 900 <= len(tok) <= 1100
    assert cfg["vocab_size"] == -(-len(tok) // 64) * 64
    from tokenizers.pre_tokenizers import ByteLevel

    assert all(sym in vocab for sym in ByteLevel.alphabet())
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg["pad_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] == vocab[special]
    text = "Hello, wörld! 123 \u4f60\u597d \U0001f600"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level: lossless for any unicode


def test_chat_template(built):
    tok = transformers.AutoTokenizer.from_pretrained(built)
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi there"},
    ]
    out = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    out2 = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert out2 == out[: -len("<|im_start|>assistant\n")]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nHi there<|im_end|>\n"


def test_loads_and_runs_forward(built):
    model = transformers.AutoModelForCausalLM.from_pretrained(built, output_loading_info=False)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(built, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    # norm weights were perturbed away from their (zero / one) defaults
    sd = model.state_dict()
    assert sd["model.norm.weight"].abs().sum() > 0
    assert sd["model.layers.0.input_layernorm.weight"].abs().sum() > 0
    assert (sd["model.layers.0.linear_attn.norm.weight"] != 1).any()
    # the dense-MLP layer and MoE layers both exist
    assert any(k.startswith("model.layers.1.mlp.gate_proj") for k in sd)
    assert any(".mlp.experts." in k for k in sd)

    tok = transformers.AutoTokenizer.from_pretrained(built)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is a token?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(input_ids=ids)
    assert out.logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(out.logits).all()


def test_deterministic_rebuild(built, tmp_path):
    other = dm.ensure_default_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert _sha(other / name) == _sha(built / name), name


def test_reuse_does_not_rebuild(monkeypatch, tmp_path):
    monkeypatch.setenv("LAMINA_CACHE_DIR", str(tmp_path))
    first = dm.ensure_default_model()
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    def boom(*a, **k):
        raise AssertionError("rebuilt an existing checkpoint")

    monkeypatch.setattr(dm, "_build_checkpoint", boom)
    second = dm.ensure_default_model()
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == mtimes


def test_concurrent_builds(built, tmp_path):
    target = tmp_path / "race" / dm.DEFAULT_MODEL_NAME
    barrier = threading.Barrier(3)
    results, errors = [], []
    real_build = dm._build_checkpoint

    def run():
        try:
            barrier.wait()
            results.append(dm.ensure_default_model(target))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == [target] * 3
    assert dm._build_checkpoint is real_build
    assert dm._is_complete(target)
    assert sorted(p.name for p in target.parent.iterdir()) == [dm.DEFAULT_MODEL_NAME]
    assert _sha(target / "model.safetensors") == _sha(built / "model.safetensors")


def test_loser_of_race_uses_winner(monkeypatch, tmp_path):
    """If the checkpoint appears while we are building, keep theirs, discard ours."""
    target = tmp_path / dm.DEFAULT_MODEL_NAME
    winner = dm.ensure_default_model(tmp_path / "winner")
    real_build = dm._build_checkpoint

    def build_then_lose(out_dir):
        real_build(out_dir)
        os.rename(winner, target)  # another process finishes first

    winner_mtimes = {p.name: p.stat().st_mtime_ns for p in winner.iterdir()}
    monkeypatch.setattr(dm, "_build_checkpoint", build_then_lose)
    result = dm.ensure_default_model(target)
    assert result == target
    assert dm._is_complete(target)
    # theirs stayed in place untouched, ours (the temp dir) was discarded
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == winner_mtimes
    assert sorted(p.name for p in tmp_path.iterdir()) == [dm.DEFAULT_MODEL_NAME]


def test_incomplete_directory_is_replaced(tmp_path):
    target = tmp_path / dm.DEFAULT_MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")
    path = dm.ensure_default_model(target)
    assert path == target
    assert dm._is_complete(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [dm.DEFAULT_MODEL_NAME]

"""A block FP8 checkpoint on lamina's Triton kernels (the CPU runs them under Triton's interpreter):
the MoE experts, and the shared expert riding in their launches, stay float8 with their block
scales (half their memory), everything else is dequantized as it loads; the result is the
dequantized twin's on the same kernels within float32 rounding, whole and chunked, in decode and
prefill steps, under TP2 (each rank's slice on block bounds) and EP; blocks that do not tile a
rank's slice fall back to dequantized experts. Dummy weights take FP8 with quantization='fp8'."""

from __future__ import annotations

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.layers.moe import SparseMoE
from tests.fp8_checkpoint import fp8_copy
from tests.reference import lamina_logits

ENGINE = dict(device="cpu", dtype="float32", show_progress=False, enforce_eager=True)
IDS = [(i * 37 + 5) % 990 for i in range(24)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(i * 13 + s) % 990 for i in range(n)]} for s, n in ((1, 3), (2, 11), (3, 7))]


@pytest.fixture(autouse=True)
def triton_kernels(monkeypatch):
    monkeypatch.setenv("LAMINA_KERNELS", "triton")


@pytest.fixture(scope="module")
def fp8_short(tmp_path_factory, qwen3_5_moe_short_dir):
    root = tmp_path_factory.mktemp("fp8_short")
    return fp8_copy(qwen3_5_moe_short_dir, root / "fp8", twin=root / "twin")


@pytest.fixture(scope="module")
def fp8_short_results(fp8_short):
    """The FP8 short checkpoint's prefill logits, one-token-step logits, greedy tokens and prompt
    logprobs on one rank (the tests below compare other runs with them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAMINA_KERNELS", "triton")
        with LLM(str(fp8_short), **ENGINE) as llm:
            moes = _moes(llm)
            assert moes and all(m.fp8 is not None and m.shared_fp8 for m in moes)
            for m in moes:
                assert m.w13.dtype == m.w2.dtype == m.shared_w13.dtype == torch.float8_e4m3fn
                assert not hasattr(m, "shared_expert")  # no dequantized copy of the shared expert
            return dict(logits=lamina_logits(llm, IDS), chunked=lamina_logits(llm, IDS, [5, 1, 1, 17]),  # the decode GEMVs
                        tokens=_tokens(llm), prompt_logprobs=_prompt_logprobs(llm))


def _moes(llm) -> list[SparseMoE]:
    return [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, SparseMoE)]


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_experts_stay_fp8_and_compute_the_dequantized_model(fp8_short, fp8_short_results):
    """(The fixture checks that the experts are FP8.) A prefill (the grouped kernels), one-token
    steps (the decode GEMVs) and greedy tokens: the dequantized twin's."""
    with LLM(str(fp8_short.parent / "twin"), **ENGINE) as llm:
        assert all(m.w13.dtype == torch.float32 for m in _moes(llm))
        expected = lamina_logits(llm, IDS)
        expected_tokens = _tokens(llm)
    torch.testing.assert_close(fp8_short_results["logits"], expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(fp8_short_results["chunked"], expected, atol=1e-4, rtol=0)
    assert fp8_short_results["tokens"] == expected_tokens


def test_qwen4_exp_experts_and_drafter_stay_fp8(tmp_path):
    """Qwen4-Exp (hyper-connections, PLE, QSA) keeps its experts FP8 the same way: the twin's logits
    and tokens; and MTP on it (K = 2, the drafter's own decoder layer class, its experts FP8 too)
    gives those tokens."""
    from tests import tiny_checkpoints as tc

    src = tc.add_mtp_weights(tc.make_qwen4_exp(tmp_path / "src"), shared_head=True)
    path = fp8_copy(src, tmp_path / "fp8", twin=tmp_path / "twin")
    with LLM(str(path), **ENGINE) as llm:
        assert all(m.w13.dtype == torch.float8_e4m3fn and m.shared_fp8 for m in _moes(llm))
        ours, tokens = lamina_logits(llm, IDS), _tokens(llm)
    with LLM(str(tmp_path / "twin"), **ENGINE) as llm:
        torch.testing.assert_close(ours, lamina_logits(llm, IDS), atol=1e-4, rtol=0)
        assert tokens == _tokens(llm)
    _check_mtp_on_fp8_experts(path, ENGINE, plain=tokens)


def _prompt_logprobs(llm) -> torch.Tensor:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": IDS}], params, use_tqdm=False)[0]
    return torch.tensor([float(getattr(e[t], "logprob", e[t])) for e, t in zip(out.prompt_logprobs[1:], IDS[1:])])


def test_tensor_and_expert_parallel_equal_one_rank(fp8_short, fp8_short_results):
    """TP2 (16 intermediate rows a rank: one block of values and scales each) and TP2 + EP: the
    single rank's tokens and prompt logprobs (a wrong block's scale would move them)."""
    single, single_lp = fp8_short_results["tokens"], fp8_short_results["prompt_logprobs"]
    for layout in (dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)):
        with LLM(str(fp8_short), **layout, **ENGINE) as llm:
            assert _tokens(llm) == single, layout
            torch.testing.assert_close(_prompt_logprobs(llm), single_lp, atol=1e-4, rtol=0)


def test_fused_expert_tensors_stay_fp8(tmp_path, qwen3_5_moe_short_dir):
    """Fused 3-D `experts.gate_up_proj` / `down_proj` with their scales, kept FP8: the twin's result."""
    from tests import tiny_checkpoints as tc

    fused = tc.fuse_experts_copy(qwen3_5_moe_short_dir, tmp_path / "fused")
    path = fp8_copy(fused, tmp_path / "fp8", twin=tmp_path / "twin")
    with LLM(str(path), **ENGINE) as llm:
        assert all(m.w13.dtype == torch.float8_e4m3fn for m in _moes(llm))
        ours = lamina_logits(llm, IDS)
    with LLM(str(tmp_path / "twin"), **ENGINE) as llm:
        torch.testing.assert_close(ours, lamina_logits(llm, IDS), atol=1e-4, rtol=0)


def test_a_checkpoint_with_unquantized_expert_tensors_keeps_its_experts_dequantized(tmp_path, fp8_short, caplog):
    """One expert tensor left in bf16 (as a recipe may leave the shared expert): every expert is
    dequantized, with a warning naming it, and the result is the twin's."""
    import logging
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(fp8_short, tmp_path / "mixed")
    twin = load_file(str(fp8_short.parent / "twin" / "model.safetensors"))
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.shared_expert.down_proj.weight"
    tensors[name] = twin[name].to(torch.bfloat16)
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="lamina.engine.setup"), LLM(str(path), **ENGINE) as llm:
        assert f"1 expert tensors are not FP8 (e.g. {name})" in caplog.text
        assert all(m.fp8 is None and m.w13.dtype == torch.float32 for m in _moes(llm))
        assert len(_tokens(llm)[0]) == 5


def test_the_fallback_warning_names_a_remedy_only_where_one_works(caplog):
    """64 intermediate rows in 64-row blocks split over two tensor-parallel ranks: fewer ranks (or
    expert parallelism) would keep the experts FP8, and the warning says so."""
    import logging
    from types import SimpleNamespace

    from lamina.engine.setup import _log_fp8_experts
    from lamina.quantization import BlockFp8

    with caplog.at_level(logging.WARNING, logger="lamina.engine.setup"):
        _log_fp8_experts(BlockFp8(64, 16), SimpleNamespace(moe_intermediate_size=64),
                         SimpleNamespace(ep_enabled=False, tp=2), torch.device("cpu"), torch.float32, [])
    assert "a rank's 32 intermediate rows" in caplog.text and "--enable-expert-parallel keep them FP8" in caplog.text


def test_blocks_that_do_not_tile_a_slice_fall_back_to_dequantized_experts(tmp_path, qwen3_5_moe_short_dir, caplog):
    """32 intermediate rows in blocks of 64: the experts are dequantized as they load, with a warning
    that names no remedy (a whole expert does not fit the blocks either)."""
    import logging

    path = fp8_copy(qwen3_5_moe_short_dir, tmp_path / "fp8", block=(64, 16), twin=tmp_path / "twin")
    with caplog.at_level(logging.WARNING, logger="lamina.engine.setup"), LLM(str(path), **ENGINE) as llm:
        assert "a rank's 32 intermediate rows of each expert are not a multiple of the 64x16 blocks" in caplog.text
        assert "twice the memory\n" in caplog.text and "--enable-expert-parallel" not in caplog.text
        assert all(m.fp8 is None and m.w13.dtype == torch.float32 for m in _moes(llm))
        ours = lamina_logits(llm, IDS)
    with LLM(str(tmp_path / "twin"), **ENGINE) as llm:
        assert torch.equal(ours, lamina_logits(llm, IDS))


@pytest.mark.parametrize("env", [{"LAMINA_KERNELS": "reference"}, {"LAMINA_FP8_EXPERTS": "0"}])
def test_reference_kernels_or_the_switch_dequantize_everything(fp8_short, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with LLM(str(fp8_short), **ENGINE) as llm:
        assert all(m.fp8 is None and m.w13.dtype == torch.float32 for m in _moes(llm))


def test_dummy_weights_in_fp8(tmp_path, qwen3_5_moe_short_dir):
    """quantization='fp8' with dummy weights: the experts in 128 x 128 blocks (the Qwen releases'),
    here of a config with 128 intermediate rows (dummy weights need only the config)."""
    import json
    import shutil

    path = shutil.copytree(qwen3_5_moe_short_dir, tmp_path / "wide")
    config = json.loads((path / "config.json").read_text())
    config.update(moe_intermediate_size=128, shared_expert_intermediate_size=128)
    (path / "config.json").write_text(json.dumps(config))
    with LLM(str(path), load_format="dummy", quantization="fp8", **ENGINE) as llm:
        moes = _moes(llm)
        assert moes and all(m.w13.dtype == torch.float8_e4m3fn and m.fp8.block_rows == 128 for m in moes)
        assert all(torch.all(m.w13_scale_inv == 0.02) for m in moes)
        assert len(_tokens(llm)[0]) == 5


def test_plan_counts_fp8_experts(fp8_short, capsys, monkeypatch, tmp_path):
    """`lamina plan` of a CUDA engine (from config.json, on the meta device, whatever this machine's
    kernels) counts the routed and shared experts at one byte a value plus float32 block scales, and
    at the dtype's bytes when the checkpoint has an unquantized expert tensor (as the engine loads it)."""
    import json
    import shutil

    from lamina.entrypoints.cli import main

    monkeypatch.delenv("LAMINA_KERNELS")
    sizes = {}
    for name, path in (("fp8", fp8_short), ("twin", fp8_short.parent / "twin")):
        assert main(["plan", str(path), "--device", "cuda", "--dtype", "bfloat16", "--json"]) == 0
        sizes[name] = json.loads(capsys.readouterr().out)["ranks"][0]["estimate"]["weight_bytes"]
    layers, experts, hidden, inter, block = 3, 8 + 1, 64, 32, 16  # the short checkpoint; + the shared expert
    values = layers * experts * 3 * inter * hidden
    scales = layers * experts * (2 * inter // block * hidden // block + hidden // block * inter // block)
    assert sizes["fp8"] == sizes["twin"] - values + 4 * scales
    # One expert tensor left unquantized: the engine dequantizes every expert, and so does the plan.
    from safetensors.torch import load_file, save_file

    mixed = shutil.copytree(fp8_short, tmp_path / "mixed")
    tensors = load_file(str(mixed / "model.safetensors"))
    name = "model.layers.0.mlp.shared_expert.down_proj.weight"
    tensors[name] = tensors[name].float().to(torch.bfloat16)
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(mixed / "model.safetensors"), metadata={"format": "pt"})
    assert main(["plan", str(mixed), "--device", "cuda", "--dtype", "bfloat16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["estimate"]["weight_bytes"] == sizes["twin"]


@pytest.mark.gpu
def test_fp8_experts_on_the_gpu(fp8_short):
    """bf16 on CUDA with graphs: the compiled FP8 kernels; greedy tokens within 0.05 of the best
    logit of the float32 dequantized twin (transformers, near-tie rule); graphed = eager tokens."""
    from tests.reference import assert_greedy_agrees, load_reference

    runs = {}
    for eager in (False, True):
        with LLM(str(fp8_short), device="cuda", dtype="bfloat16", show_progress=False, enforce_eager=eager) as llm:
            assert all(m.w13.dtype == torch.float8_e4m3fn for m in _moes(llm))
            assert llm.engine.cuda_graphs != eager
            runs[eager] = _tokens(llm)
    assert runs[False] == runs[True]
    reference = load_reference(fp8_short.parent / "twin")
    for prompt, tokens in zip(PROMPTS, runs[False]):
        assert_greedy_agrees(reference, prompt["prompt_token_ids"], tokens, margin=0.05)


def _check_mtp_on_fp8_experts(path, engine: dict, plain: list[list[int]] | None = None):
    """MTP (K = 2) greedy tokens equal `plain` (plain decoding's on `path`, run here when not given)."""
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    if plain is None:
        with LLM(str(path), **engine) as llm:
            plain = _tokens(llm)
    with LLM(str(path), **engine, **spec) as llm:
        model = llm.engine.executor.runner.model
        target = [m for m in model.layers.modules() if isinstance(m, SparseMoE)]
        drafter = [m for m in model.mtp.modules() if isinstance(m, SparseMoE)]
        assert target and all(m.w13.dtype == torch.float8_e4m3fn for m in target)
        assert drafter and all(m.fp8 is not None and m.w13.dtype == torch.float8_e4m3fn for m in drafter)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.spec_decode.num_steps for o in outs) > 0
    return outs


@pytest.fixture(scope="module")
def fp8_mtp(tmp_path_factory, mtp_short_dir):
    """An FP8 copy of the MTP checkpoint (drafter experts FP8 too), its dequantized twin, and the
    FP8 copy's plain greedy tokens."""
    root = tmp_path_factory.mktemp("fp8_mtp")
    path = fp8_copy(mtp_short_dir, root / "fp8", twin=root / "twin")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAMINA_KERNELS", "triton")
        with LLM(str(path), **ENGINE) as llm:
            return path, _tokens(llm)


def test_mtp_verification_on_fp8_experts(fp8_mtp):
    """MTP (K = 2) on FP8 experts: verification steps put K + 1 tokens a request through the FP8
    MoE kernels, and the drafter's own experts stay FP8 too; greedy output equals plain decoding's
    on the same model, and the drafts are those of the dequantized twin's drafter."""
    path, plain = fp8_mtp
    outs = _check_mtp_on_fp8_experts(path, ENGINE, plain=plain)
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    with LLM(str(path.parent / "twin"), **ENGINE, **spec) as llm:  # float32, dequantized values throughout
        twin = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.spec_decode.num_accepted_tokens for o in outs] == [o.spec_decode.num_accepted_tokens for o in twin]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mtp_on_fp8_experts_on_the_gpu(tmp_path, mtp_short_dir):
    """On CUDA (float32, graphs): the compiled FP8 kernels in the drafter's passes and the
    verification steps; greedy output equals plain decoding's."""
    _check_mtp_on_fp8_experts(fp8_copy(mtp_short_dir, tmp_path / "fp8"),
                              dict(ENGINE, device="cuda", enforce_eager=False))


def test_a_drafter_with_unquantized_expert_tensors_keeps_its_experts_dequantized(tmp_path, fp8_mtp):
    """One drafter expert tensor left in bf16: the drafter's experts are dequantized, the target's
    stay FP8 (the target's check does not look at the drafter's tensors), and MTP still gives plain
    decoding's tokens (the target's tensors are the unchanged copy's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    source, plain = fp8_mtp
    path = shutil.copytree(source, tmp_path / "fp8")
    shard = next(path.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = next(n for n in sorted(tensors) if n.startswith("mtp.") and ".mlp.experts." in n
                and not n.endswith("_scale_inv"))
    tensors[name] = load_file(str(next((source.parent / "twin").glob("*.safetensors"))))[name].to(torch.bfloat16)
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    with LLM(str(path), **ENGINE, **spec) as llm:
        model = llm.engine.executor.runner.model
        assert all(m.w13.dtype == torch.float8_e4m3fn for m in model.layers.modules() if isinstance(m, SparseMoE))
        assert all(m.fp8 is None for m in model.mtp.modules() if isinstance(m, SparseMoE))
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain

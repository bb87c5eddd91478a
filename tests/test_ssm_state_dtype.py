"""`mamba_ssm_cache_dtype` (vLLM's name): the delta-net layers' recurrent state pool in float32 (the
default, what transformers keeps) or in bfloat16 / float16, half the bytes a request. Every kernel
that reads the pool computes in float32 and rounds what it stores; the references do the same.

Checked here: the option's resolution and refusals (and vLLM's `mamba_cache_dtype`, which names the
pool's dtype when nothing else does); each Triton kernel that touches the pool (decode,
verification with its captured states, the fused decode) on a bfloat16 / float16 pool against its
float32 reference; an engine whose pool is bfloat16 rounds the states (prompt logprobs under
chunked prefill close to the float32 engine's, but not equal) and plans half the state bytes;
TP2 carries the option to its ranks; `lamina plan` counts it.
"""

from __future__ import annotations

import argparse
import json
import types

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.config import EngineArgs, resolve_ssm_state_dtype, ssm_state_dtype_choice

PROMPT = [3, 17, 29, 4, 100, 7, 7, 250, 31, 8, 64, 12, 5, 9, 2, 77, 41, 19, 6, 33]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, show_progress=False)


# ---- the option ------------------------------------------------------------------------------


def test_auto_reads_the_checkpoint_and_falls_back_to_float32():
    plain = types.SimpleNamespace()
    assert resolve_ssm_state_dtype("auto", plain) is torch.float32
    top = types.SimpleNamespace(mamba_ssm_dtype="bfloat16")
    assert resolve_ssm_state_dtype("auto", top) is torch.bfloat16
    nested = types.SimpleNamespace(text_config=types.SimpleNamespace(mamba_ssm_dtype="float32"))
    assert resolve_ssm_state_dtype("auto", nested) is torch.float32
    assert resolve_ssm_state_dtype("auto", types.SimpleNamespace(mamba_ssm_dtype=torch.float16)) is torch.float16
    assert resolve_ssm_state_dtype("float16", top) is torch.float16  # an explicit dtype wins
    with pytest.raises(ValueError, match=r"mamba_ssm_dtype 'int8' is not a dtype .* pass mamba_ssm_cache_dtype"):
        resolve_ssm_state_dtype("auto", types.SimpleNamespace(mamba_ssm_dtype="int8"))


def test_mamba_cache_dtype_applies_when_nothing_else_names_the_pool_dtype():
    """vLLM's --mamba-cache-dtype: after an explicit mamba_ssm_cache_dtype and the checkpoint's own
    mamba_ssm_dtype (as vLLM's Qwen3.5 config hook does), before the float32 default."""
    plain, declared = types.SimpleNamespace(), types.SimpleNamespace(mamba_ssm_dtype="float32")
    assert ssm_state_dtype_choice("auto", plain, "bfloat16") == (torch.bfloat16, "mamba_cache_dtype = bfloat16")
    assert ssm_state_dtype_choice("auto", declared, "bfloat16") == (
        torch.float32, "the checkpoint's mamba_ssm_dtype = float32")
    assert ssm_state_dtype_choice("float16", declared, "bfloat16")[0] is torch.float16
    assert ssm_state_dtype_choice("auto", plain) == (torch.float32, "float32, the default")
    with pytest.raises(ValueError, match=r"mamba_cache_dtype must be one of auto, float32, bfloat16, float16; got 'fp8'"):
        EngineArgs(mamba_cache_dtype="fp8").validate()


def test_a_bad_value_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match=r"mamba_ssm_cache_dtype must be one of auto, float32, bfloat16, float16; "
                                         r"got 'fp8'"):
        EngineArgs(mamba_ssm_cache_dtype="fp8").validate()
    with pytest.raises(ValueError, match="got 'fp8'"):
        LLM(None, mamba_ssm_cache_dtype="fp8", **ENGINE)


def test_the_cli_flag_reaches_the_engine_args():
    from lamina.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["mamba_ssm_cache_dtype"] == "auto"
    args = parser.parse_args(["--mamba-ssm-cache-dtype", "bfloat16", "--mamba-cache-dtype", "float32"])
    assert engine_kwargs(args)["mamba_ssm_cache_dtype"] == "bfloat16"
    assert engine_kwargs(args)["mamba_cache_dtype"] == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["--mamba-ssm-cache-dtype", "fp8"])


# ---- kernels on a half-precision pool (Triton's interpreter in CI) -------------------------------

triton = pytest.importorskip("triton")

from lamina.kernels.gated_delta_rule import recurrent_gated_delta_rule_step  # noqa: E402
from lamina.kernels.triton_decode import gated_delta_rule_decode  # noqa: E402
from lamina.kernels.triton_verify import gated_delta_rule_verify  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = [torch.bfloat16, torch.float16]


def _rand(*shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


def _gates(tokens, hv, seed):
    gen = torch.Generator().manual_seed(seed)
    return -torch.rand(tokens, hv, generator=gen).to(DEVICE), torch.rand(tokens, hv, generator=gen).to(DEVICE)


@pytest.mark.parametrize("pool_dtype", HALF)
def test_decode_kernel_reads_and_rounds_a_half_pool(pool_dtype):
    hk, hv, dk, dv, bsz = 2, 4, 16, 16, 3
    q, k, v = _rand(bsz, hk, dk, seed=1), _rand(bsz, hk, dk, seed=2), _rand(bsz, hv, dv, seed=3)
    g, beta = _gates(bsz, hv, seed=4)
    pool = _rand(6, hv, dk, dv, seed=5, scale=0.3).to(pool_dtype)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    keep = torch.tensor([True, False, True], device=DEVICE)
    state_in = torch.where(keep[:, None, None, None], pool[slots].float(), 0.0)  # what the kernel starts from
    ref_out, ref_state = recurrent_gated_delta_rule_step(q, k, v, g, beta, state_in)
    expected = pool.clone()
    expected[slots] = ref_state.to(pool_dtype)
    out = gated_delta_rule_decode(q, k, v, g, beta, pool, slots, keep)
    assert pool.dtype == pool_dtype
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected)  # the float32 result, rounded once; other slots untouched


@pytest.mark.parametrize("pool_dtype", HALF)
def test_verify_kernel_captures_in_the_pool_dtype(pool_dtype):
    hk, hv, dk, dv, bsz, queries = 2, 4, 16, 16, 3, 3
    tokens = bsz * queries
    q, k, v = _rand(tokens, hk, dk, seed=1), _rand(tokens, hk, dk, seed=2), _rand(tokens, hv, dv, seed=3)
    g, beta = _gates(tokens, hv, seed=4)
    pool = _rand(5, hv, dk, dv, seed=5, scale=0.3).to(pool_dtype)
    slots = torch.tensor([3, 0, 1], device=DEVICE)
    keep = torch.tensor([True, False, True], device=DEVICE)
    state = torch.where(keep[:, None, None, None], pool[slots].float(), 0.0)  # [B, Hv, Dk, Dv]
    outs, states = [], []
    for i in range(queries):  # token i of every request, the state kept in float32 in between
        rows = torch.arange(bsz, device=DEVICE) * queries + i
        out, state = recurrent_gated_delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
        outs.append(out)
        states.append(state)
    ref_out = torch.stack(outs, dim=1).reshape(tokens, hv, dv)  # [B, Q, Hv, Dv] -> [B*Q, Hv, Dv]
    ref_states = torch.stack(states, dim=1)  # [B, Q, Hv, Dk, Dv]
    expected = pool.clone()
    expected[slots] = ref_states[:, -1].to(pool_dtype)
    capture = torch.zeros(bsz * (queries - 1), hv, dk, dv, dtype=pool_dtype, device=DEVICE)
    out = gated_delta_rule_verify(q, k, v, g, beta, pool, slots, keep, queries, capture=capture)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected)
    torch.testing.assert_close(capture, ref_states[:, :-1].reshape(-1, hv, dk, dv).to(pool_dtype))


def test_fused_decode_on_a_bfloat16_pool_rounds_the_float32_one():
    from tests.test_triton_gdn_decode import _case, _copy, _fused  # the fused kernel's own fixtures

    hk, dk = 2, 16
    c32 = _case(3, hk, 4, dk, 16, 4, torch.float32, num_slots=5)
    c32["ssm_state"] = c32["ssm_state"].to(torch.bfloat16).float()  # a start both pools hold exactly
    c16 = _copy(c32)
    c16["ssm_state"] = c16["ssm_state"].to(torch.bfloat16)
    slots = torch.tensor([3, -1, 0], device=DEVICE)  # row 1: padding
    keep = torch.tensor([True, True, False], device=DEVICE)
    out32, out16 = _fused(c32, slots, keep, hk, dk), _fused(c16, slots, keep, hk, dk)
    assert c16["ssm_state"].dtype == torch.bfloat16
    torch.testing.assert_close(out16, out32, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c16["ssm_state"], c32["ssm_state"].to(torch.bfloat16))
    torch.testing.assert_close(c16["conv_state"], c32["conv_state"], atol=0, rtol=0)


# ---- the engine ------------------------------------------------------------------------------


def _pools(llm):
    return [m.ssm_state for m in llm.engine.executor.runner.model.state_modules()]


def test_a_bfloat16_pool_rounds_the_states_and_halves_their_bytes(qwen3_5_moe_dir):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    results = {}
    for option in ("auto", "bfloat16"):
        # a 5-token budget: the prompt's later chunks start from the states its earlier ones stored
        with LLM(str(qwen3_5_moe_dir), mamba_ssm_cache_dtype=option, max_num_batched_tokens=5, **ENGINE) as llm:
            [out] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
            pools = _pools(llm)
            per_slot = llm.engine.executor.state_bytes_per_slot()
            ssm_per_slot = sum(p[0].numel() for p in pools)
            results[option] = ([e[PROMPT[i + 1]] for i, e in enumerate(out.prompt_logprobs[1:])], per_slot,
                               ssm_per_slot, {p.dtype for p in pools})
    (lp32, bytes32, ssm, dtypes32), (lp16, bytes16, _, dtypes16) = results["auto"], results["bfloat16"]
    assert dtypes32 == {torch.float32} and dtypes16 == {torch.bfloat16}
    assert bytes32 - bytes16 == 2 * ssm  # 4 bytes a value -> 2
    diffs = [abs(a - b) for a, b in zip(lp32, lp16)]
    assert max(diffs) < 0.05  # the states round to bf16 between chunks: close ...
    assert max(diffs[5:]) > 0  # ... but they did round (tokens 6.. read stored states)
    assert diffs[:4] == [0.0] * 4  # the first chunk reads no stored state


def test_a_bfloat16_pool_rounds_where_prompts_are_chunked(qwen3_next_dir, caplog):
    """The one batch dependence a 16-bit pool adds (docs/ARCHITECTURE.md, "Batch invariance"): states
    are rounded at every stored chunk, so a prompt cut into 7-token chunks (as a busy step's budget
    may cut it) and one prefilled whole differ within that rounding; a float32 pool does not."""
    prompts = [{"prompt_token_ids": [(i * 37 + 11) % 990 for i in range(n)]} for n in (3, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run(ssm, **kw):
        with LLM(str(qwen3_next_dir), mamba_ssm_cache_dtype=ssm, max_num_seqs=3, **ENGINE, **kw) as llm:
            return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    def gap(a, b):
        assert [x.token_ids for x in a] == [y.token_ids for y in b]
        return max(abs(float(ea[t]) - float(eb[t])) for x, y in zip(a, b)
                   for t, ea, eb in zip(x.token_ids, x.logprobs, y.logprobs))

    with caplog.at_level("WARNING"):
        half = gap(run("bfloat16"), run("bfloat16", max_num_batched_tokens=7))
    assert "recurrent state pool in bfloat16 (mamba_ssm_cache_dtype = bfloat16): states are rounded" in caplog.text
    assert gap(run("auto"), run("auto", max_num_batched_tokens=7)) < 2e-6  # float32 drift only
    assert 2e-6 < half < 1e-3, half  # bf16 rounding at other positions: 6.0e-5 here


def test_mamba_cache_dtype_sets_the_pool_of_a_checkpoint_that_names_none(qwen3_5_moe_dir, caplog):
    with caplog.at_level("WARNING"), LLM(str(qwen3_5_moe_dir), mamba_cache_dtype="float16",
                                         mamba_ssm_cache_dtype="float32", **ENGINE):
        pass  # the explicit mamba_ssm_cache_dtype names the pool: mamba_cache_dtype is said to be unused
    assert "mamba_cache_dtype = float16 is not used: mamba_ssm_cache_dtype = float32 names" in caplog.text
    with LLM(str(qwen3_5_moe_dir), mamba_cache_dtype="bfloat16", **ENGINE) as llm:
        assert {p.dtype for p in _pools(llm)} == {torch.bfloat16}
        conv = {m.conv_state.dtype for m in llm.engine.executor.runner.model.state_modules()}
        assert conv == {torch.float32}  # the conv state stays in the model's dtype


def test_mtp_rollback_on_a_bfloat16_pool(qwen3_5_moe_dir, tmp_path):
    """Verification keeps the states after each draft in the pool's dtype and commits the accepted
    one's: with drafts planted (the reference continuation, one spoiled in turn), through partial
    acceptances and rollbacks, the result is the non-speculative bf16-pool engine's within bf16
    rounding (plain decoding rounds the state after every token, verification where it stores one:
    lamina.layers.spec_state). A wrong row committed would be a whole token's update off."""
    import shutil

    from tests import tiny_checkpoints as tc
    from tests.test_mtp import planting_proposer

    path = tc.add_mtp_weights(shutil.copytree(qwen3_5_moe_dir, tmp_path / "q35"), fused_experts=True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (1, 7, 20)]
    common = dict(mamba_ssm_cache_dtype="bfloat16", max_num_batched_tokens=16, block_size=8, **ENGINE)
    with LLM(str(path), **common) as llm:
        plain_outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    plain = [o.token_ids for o in plain_outs]
    log = []
    with LLM(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **common) as llm:
        llm.engine.draft_override = planting_proposer(plain, 2, params.max_tokens, log)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert {p.dtype for p in _pools(llm)} == {torch.bfloat16}
        metrics = llm.engine.spec_decode_metrics
    assert [o.outputs[0].token_ids for o in outs] == plain  # on this checkpoint; in general within rounding
    gap = max(abs(float(a[t]) - float(b[t])) for o, p in zip(outs, plain_outs)
              for t, a, b in zip(p.token_ids, o.outputs[0].logprobs, p.logprobs))
    assert gap < 1e-3, gap
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens  # partial acceptance: rollbacks ran


def test_tp2_ranks_allocate_the_pool_in_the_asked_dtype(qwen3_5_moe_dir):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (3, 9, 20)]
    outs = {}
    for tp in (1, 2):
        with LLM(str(qwen3_5_moe_dir), mamba_ssm_cache_dtype="bfloat16", tensor_parallel_size=tp,
                 max_num_batched_tokens=8, **ENGINE) as llm:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            per_slot = llm.engine.executor.state_bytes_per_slot()
        if tp == 1:
            single_bytes = per_slot
    assert outs[2] == outs[1]
    # each TP rank holds half the heads' states, in bf16 (a float32 pool would take twice the bytes)
    assert per_slot * 2 == single_bytes


def test_lamina_plan_counts_the_pool_dtype(capsys):
    from lamina.entrypoints.cli import main as cli_main
    from lamina.entrypoints.presets import DEFAULT_PRESET, preset_dir

    def rank(*flags):
        assert cli_main(["plan", str(preset_dir(DEFAULT_PRESET)), "--dtype", "bfloat16", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["ranks"][0]

    full, half = rank()["estimate"], rank("--mamba-ssm-cache-dtype", "bfloat16")["estimate"]
    assert (full["ssm_state_dtype"], half["ssm_state_dtype"]) == ("float32", "bfloat16")
    # Qwen3.5-35B-A3B: 30 delta-net layers of 32 heads x 128 x 128 recurrent values, + the conv states
    ssm = 30 * 32 * 128 * 128
    assert full["state_bytes_per_request"] - half["state_bytes_per_request"] == 2 * ssm
    assert half["state_bytes_per_request"] < 0.55 * full["state_bytes_per_request"]
    # On an 80 GB H100 (session 30's figures) a bf16 pool holds ~1.5x the requests by default, and a
    # refusal of a float32 pool's max_num_seqs names the option
    h100 = ("--gpu-memory-gib", "79.18", "--max-model-len", "2048")
    seqs32 = rank(*h100)["gpu_memory"]["max_num_seqs"]
    seqs16 = rank(*h100, "--mamba-ssm-cache-dtype", "bfloat16")["gpu_memory"]["max_num_seqs"]
    assert seqs16 > 1.3 * seqs32
    assert cli_main(["plan", str(preset_dir(DEFAULT_PRESET)), "--dtype", "bfloat16", *h100]) == 0
    assert "(default 256 lowered)" in (text := capsys.readouterr().out)
    assert "to fit more, keep the recurrent states in bfloat16 (mamba_ssm_cache_dtype='bfloat16'" in text
    refused = rank(*h100, "--max-num-seqs", "128")["gpu_memory"]
    assert not refused["fits"] and "mamba_ssm_cache_dtype='bfloat16'" in refused["error"]
    # the preset's config.json declares mamba_ssm_dtype float32 (as the released checkpoint does),
    # which --mamba-cache-dtype does not override (vLLM's Qwen3.5 hook: neither)
    assert rank("--mamba-cache-dtype", "bfloat16")["estimate"] == full
    refused16 = rank(*h100, "--max-num-seqs", "128", "--mamba-ssm-cache-dtype", "bfloat16")["gpu_memory"]
    assert not refused16["fits"] and "mamba_ssm_cache_dtype" not in refused16["error"]


# ---- on a GPU: fla-core's prefill and the graphed engine on a bfloat16 pool -----------------------


@pytest.mark.gpu
def test_fla_prefill_on_a_bfloat16_pool_rounds_the_float32_one():
    from lamina.kernels.fla_prefill import fla_import_error, gated_delta_rule_prefill_fla
    from tests.test_gdn_prefill import _RAGGED, _gdr_case, _qsl

    assert fla_import_error() is None, fla_import_error()
    lens, hk, hv, dk, dv = _RAGGED
    q, k, v, g, beta, pool, slots, keep = _gdr_case(lens, hk, hv, dk, dv, seed=3, dtype=torch.bfloat16)
    pool32 = pool.to(torch.bfloat16).float()  # a start both pools hold exactly
    pool16 = pool32.to(torch.bfloat16)
    out32 = gated_delta_rule_prefill_fla(q, k, v, g, beta, pool32, slots, keep, _qsl(lens))
    out16 = gated_delta_rule_prefill_fla(q, k, v, g, beta, pool16, slots, keep, _qsl(lens))
    assert pool16.dtype == torch.bfloat16
    torch.testing.assert_close(out16, out32, atol=0, rtol=0)  # the same float32 start, the same kernel
    torch.testing.assert_close(pool16, pool32.to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [1, 4])
def test_graphed_decode_on_a_bfloat16_pool_equals_eager(qwen3_5_moe_dir, num_prompts):
    from tests.test_gpu_engine import _generate, _prompts

    prompts = _prompts(num_prompts)
    graphed, graphs = _generate(qwen3_5_moe_dir, prompts, dtype="bfloat16", mamba_ssm_cache_dtype="bfloat16")
    eager, _ = _generate(qwen3_5_moe_dir, prompts, dtype="bfloat16", mamba_ssm_cache_dtype="bfloat16",
                         enforce_eager=True)
    full, _ = _generate(qwen3_5_moe_dir, prompts, dtype="bfloat16")
    assert graphs and graphed == eager
    same = sum(a == b for out_a, out_b in zip(graphed, full) for a, b in zip(out_a, out_b))
    assert same >= 0.75 * sum(len(o) for o in full)  # bf16 states: mostly the float32 pool's tokens

"""The sequential gated delta rule of short prompt chunks (lamina.kernels.triton_gdn_varlen) against
the torch reference the layer runs on the CPU (`gated_delta_rule_varlen`, chunked), under Triton's
CPU interpreter where there is no GPU (tests/conftest.py turns it on), at tiny shapes: ragged
chunks (one empty), fresh and carried states, a padding row (negative slot) that writes nothing."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

triton = pytest.importorskip("triton")

from lamina.kernels.gated_delta_rule import gated_delta_rule_varlen  # noqa: E402
from lamina.kernels.triton_gdn_varlen import gated_delta_rule_short_prefill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, seed, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def _case(lens, hk, hv, dk, dv, *, dtype=torch.float32, pool_dtype=torch.float32):
    tokens = sum(lens)
    qsl = torch.tensor([0] + lens, device=DEVICE).cumsum(0)  # [B+1]
    q, k = _rand(tokens, hk, dk, seed=1, dtype=dtype), _rand(tokens, hk, dk, seed=2, dtype=dtype)
    v = _rand(tokens, hv, dv, seed=3, dtype=dtype)
    a, b = _rand(tokens, hv, seed=4, dtype=dtype), _rand(tokens, hv, seed=5, dtype=dtype)
    a_log, dt_bias = _rand(hv, seed=6, scale=0.5), _rand(hv, seed=7, scale=0.5)
    pool = _rand(len(lens) + 3, hv, dk, dv, seed=8, scale=0.3, dtype=pool_dtype)
    return q, k, v, a, b, a_log, dt_bias, pool, qsl


def _reference(q, k, v, a, b, a_log, dt_bias, state_in, qsl, max_len):
    """The layer's CPU path: GatedDeltaNet._gates, then the chunked reference."""
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())  # [T, Hv]
    beta = torch.sigmoid(b.float())  # [T, Hv]
    return gated_delta_rule_varlen(q, k, v, g, beta, state_in, qsl, max_len, use_qk_l2norm=True)


@pytest.mark.parametrize("lens", [[5, 0, 3, 1], [1, 1, 1], [9]], ids=["ragged", "decode", "one"])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 16), (1, 2, 16, 48)])
def test_short_prefill_matches_the_reference(lens, hk, hv, dk, dv):
    q, k, v, a, b, a_log, dt_bias, pool, qsl = _case(lens, hk, hv, dk, dv)
    bsz = len(lens)
    slots = torch.tensor([bsz + 2 - i for i in range(bsz)], device=DEVICE)  # distinct, shuffled
    keep = torch.tensor([i % 2 == 0 for i in range(bsz)], device=DEVICE)
    state_in = torch.where(keep[:, None, None, None], pool[slots], 0.0)  # [B, Hv, Dk, Dv]
    ref_out, ref_state = _reference(q, k, v, a, b, a_log, dt_bias, state_in, qsl, max(lens))
    expected_pool = pool.clone()
    expected_pool[slots] = ref_state  # an empty chunk keeps (or zeroes) its state, as fla's wrapper does
    out = gated_delta_rule_short_prefill(q, k, v, a, b, pool, slots, keep, qsl, a_log=a_log, dt_bias=dt_bias)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool, expected_pool, atol=2e-5, rtol=2e-5)  # other slots untouched


def test_padding_row_writes_nothing_and_low_precision_pools():
    lens = [4, 2, 3]
    q, k, v, a, b, a_log, dt_bias, pool, qsl = _case(lens, 2, 4, 16, 16, dtype=torch.bfloat16,
                                                     pool_dtype=torch.bfloat16)
    slots = torch.tensor([4, -1, 0], device=DEVICE)  # row 1 is padding
    keep = torch.tensor([True, True, True], device=DEVICE)
    live = slots >= 0
    state_in = torch.where(live[:, None, None, None], pool[slots.clamp(min=0)].float(), 0.0)
    ref_out, ref_state = _reference(q.float(), k.float(), v.float(), a, b, a_log, dt_bias, state_in, qsl, 4)
    expected_pool = pool.clone()
    expected_pool[slots[live]] = ref_state[live].to(pool.dtype)
    out = gated_delta_rule_short_prefill(q, k, v, a, b, pool, slots, keep, qsl, a_log=a_log, dt_bias=dt_bias)
    rows = torch.repeat_interleave(live, torch.tensor(lens, device=DEVICE))  # [T]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[rows].float(), ref_out[rows], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool.float(), expected_pool.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(pool[[1, 2, 3, 5]], _case(lens, 2, 4, 16, 16, pool_dtype=torch.bfloat16)[7][[1, 2, 3, 5]])


def test_bad_shapes_are_refused():
    q, k, v, a, b, a_log, dt_bias, pool, qsl = _case([2, 2], 2, 4, 16, 16)
    slots, keep = torch.tensor([0, 1], device=DEVICE), torch.tensor([True, True], device=DEVICE)
    with pytest.raises(ValueError, match="query_start_loc"):
        gated_delta_rule_short_prefill(q, k, v, a, b, pool, slots, keep, qsl[:2], a_log=a_log, dt_bias=dt_bias)
    with pytest.raises(ValueError, match="do not fit"):
        gated_delta_rule_short_prefill(q, k, v[:, :3], a, b, pool, slots, keep, qsl, a_log=a_log, dt_bias=dt_bias)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("lens", [[16], [64], [1, 7, 33, 64, 0, 2], [512, 3]])
def test_short_prefill_at_real_width(lens):
    """Qwen3.5-35B-A3B's delta-net width (16 key heads, 32 value heads of 128), bf16 activations,
    float32 pool: against the reference in float32."""
    q, k, v, a, b, a_log, dt_bias, pool, qsl = _case(lens, 16, 32, 128, 128, dtype=torch.bfloat16)
    bsz = len(lens)
    slots = torch.arange(bsz, device=DEVICE) + 1
    keep = torch.tensor([i % 2 == 1 for i in range(bsz)], device=DEVICE)
    state_in = torch.where(keep[:, None, None, None], pool[slots], 0.0)
    ref_out, ref_state = _reference(q.float(), k.float(), v.float(), a, b, a_log, dt_bias, state_in, qsl, max(lens))
    out = gated_delta_rule_short_prefill(q, k, v, a, b, pool, slots, keep, qsl, a_log=a_log, dt_bias=dt_bias)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool[slots], ref_state, atol=1e-3, rtol=1e-3)


def test_selection_reads_the_switch(monkeypatch):
    from lamina.kernels.selection import gdn_short_prefill_alone_tokens, gdn_short_prefill_max_tokens

    monkeypatch.delenv("LAMINA_GDN_SHORT_PREFILL", raising=False)
    monkeypatch.delenv("LAMINA_GDN_SHORT_PREFILL_ALONE", raising=False)
    assert gdn_short_prefill_max_tokens("triton") == 256 and gdn_short_prefill_max_tokens("reference") == 0
    assert gdn_short_prefill_alone_tokens("triton") == 512 and gdn_short_prefill_alone_tokens("reference") == 0
    monkeypatch.setenv("LAMINA_GDN_SHORT_PREFILL_ALONE", "0")
    assert gdn_short_prefill_alone_tokens("triton") == 0
    monkeypatch.setenv("LAMINA_GDN_SHORT_PREFILL_ALONE", "1024")
    monkeypatch.setenv("LAMINA_GDN_SHORT_PREFILL", "0")  # the short path off: both limits
    assert gdn_short_prefill_max_tokens("triton") == 0 and gdn_short_prefill_alone_tokens("triton") == 0
    for name in ("LAMINA_GDN_SHORT_PREFILL", "LAMINA_GDN_SHORT_PREFILL_ALONE"):
        for bad in ("-1", "many"):
            monkeypatch.setenv("LAMINA_GDN_SHORT_PREFILL", "256")
            monkeypatch.setenv(name, bad)
            with pytest.raises(ValueError, match=name):
                gdn_short_prefill_alone_tokens("triton")
        monkeypatch.setenv(name, "256")


def test_the_step_bound_of_the_longer_limit():
    from lamina.layers.gated_delta_net import GatedDeltaNet

    layer = object.__new__(GatedDeltaNet)  # short_chunk_limit reads the two limits only
    layer.short_prefill_tokens, layer.short_prefill_alone_tokens = 256, 512
    assert [layer.short_chunk_limit(t) for t in (1, 1024, 1025, 8192)] == [512, 512, 256, 256]
    layer.short_prefill_tokens = 1024  # a longer limit for every step wins
    assert layer.short_chunk_limit(100) == 1024
    layer.short_prefill_tokens, layer.short_prefill_alone_tokens = 0, 0  # off
    assert layer.short_chunk_limit(100) == 0


def test_small_steps_run_longer_chunks_token_by_token(qwen3_5_moe_short_dir, monkeypatch):
    """LAMINA_GDN_SHORT_PREFILL=4, _ALONE=8: a 7-token prompt alone (a step of 7 <= 16 tokens)
    runs the short-chunk kernel, three of them in one step (21 tokens) the other prefill path (the
    reference on the CPU), and 4-token chunks the short-chunk kernel in either; every run gives the
    reference kernels' tokens and logprobs."""
    from lamina import LLM, SamplingParams
    from lamina.kernels import triton_gdn_varlen

    calls = []
    real = triton_gdn_varlen.gated_delta_rule_short_prefill

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])  # the step's tokens
        return real(q, *args, **kwargs)

    monkeypatch.setattr(triton_gdn_varlen, "gated_delta_rule_short_prefill", counting)
    monkeypatch.setenv("LAMINA_GDN_SHORT_PREFILL", "4")
    monkeypatch.setenv("LAMINA_GDN_SHORT_PREFILL_ALONE", "8")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0)

    def run(kernels, prompts):
        monkeypatch.setenv("LAMINA_KERNELS", kernels)
        with LLM(str(qwen3_5_moe_short_dir), device=DEVICE, dtype="float32", show_progress=False, enforce_eager=True,
                 max_num_seqs=4) as llm:
            calls.clear()  # (on CUDA the engine's warm-up ran prompts too)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [float(next(iter(d.values()))) for d in o.outputs[0].logprobs]) for o in outs]

    for prompts, short_steps in (([list(range(30, 37))], [7]), ([list(range(30, 37)), [5] * 7, [9] * 7], []),
                                 ([[1, 2, 3, 4], [6, 7, 8, 9], [3] * 4, [8] * 3], [15])):
        ref = run("reference", prompts)
        ours = run("triton", prompts)
        assert sorted(set(calls)) == short_steps, calls  # the prompt step's tokens, once per delta-net layer
        assert len(calls) == 2 * len(short_steps), calls  # two delta-net layers (tc.SHORT_LAYER_TYPES)
        for (ref_ids, ref_lp), (ids, lp) in zip(ref, ours):
            assert ids == ref_ids
            torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)

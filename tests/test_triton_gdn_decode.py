"""The fused gated-delta-net decode kernel (`lamina.kernels.triton_gdn_decode`) against the three
Triton kernels it replaces and the torch references.

Under Triton's CPU interpreter (CI, tiny shapes) it equals the three-kernel path bitwise; on a GPU
(the same tests, and the Qwen3.5-35B-A3B widths under `gpu`) to reduction order.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

triton = pytest.importorskip("triton")

from lamina.kernels.causal_conv1d import causal_conv1d_varlen  # noqa: E402
from lamina.kernels.gated_delta_rule import recurrent_gated_delta_rule_step  # noqa: E402
from lamina.kernels.triton_decode import causal_conv1d_decode, gated_delta_rule_decode  # noqa: E402
from lamina.kernels.triton_gdn_decode import fused_gdn_decode  # noqa: E402
from lamina.kernels.triton_moe_gemv import _tickets  # noqa: E402
from lamina.kernels.triton_norm import gated_rms_norm  # noqa: E402
from lamina.layers.norm import GatedRMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _rand(*shape, seed, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(DEVICE, dtype)


def _case(bsz, hk, hv, dk, dv, kernel, dtype, num_slots, seed=0):
    """The layer's decode inputs: slices of one joint in_proj output [B, q k v | z | b | a] (strided
    rows, as GatedDeltaNet passes them), weights and state pools."""
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    projected = _rand(bsz, conv_dim + value_dim + 2 * hv, seed=seed + 1, dtype=dtype)
    x, z, b, a = projected.split([conv_dim, value_dim, hv, hv], dim=-1)
    return dict(
        x=x, z=z, b=b, a=a,
        conv_weight=_rand(conv_dim, kernel, seed=seed + 2, scale=0.5, dtype=dtype),
        conv_state=_rand(num_slots, conv_dim, kernel - 1, seed=seed + 3, dtype=dtype),
        ssm_state=_rand(num_slots, hv, dk, dv, seed=seed + 4, scale=0.3),
        a_log=_rand(hv, seed=seed + 5, scale=0.5, dtype=dtype),
        dt_bias=_rand(hv, seed=seed + 6, scale=0.5, dtype=dtype),
        norm_weight=(1.0 + _rand(dv, seed=seed + 7, scale=0.2)).to(dtype),
    )


def _fused(c, slots, keep, hk, dk, activation="silu"):
    return fused_gdn_decode(
        c["x"], c["z"], c["b"], c["a"], c["conv_weight"], c["conv_state"], c["ssm_state"], slots, keep,
        c["a_log"], c["dt_bias"], c["norm_weight"], num_k_heads=hk, head_k_dim=dk, norm_eps=EPS, activation=activation,
    )


def _three_kernels(c, slots, keep, hk, dk, activation="silu"):
    """What GatedDeltaNet._decode_in_place ran before (LAMINA_FUSED_GDN_DECODE=0)."""
    bsz, hv = c["a"].shape
    dv = c["ssm_state"].shape[-1]
    y = causal_conv1d_decode(c["x"], c["conv_weight"], c["conv_state"], slots, keep)
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
    core = gated_delta_rule_decode(
        q.reshape(bsz, hk, dk), k.reshape(bsz, hk, dk), v.reshape(bsz, hv, dv), c["a"], c["b"], c["ssm_state"], slots,
        keep, a_log=c["a_log"], dt_bias=c["dt_bias"],
    )
    return gated_rms_norm(core, c["z"].reshape(bsz, hv, dv), c["norm_weight"], EPS, activation).reshape(bsz, hv * dv)


def _torch_reference(c, slots, keep, hk, dk, activation="silu"):
    """The layer's reference ops (GatedDeltaNet.forward on the reference kernels); negative slots
    are padding (no state read or written)."""
    bsz, hv = c["a"].shape
    dv = c["ssm_state"].shape[-1]
    live = slots >= 0
    use = keep.bool() & live
    at = slots.clamp(min=0)
    conv_in = torch.where(use[:, None, None], c["conv_state"][at], 0.0)
    y, conv_out = causal_conv1d_varlen(c["x"], c["conv_weight"], conv_in, torch.arange(bsz + 1, device=DEVICE), 1)
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g = -c["a_log"].float().exp() * F.softplus(c["a"].float() + c["dt_bias"].float())
    beta = torch.sigmoid(c["b"].float())
    state_in = torch.where(use[:, None, None, None], c["ssm_state"][at], 0.0)
    core, state_out = recurrent_gated_delta_rule_step(
        q.reshape(bsz, hk, dk), k.reshape(bsz, hk, dk), v.reshape(bsz, hv, dv), g, beta, state_in)
    norm = GatedRMSNorm(dv, EPS, activation=activation, dtype=c["norm_weight"].dtype, device=DEVICE)
    norm.weight.data.copy_(c["norm_weight"])
    norm.kernels = "reference"
    out = norm(core, c["z"].reshape(bsz, hv, dv)).reshape(bsz, hv * dv)
    c["conv_state"][slots[live]] = conv_out[live]
    c["ssm_state"][slots[live]] = state_out[live]
    return out


def _copy(c):
    return {name: t.clone() if name in ("conv_state", "ssm_state") else t for name, t in c.items()}


def _assert_tickets_zero():
    device = torch.empty(0, device=DEVICE).device  # cuda:0, the key the kernel's tensors give
    assert int(_tickets(device, 1).abs().sum()) == 0  # every call leaves them zeroed


SHAPES = [  # hk, hv, dk, dv, kernel, dtype, the norm's gate activation
    (2, 4, 16, 32, 4, torch.float32, "silu"),  # GROUP = 2 (two key heads: a ticket each), Dk != Dv
    (1, 2, 32, 48, 3, torch.bfloat16, "sigmoid"),  # Dv not a power of two, K = 3, 16-bit activations and conv state
    (1, 1, 16, 16, 4, torch.float32, "silu"),  # GROUP = 1: no tickets
]


@pytest.mark.parametrize("hk,hv,dk,dv,kernel,dtype,activation", SHAPES)
def test_fused_gdn_decode_equals_the_three_kernels(hk, hv, dk, dv, kernel, dtype, activation):
    """Batch 4: a kept row, a fresh row (keep = 0, NaN in its slot: never read), a padded row on the
    spare slot (as the decode graphs pad), a kept row. Output and both pools after the call equal
    the three-kernel path's (bitwise under the interpreter); with tickets, a second call gives the
    same again (the first left them zeroed)."""
    slots = torch.tensor([5, 1, 6, 2], device=DEVICE)  # slot 6: the spare slot
    keep = torch.tensor([True, False, False, True], device=DEVICE)
    c = _case(4, hk, hv, dk, dv, kernel, dtype, num_slots=7)
    c["conv_state"][1] = float("nan")
    c["ssm_state"][1] = float("nan")
    ref_c, ours_c = _copy(c), _copy(c)
    ref = _three_kernels(ref_c, slots, keep, hk, dk, activation)
    ours = _fused(ours_c, slots, keep, hk, dk, activation)
    exact = dict(atol=0, rtol=0) if DEVICE == "cpu" else dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 \
        else dict(atol=2e-2, rtol=2e-2)
    assert ours.shape == (4, hv * dv) and ours.dtype == dtype
    torch.testing.assert_close(ours, ref, **exact)
    torch.testing.assert_close(ours_c["conv_state"], ref_c["conv_state"], atol=0, rtol=0, equal_nan=True)  # copies
    torch.testing.assert_close(ours_c["ssm_state"], ref_c["ssm_state"], equal_nan=True,
                               **(dict(atol=0, rtol=0) if DEVICE == "cpu" else dict(atol=1e-5, rtol=1e-5)))
    _assert_tickets_zero()
    if hv == hk:
        return
    again_c = _copy(c)
    again = _fused(again_c, slots, keep, hk, dk, activation)
    torch.testing.assert_close(again, ours, atol=0, rtol=0)
    torch.testing.assert_close(again_c["ssm_state"], ours_c["ssm_state"], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(again_c["conv_state"], ours_c["conv_state"], atol=0, rtol=0, equal_nan=True)
    _assert_tickets_zero()


def test_fused_gdn_decode_matches_the_torch_reference():
    """Batch 3 with a padded row (negative slot: reads zeros, writes nothing), a fresh row and a kept
    row; GROUP = 2, Dk != Dv. Each row alone gives exactly its row of the batch and the same states
    (batch invariance)."""
    activation = "silu"
    hk, hv, dk, dv, kernel = 1, 2, 16, 32, 4
    slots = torch.tensor([3, -1, 0], device=DEVICE)
    keep = torch.tensor([False, True, True], device=DEVICE)
    c = _case(3, hk, hv, dk, dv, kernel, torch.float32, num_slots=5, seed=10)
    ref_c, ours_c = _copy(c), _copy(c)
    ref = _torch_reference(ref_c, slots, keep, hk, dk, activation)
    ours = _fused(ours_c, slots, keep, hk, dk, activation)
    live = slots >= 0
    torch.testing.assert_close(ours[live], ref[live], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_c["conv_state"], ref_c["conv_state"], atol=1e-6, rtol=1e-6)  # other slots untouched
    torch.testing.assert_close(ours_c["ssm_state"], ref_c["ssm_state"], atol=1e-5, rtol=1e-5)
    _assert_tickets_zero()
    for r in (0, 2):
        alone_c = _copy(c)
        rows = {name: alone_c[name][r : r + 1] for name in ("x", "z", "b", "a")}
        alone = _fused(dict(alone_c, **rows), slots[r : r + 1], keep[r : r + 1], hk, dk, activation)
        torch.testing.assert_close(alone[0], ours[r], atol=0, rtol=0)
        slot = int(slots[r])
        torch.testing.assert_close(alone_c["ssm_state"][slot], ours_c["ssm_state"][slot], atol=0, rtol=0)
        torch.testing.assert_close(alone_c["conv_state"][slot], ours_c["conv_state"][slot], atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [1, 3, 64])
def test_fused_gdn_decode_at_real_width(bsz):
    """Qwen3.5-35B-A3B's delta net (Hk 16, Hv 32, Dk = Dv = 128, K 4) in bf16, the last row padded
    on the spare slot, every third row fresh: against the three-kernel path; two calls in a row;
    one row alone equals its row of the batch bitwise."""
    hk, hv, dk, dv, kernel = 16, 32, 128, 128, 4
    num_slots = bsz + 2
    slots = torch.randperm(bsz + 1, generator=_gen(0))[:bsz].to(DEVICE)
    slots[-1] = num_slots - 1
    keep = (torch.arange(bsz, device=DEVICE) % 3) != 1
    keep[-1] = bsz == 1  # batch 1: a kept row
    c = _case(bsz, hk, hv, dk, dv, kernel, torch.bfloat16, num_slots)
    c["ssm_state"] *= 0.1
    ref_c, ours_c = _copy(c), _copy(c)
    ref = _three_kernels(ref_c, slots, keep, hk, dk)
    ours = _fused(ours_c, slots, keep, hk, dk)
    torch.testing.assert_close(ours.float(), ref.float(), atol=3e-2, rtol=2e-2)
    assert (ours == ref).float().mean() > 0.95  # rounding flips only
    torch.testing.assert_close(ours_c["conv_state"], ref_c["conv_state"], atol=0, rtol=0)
    torch.testing.assert_close(ours_c["ssm_state"], ref_c["ssm_state"], atol=1e-4, rtol=1e-4)
    _assert_tickets_zero()
    again_c = _copy(c)
    torch.testing.assert_close(_fused(again_c, slots, keep, hk, dk), ours, atol=0, rtol=0)
    torch.testing.assert_close(again_c["ssm_state"], ours_c["ssm_state"], atol=0, rtol=0)
    _assert_tickets_zero()
    r = 0
    alone_c = _copy(c)
    rows = {name: alone_c[name][r : r + 1] for name in ("x", "z", "b", "a")}
    alone = _fused(dict(alone_c, **rows), slots[r : r + 1], keep[r : r + 1], hk, dk)
    torch.testing.assert_close(alone[0], ours[r], atol=0, rtol=0)
    torch.testing.assert_close(alone_c["ssm_state"][slots[r]], ours_c["ssm_state"][slots[r]], atol=0, rtol=0)


def test_fused_gdn_decode_switch(monkeypatch):
    from lamina.kernels.selection import fused_gdn_decode_enabled

    monkeypatch.delenv("LAMINA_FUSED_GDN_DECODE", raising=False)
    assert not fused_gdn_decode_enabled("triton")  # off by default: slower on the H200
    monkeypatch.setenv("LAMINA_FUSED_GDN_DECODE", "1")
    assert fused_gdn_decode_enabled("triton") and not fused_gdn_decode_enabled("reference")
    monkeypatch.setenv("LAMINA_FUSED_GDN_DECODE", "0")
    assert not fused_gdn_decode_enabled("triton")
    monkeypatch.setenv("LAMINA_FUSED_GDN_DECODE", "yes")
    with pytest.raises(ValueError, match="LAMINA_FUSED_GDN_DECODE"):
        fused_gdn_decode_enabled("triton")

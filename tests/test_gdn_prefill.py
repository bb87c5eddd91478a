"""The gated delta net's prefill kernels: lamina's Triton causal conv (`triton_conv`) and fla-core's
chunked delta rule (`fla_prefill`) against the torch references, and their selection.

Without CUDA (CI) the Triton conv runs under Triton's CPU interpreter at tiny shapes; the fla tests
and the engine check are marked gpu (`pytest -m gpu` on the GPU machine, with fla-core installed).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

triton = pytest.importorskip("triton")

from lamina.kernels.causal_conv1d import causal_conv1d_varlen  # noqa: E402
from lamina.kernels.gated_delta_rule import gated_delta_rule_varlen  # noqa: E402
from lamina.kernels.selection import GdnPrefillKernels, gdn_prefill_kernels  # noqa: E402
from lamina.kernels.triton_conv import causal_conv1d_prefill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, seed, scale=1.0, dtype=torch.float32):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _qsl(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], device=DEVICE)


def _slots_keep(num_reqs: int, num_slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    slots = torch.tensor(rng.sample(range(num_slots), num_reqs), device=DEVICE)
    keep = torch.tensor([rng.random() < 0.5 for _ in range(num_reqs)], device=DEVICE)
    return slots, keep


# ---- Triton causal conv1d, state in the pool ---------------------------------------------------


def _conv_case(lens, channels, kernel, seed, dtype=torch.float32, num_slots=9):
    total = sum(lens)
    x = _rand(total, 2 * channels, seed=seed, dtype=dtype)[:, :channels]  # [T, C], row stride 2C
    weight = _rand(channels, kernel, seed=seed + 1, scale=0.5, dtype=dtype)  # [C, K]
    pool = _rand(num_slots, channels, kernel - 1, seed=seed + 2, dtype=dtype)  # [slots, C, K-1]
    slots, keep = _slots_keep(len(lens), num_slots, seed)
    return x, weight, pool, slots, keep


@pytest.mark.parametrize(
    "lens,channels,kernel",
    [
        ([1], 10, 4),
        ([1, 5, 0, 2, 9, 3], 10, 4),  # ragged, a request without tokens, lengths below and above K-1
        ([40, 1, 33], 200, 4),  # several token tiles (32) and channel tiles (128)
        ([3, 1, 6], 12, 2),  # K = 2: one input of state
        ([2, 7], 16, 5),
        ([3, 4, 2], 8, 1),  # K = 1: no state
    ],
)
def test_triton_conv_prefill_matches_reference(lens, channels, kernel):
    x, weight, pool, slots, keep = _conv_case(lens, channels, kernel, seed=len(lens) + channels)
    qsl = _qsl(lens)
    state_in = torch.where(keep[:, None, None], pool[slots], 0.0)  # [B, C, K-1]
    ref, ref_state = causal_conv1d_varlen(x, weight, state_in, qsl, max(lens))
    ours_pool = pool.clone()
    out = causal_conv1d_prefill(x, weight, ours_pool, slots, keep, qsl)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_pool[slots], ref_state, atol=0, rtol=0)  # copies of inputs: exact
    others = [s for s in range(pool.shape[0]) if s not in slots.tolist()]
    assert torch.equal(ours_pool[others], pool[others])
    # the delta net's q / k / v parts, each contiguous (boundaries inside a channel tile)
    split = (channels // 4, channels // 4, channels - 2 * (channels // 4))
    parts = causal_conv1d_prefill(x, weight, pool.clone(), slots, keep, qsl, split=split)
    bounds = [0, split[0], split[0] + split[1], channels]
    for part, lo, hi in zip(parts, bounds, bounds[1:]):
        assert part.shape == (sum(lens), hi - lo) and part.is_contiguous()
        assert torch.equal(part, out[:, lo:hi])
    with pytest.raises(ValueError, match="summing to C"):
        causal_conv1d_prefill(x, weight, pool.clone(), slots, keep, qsl, split=(1, 1, channels))


def test_triton_conv_prefill_bf16_and_given_request_index():
    lens = [4, 1, 11]
    x, weight, pool, slots, keep = _conv_case(lens, 24, 4, seed=5, dtype=torch.bfloat16)
    qsl = _qsl(lens)
    request_index = torch.repeat_interleave(torch.arange(len(lens), device=DEVICE), torch.tensor(lens, device=DEVICE))
    state_in = torch.where(keep[:, None, None], pool[slots], 0.0)
    ref, ref_state = causal_conv1d_varlen(x, weight, state_in, qsl, max(lens))
    out = causal_conv1d_prefill(x, weight, pool, slots, keep, qsl, request_index)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(pool[slots], ref_state)


@pytest.mark.parametrize("chunks", [[30], [1, 1, 1, 27], [2, 5, 23], [7, 1, 22]])
def test_triton_conv_prefill_chunked_equals_whole(chunks):
    """A prompt run in chunks (state carried through the pool; the first chunk starts fresh on a
    slot holding garbage) gives the outputs and final state of one fresh call over it all; a second
    request in the same steps, always carrying its state, is unaffected."""
    channels, kernel = 20, 4
    total = sum(chunks)
    x = _rand(total, channels, seed=1)  # request 0's prompt
    other = _rand(len(chunks), channels, seed=2)  # request 1: one token per step
    weight = _rand(channels, kernel, seed=3, scale=0.5)
    pool = _rand(4, channels, kernel - 1, seed=4)
    other_state0 = pool[1].clone()
    slots = torch.tensor([2, 1], device=DEVICE)
    outs, start = [], 0
    for step, size in enumerate(chunks):
        keep = torch.tensor([step > 0, True], device=DEVICE)
        xs = torch.cat([x[start : start + size], other[step : step + 1]])  # [size + 1, C]
        outs.append(causal_conv1d_prefill(xs, weight, pool, slots, keep, _qsl([size, 1]))[:size])
        start += size
    whole, whole_state = causal_conv1d_varlen(
        x, weight, torch.zeros(1, channels, kernel - 1, device=DEVICE), _qsl([total]), total
    )
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[2], whole_state[0])
    _, other_state = causal_conv1d_varlen(other, weight, other_state0[None], _qsl([len(chunks)]), len(chunks))
    assert torch.equal(pool[1], other_state[0])


def test_triton_conv_prefill_refuses_bad_input():
    x, weight, pool, slots, keep = _conv_case([3], 8, 4, seed=9)
    with pytest.raises(ValueError, match="K-1 = 3"):
        causal_conv1d_prefill(x, weight, pool[..., :2], slots, keep, _qsl([3]))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_prefill(x, weight, pool, slots, keep, _qsl([3]), activation="gelu")


# ---- selection ---------------------------------------------------------------------------------


BF16 = torch.bfloat16


def test_prefill_selection_on_cpu(monkeypatch):
    monkeypatch.delenv("LAMINA_GDN_PREFILL", raising=False)
    assert gdn_prefill_kernels("cpu", "reference", BF16) == GdnPrefillKernels("reference", "reference")
    assert gdn_prefill_kernels("cpu", "triton", BF16) == GdnPrefillKernels("reference", "triton")  # the interpreter
    monkeypatch.setenv("LAMINA_GDN_PREFILL", "reference")
    assert gdn_prefill_kernels("cpu", "triton", BF16) == GdnPrefillKernels("reference", "reference")
    monkeypatch.setenv("LAMINA_GDN_PREFILL", "fla")
    with pytest.raises(ValueError, match=r"LAMINA_GDN_PREFILL = 'fla' needs a CUDA device, not 'cpu'.*auto, reference"):
        gdn_prefill_kernels("cpu", "reference", BF16)
    with pytest.raises(ValueError, match=r"'fla' needs bfloat16 or float16 activations, not torch.float32"):
        gdn_prefill_kernels("cuda", "triton", torch.float32)
    monkeypatch.setenv("LAMINA_GDN_PREFILL", "flash")
    with pytest.raises(ValueError, match=r"LAMINA_GDN_PREFILL = 'flash' is not one of auto, fla, reference"):
        gdn_prefill_kernels("cpu", "reference", BF16)


@pytest.mark.parametrize("fla_error", [None, "ModuleNotFoundError: No module named 'fla'"])
def test_prefill_selection_on_cuda(monkeypatch, caplog, fla_error):
    """Whether fla imports is all that differs (faked here, so this runs without a GPU); auto says
    once why it falls back."""
    from lamina.kernels import fla_prefill, selection

    monkeypatch.setattr(fla_prefill, "fla_import_error", lambda: fla_error)
    monkeypatch.delenv("LAMINA_GDN_PREFILL", raising=False)
    selection._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="lamina.kernels.selection"):
        auto = gdn_prefill_kernels("cuda", "triton", BF16)
        assert gdn_prefill_kernels("cuda", "triton", BF16) == auto
    assert auto == GdnPrefillKernels("fla" if fla_error is None else "reference", "triton")
    # float32 models keep the reference delta rule (fla's kernels need 16-bit activations)
    assert gdn_prefill_kernels("cuda", "triton", torch.float32) == GdnPrefillKernels("reference", "triton")
    warnings = [r.getMessage() for r in caplog.records if "fla-core does not import" in r.getMessage()]
    assert len(warnings) == (0 if fla_error is None else 1)
    assert gdn_prefill_kernels("cuda:0", "reference", BF16) == GdnPrefillKernels("reference", "reference")
    monkeypatch.setenv("LAMINA_GDN_PREFILL", "fla")
    if fla_error is None:
        assert gdn_prefill_kernels("cuda", "reference", BF16) == GdnPrefillKernels("fla", "triton")
    else:
        with pytest.raises(ValueError, match=r"LAMINA_GDN_PREFILL = 'fla' but fla-core does not import \(Module.*fla-core"):
            gdn_prefill_kernels("cuda", "triton", BF16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the answer without CUDA")
@pytest.mark.parametrize("lens,chunk", [([5, 64, 1, 0, 200, 63, 65], 64), ([0], 64), ([], 64), ([7, 0, 3], 2)])
def test_chunk_indices_host(lens, chunk):
    """(request, chunk within the request) of every chunk, request by request, none for a request
    without tokens: the grid fla derives from cu_seqlens on the device."""
    from lamina.kernels.varlen import chunk_indices_host

    expected = [[b, i] for b, n in enumerate(lens) for i in range(-(-n // chunk))]
    indices = chunk_indices_host(lens, chunk)
    assert indices.dtype.name == "int64" and indices.shape == (len(expected), 2)
    assert indices.tolist() == expected
    with pytest.raises(ValueError, match=r"query lengths must be >= 0, got \[3, -1\]"):
        chunk_indices_host([3, -1], chunk)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        chunk_indices_host(lens, 0)


def test_metadata_chunk_indices_once_per_step():
    """ForwardMetadata uploads a step's chunk indices once per chunk size (every delta-net layer of
    the step shares them), refuses host lengths that are not this step's, and has none without them."""
    from lamina.layers.metadata import ForwardMetadata

    lens = (70, 0, 3)
    qsl = _qsl(list(lens))

    def meta(query_lens_host, num_tokens=sum(lens)):
        return ForwardMetadata(
            num_tokens=num_tokens, num_reqs=len(lens), max_query_len=max(lens), max_seq_len=max(lens),
            positions=torch.zeros(num_tokens, dtype=torch.long), query_start_loc=qsl, seq_lens=qsl[1:] - qsl[:-1],
            slot_mapping=torch.zeros(num_tokens, dtype=torch.long), block_tables=torch.zeros(3, 1, dtype=torch.long),
            state_slots=torch.arange(3), has_initial_state=torch.zeros(3, dtype=torch.bool),
            query_lens_host=query_lens_host,
        )

    step = meta(lens)
    first = step.chunk_indices(64)
    assert first.device == qsl.device and first.dtype == torch.long
    assert first.tolist() == [[0, 0], [0, 1], [2, 0]]
    assert step.chunk_indices(64) is first
    assert step.chunk_indices(16).tolist() == [[0, i] for i in range(5)] + [[2, 0]]
    assert meta(None).chunk_indices(64) is None
    with pytest.raises(ValueError, match=r"query_lens_host \(70, 3, 1\) does not describe .* 3 requests and 73"):
        meta((70, 3, 1)).chunk_indices(64)
    with pytest.raises(ValueError, match=r"query_lens_host \(70, 3\) does not describe"):
        meta((70, 3)).chunk_indices(64)


def test_fla_is_not_imported_without_cuda():
    from lamina.kernels.fla_prefill import fla_import_error

    assert fla_import_error() == "no CUDA device"


def test_layer_reads_the_choice_when_built(qwen3_5_moe_dir, monkeypatch):
    """The choice is made once, at model build: changing the environment later changes nothing."""
    from lamina import LLM
    from lamina.layers.gated_delta_net import GatedDeltaNet

    monkeypatch.setenv("LAMINA_GDN_PREFILL", "reference")
    with LLM(str(qwen3_5_moe_dir), device="cpu", dtype="float32", show_progress=False) as llm:
        layers = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, GatedDeltaNet)]
        assert layers and all(m.prefill_kernels == GdnPrefillKernels("reference", "reference") for m in layers)
    monkeypatch.setenv("LAMINA_GDN_PREFILL", "nope")
    with pytest.raises(ValueError, match="LAMINA_GDN_PREFILL = 'nope'"):
        LLM(str(qwen3_5_moe_dir), device="cpu", dtype="float32", show_progress=False)


def test_engine_with_triton_prefill_conv_matches_reference(qwen3_5_moe_short_dir, monkeypatch):
    """The engine on the Triton kernel set (on the CPU: the interpreter), eager and scheduled
    asynchronously, with prompts chunked by a small token budget, so prefill chunks and decodes
    share steps and conv states carry over through the pool between chunks: greedy tokens and
    logprobs equal the reference kernels' (synchronous). The three-layer checkpoint (two delta-net
    layers, each with its own conv state pool) keeps the interpreter's launches down."""
    from lamina import LLM, SamplingParams

    if DEVICE == "cuda":  # the CUDA engine run of the prefill kernels is the bf16 gpu test below
        pytest.skip("on CUDA: test_engine_greedy_with_fla_prefill")
    prompts = [[5, 17, 300, 8, 9, 10, 11], [9] * 11, [40, 41]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    runs = {}
    for kernels in ("reference", "triton"):
        monkeypatch.setenv("LAMINA_KERNELS", kernels)
        with LLM(str(qwen3_5_moe_short_dir), device=DEVICE, dtype="float32", show_progress=False, enforce_eager=True,
                 max_num_seqs=3, max_num_batched_tokens=6, async_scheduling=kernels == "triton") as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[kernels] = [(o.outputs[0].token_ids, [float(next(iter(d.values()))) for d in o.outputs[0].logprobs])
                         for o in outs]
    for (ref_ids, ref_lp), (ids, lp) in zip(runs["reference"], runs["triton"]):
        assert ids == ref_ids
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)


# ---- fla-core's chunked delta rule (GPU) -------------------------------------------------------


def _gdr_case(lens, hk, hv, dk, dv, seed, dtype, num_slots=None):
    total = sum(lens)
    num_slots = num_slots or len(lens) + 3
    q = _rand(total, hk, dk, seed=seed, dtype=dtype)  # [T, Hk, Dk]
    k = _rand(total, hk, dk, seed=seed + 1, dtype=dtype)  # [T, Hk, Dk]
    v = _rand(total, hv, dv, seed=seed + 2, dtype=dtype)  # [T, Hv, Dv]
    g = -torch.nn.functional.softplus(_rand(total, hv, seed=seed + 3)) * 0.5  # [T, Hv] log decay <= 0
    beta = torch.sigmoid(_rand(total, hv, seed=seed + 4))  # [T, Hv]
    pool = _rand(num_slots, hv, dk, dv, seed=seed + 5, scale=0.1)  # [slots, Hv, Dk, Dv] float32
    slots, keep = _slots_keep(len(lens), num_slots, seed)
    return q, k, v, g, beta, pool, slots, keep


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


_RAGGED = ([5, 64, 1, 0, 200, 63, 65], 2, 4, 64, 64)  # ragged, chunk boundaries, a request without tokens


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lens,hk,hv,dk,dv,dtype",
    [
        ([1], 2, 4, 64, 64, torch.bfloat16),  # T = 1
        ([1, 1, 1], 2, 2, 32, 64, torch.bfloat16),  # decodes only
        (*_RAGGED, torch.bfloat16),
        ([700, 1, 129], 16, 32, 128, 128, torch.bfloat16),  # Qwen3.5-35B-A3B heads (GQA 16 -> 32)
        # float32 at one shape only: the engine sends fla bfloat16 / float16 (selection.gdn_prefill_kernels
        # refuses float32), and each new shape and dtype costs fla-core ~45-65 s of autotuning on a cold
        # machine (session 30); the tighter tolerance still checks the wrapper's slots, keep and chunking
        (*_RAGGED, torch.float32),
    ],
)
def test_fla_prefill_matches_reference(lens, hk, hv, dk, dv, dtype):
    from lamina.kernels.fla_prefill import fla_import_error, gated_delta_rule_prefill_fla

    assert fla_import_error() is None, fla_import_error()
    q, k, v, g, beta, pool, slots, keep = _gdr_case(lens, hk, hv, dk, dv, seed=len(lens), dtype=dtype)
    qsl = _qsl(lens)
    state_in = torch.where(keep[:, None, None, None], pool[slots], 0.0)
    ref, ref_state = gated_delta_rule_varlen(q.float(), k.float(), v.float(), g, beta, state_in, qsl, max(lens))
    ours_pool = pool.clone()
    out = gated_delta_rule_prefill_fla(q, k, v, g, beta, ours_pool, slots, keep, qsl)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2  # fla multiplies in bf16 / tf32
    assert _rel(out, ref) < tol
    assert _rel(ours_pool[slots], ref_state) < tol
    for b, n in enumerate(lens):  # per request too, so a small request's error is not hidden
        start = sum(lens[:b])
        if n:
            assert _rel(out[start : start + n], ref[start : start + n]) < 2 * tol, f"request {b}"
        assert _rel(ours_pool[slots[b]], ref_state[b]) < 2 * tol, f"request {b} state"
    others = [s for s in range(pool.shape[0]) if s not in slots.tolist()]
    assert torch.equal(ours_pool[others], pool[others])
    assert ours_pool.dtype == torch.float32


@pytest.mark.gpu
def test_fla_prefill_with_host_chunk_indices_never_syncs():
    """Chunk indices built from the host lengths are fla's own (`prepare_chunk_indices`), give the
    same bits as fla deriving them, and the call then never waits for the device (with fla deriving
    them, `repeat_interleave` reads their count back)."""
    from fla.ops.utils.index import prepare_chunk_indices

    from lamina.host_to_device import to_device
    from lamina.kernels.fla_prefill import FLA_CHUNK_SIZE, gated_delta_rule_prefill_fla
    from lamina.kernels.varlen import chunk_indices_host

    lens = [5, 64, 1, 0, 200, 63, 65]
    q, k, v, g, beta, pool, slots, keep = _gdr_case(lens, 2, 4, 64, 64, seed=7, dtype=torch.bfloat16)
    qsl = _qsl(lens)
    indices = to_device(chunk_indices_host(lens, FLA_CHUNK_SIZE), DEVICE)  # [NT, 2]
    assert torch.equal(indices, prepare_chunk_indices(qsl.clone(), FLA_CHUNK_SIZE))
    derived_pool, given_pool = pool.clone(), pool.clone()
    derived = gated_delta_rule_prefill_fla(q, k, v, g, beta, derived_pool, slots, keep, qsl.clone())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        given = gated_delta_rule_prefill_fla(q, k, v, g, beta, given_pool, slots, keep, qsl, chunk_indices=indices)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(given, derived)
    assert torch.equal(given_pool, derived_pool)


@pytest.mark.gpu
def test_fla_prefill_chunked_equals_whole():
    """Chunks of one prompt carried through the pool give the whole prompt's output and state."""
    from lamina.kernels.fla_prefill import gated_delta_rule_prefill_fla

    chunks = [100, 1, 37, 200]
    q, k, v, g, beta, pool, _, _ = _gdr_case([sum(chunks)], 2, 4, 64, 64, seed=11, dtype=torch.bfloat16)
    slots = torch.tensor([1], device=DEVICE)
    whole_pool = pool.clone()
    whole = gated_delta_rule_prefill_fla(q, k, v, g, beta, whole_pool, slots, torch.tensor([False], device=DEVICE),
                                         _qsl([sum(chunks)]))
    outs, start = [], 0
    for i, size in enumerate(chunks):
        rows = slice(start, start + size)
        outs.append(gated_delta_rule_prefill_fla(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, slots,
                                                 torch.tensor([i > 0], device=DEVICE), _qsl([size])))
        start += size
    assert _rel(torch.cat(outs), whole) < 1e-2
    assert _rel(pool[1], whole_pool[1]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1], [3, 1, 40, 0, 130]])
def test_triton_conv_prefill_bf16_at_real_width(lens):
    """Qwen3.5-35B-A3B delta-net conv: 2*2048 + 4096 channels, kernel 4, bf16."""
    x, weight, pool, slots, keep = _conv_case(lens, 8192, 4, seed=3, dtype=torch.bfloat16)
    qsl = _qsl(lens)
    state_in = torch.where(keep[:, None, None], pool[slots], 0.0)
    ref, ref_state = causal_conv1d_varlen(x, weight, state_in, qsl, max(lens))
    out = causal_conv1d_prefill(x, weight, pool, slots, keep, qsl)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(pool[slots], ref_state)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16"])
@pytest.mark.parametrize("short_prefill", ["0", "64"], ids=["fla", "short"])
def test_engine_greedy_with_fla_prefill(tmp_path, monkeypatch, dtype, short_prefill):
    """The engine with the fla prefill (prompts chunked and batched with decodes, so states carry
    over through the pool in mixed steps), or with chunks of up to 64 tokens on the token-by-token
    kernel (`short`: LAMINA_GDN_SHORT_PREFILL=64, every chunk here): greedy tokens agree with
    transformers in float32 on the CPU under the near-tie rule (as tests/test_gpu_engine.py)."""
    from lamina import LLM, SamplingParams
    from lamina.layers.gated_delta_net import GatedDeltaNet
    from tests import tiny_checkpoints as tc
    from tests.reference import load_reference, reference_logits

    path = tc.make_qwen3_5_moe(tmp_path / "q35")
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 990) for _ in range(n)] for n in (1, 9, 70, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    monkeypatch.setenv("LAMINA_GDN_PREFILL", "fla")
    monkeypatch.setenv("LAMINA_GDN_SHORT_PREFILL", short_prefill)
    with LLM(str(path), device="cuda", dtype=dtype, max_num_batched_tokens=64, show_progress=False) as llm:
        layers = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, GatedDeltaNet)]
        assert layers and all(m.prefill_kernels == GdnPrefillKernels("fla", "triton") for m in layers)
        assert all(m.short_prefill_tokens == int(short_prefill) for m in layers)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = load_reference(path)
    exact = total = 0
    for prompt, out in zip(prompts, [o.outputs[0].token_ids for o in outs]):
        logits = reference_logits(ref, prompt + out)
        for j, token in enumerate(out):
            row = logits[len(prompt) + j - 1]
            assert row[token] >= row.max() - 0.05, f"token {j} is {row.max() - row[token]:.4f} below the max"
            exact += int(row.argmax() == token)
            total += 1
    assert exact >= 0.9 * total

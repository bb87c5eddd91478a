"""Qwen4-Exp decode on the CUDA-graph path: QSA indexed attention's graph-safe one-token decode
(lamina.kernels.qsa_decode) and the N-gram PLE from the static buffer's token history.

On the CPU the engine runs decode steps through the graphs' static buffers and padding eagerly
(`capture_decode_graphs(..., static_off_cuda=True)`), on the Triton kernels under Triton's
interpreter, and must give the reference kernels' greedy tokens and logprobs. On a GPU (marked
gpu) the captured graphs must give the eager decode's.
"""

from __future__ import annotations

import pytest
import torch

from lamina.kernels.indexed_attention import qsa_key_mask
from lamina.kernels.paged_attention import paged_attention
from lamina.kernels.qsa_decode import decode_block_selection, qsa_decode_attention
from tests import tiny_checkpoints as tc

pytestmark = pytest.mark.usefixtures("single_torch_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EOS = 999
# Budget 8 = 2 blocks of 4: the last two prompts have more complete blocks than that from their
# first decode step on (4 each), the first at its second (context 12: 3 blocks).
# Contexts of 10-15 tokens: 2-3 complete index blocks of 4 against a budget of 2 (8 tokens), so the
# selection matters from the first decode step; EOS inside the n-gram windows.
PROMPTS = [[5, 17, 300, EOS, 41, 6, 6, 2, 1, 4], [9, 3, EOS, 9] * 3, list(range(40, 49)) + [EOS, 7, 8]]


@pytest.fixture(scope="module")
def qwen4_dir(tmp_path_factory):
    """Five layers (tc.QWEN4_LAYER_TYPES), PLE on the second: the GPU test."""
    return tc.make_qwen4_exp(tmp_path_factory.mktemp("q4graphs") / "ckpt", hc_count=2, ple_layer_ids=(2,))


@pytest.fixture(scope="module")
def qwen4_short_dir(tmp_path_factory):
    """Three layers (delta net, delta net with the PLE, QSA attention), as the first three of
    tc.QWEN4_LAYER_TYPES: the CPU tests, whose Triton kernels are interpreted layer by layer."""
    return tc.make_qwen4_exp(tmp_path_factory.mktemp("q4graphs_short") / "ckpt", hc_count=2, ple_layer_ids=(2,),
                             layer_types=tc.QWEN4_LAYER_TYPES[:3])


# ---- the decode kernels against the reference mask + paged attention ----------------------------


def _cache_case(seq_lens, *, page=4, heads=4, kv_heads=2, dim=8, table_width=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bsz = len(seq_lens)
    num_pages = bsz * table_width + 1
    k_cache = torch.randn(num_pages, page, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_pages, page, kv_heads, dim, generator=gen)
    tables = torch.randperm(num_pages - 1, generator=gen)[: bsz * table_width].view(bsz, table_width) + 1
    query = torch.randn(bsz, heads, dim, generator=gen)
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_qsa_decode_matches_reference_mask(ties):
    """Selection and attention of one query per request equal `qsa_key_mask` + `paged_attention`
    at the step's own lengths, while the decode path scores a larger, fixed number of blocks (a
    graph's capacity). `ties`: all block scores 0 (ReLU), so the tie rule decides."""
    ratio, top_blocks, idx_heads, idx_dim = 4, 2, 3, 8
    seq_lens = [1, 7, 8, 9, 23, 30]
    query, k_cache, v_cache, tables, seq = _cache_case(seq_lens)
    gen = torch.Generator().manual_seed(1)
    capacity = tables.shape[1] * k_cache.shape[1]  # 36 positions: 9 index blocks
    idx_query = torch.randn(len(seq_lens), idx_heads, idx_dim, generator=gen)
    block_keys = torch.randn(len(seq_lens), capacity // ratio, idx_dim, generator=gen)  # [B, 9, D]
    if ties:
        idx_query, block_keys = idx_query.abs(), -block_keys.abs()
    qsl = torch.arange(len(seq_lens) + 1)
    step_max = max(seq_lens)
    ref_mask = qsa_key_mask(
        idx_query, block_keys[:, : step_max // ratio], seq, qsl, 1, ratio, top_blocks, -(-step_max // 4) * 4,
    )  # [B, 1, S]
    ref = paged_attention(query, k_cache, v_cache, tables, seq, qsl, 1, step_max, 0.3, key_mask=ref_mask)

    chosen = decode_block_selection(idx_query, block_keys, seq, ratio, top_blocks)  # [B, 9]
    # The chosen blocks, as key positions, are the reference mask's complete-block keys.
    for b, n in enumerate(seq_lens):
        complete = n // ratio
        picked = ref_mask[b, 0, : complete * ratio].view(complete, ratio).all(dim=1)
        assert torch.equal(chosen[b, :complete], picked)
        assert not chosen[b, complete:].any()
        assert int(chosen[b].sum()) == min(complete, top_blocks)
    ours = qsa_decode_attention(query, k_cache, v_cache, tables, seq, chosen, ratio, top_blocks, 0.3)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rotary_dim", [16, 8], ids=["full_rope", "partial_rope"])
def test_triton_block_scores_match_torch(rotary_dim):
    """The Triton block scores (paged raw keys -> pooled, normed, rotated keys -> scores) equal
    the torch path's on each request's complete blocks, and are 0 past them."""
    from lamina.kernels.indexed_attention import block_scores, pool_block_keys
    from lamina.kernels.paged_attention import gather_paged_context
    from lamina.kernels.triton_qsa import qsa_block_scores
    from lamina.layers.rotary import RotaryEmbedding

    ratio, page, dim, heads, eps = 4, 8, 16, 3, 1e-6
    seq_lens = torch.tensor([1, 4, 13, 30, 40])
    gen = torch.Generator().manual_seed(3)
    width = 5  # pages per request: capacity 40 positions = 10 index blocks
    tables = torch.randperm(len(seq_lens) * width + 2, generator=gen)[: len(seq_lens) * width].view(-1, width)
    cache = torch.randn(len(seq_lens) * width + 2, page, 1, dim, generator=gen)
    query = torch.randn(len(seq_lens), heads, dim, generator=gen)
    weight = torch.randn(dim, generator=gen) * 0.1
    rotary = RotaryEmbedding(dim, rotary_dim, 10000.0, 128)
    nb = width * page // ratio
    cos, sin = rotary.cos_sin(torch.arange(nb) * ratio)  # [nb, rotary_dim]

    raw = gather_paged_context(cache, tables, width)[:, :, 0]  # [B, 40, D]
    keys = pool_block_keys(raw, ratio, nb)  # [B, nb, D]
    keys = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)
    keys = rotary.apply(keys.transpose(0, 1), cos, sin).transpose(0, 1)  # [B, nb, D]
    ref = block_scores(query[:, None], keys)[:, 0]  # [B, nb]
    on = [t.to(DEVICE) for t in (query, cache, tables, seq_lens, weight, cos, sin)]  # CUDA, or the interpreter
    ours = qsa_block_scores(*on[:5], eps, True, *on[5:], ratio, block_n=4).cpu()
    complete = torch.arange(nb)[None, :] < (seq_lens // ratio)[:, None]  # [B, nb]
    torch.testing.assert_close(ours[complete], ref[complete], atol=1e-5, rtol=1e-5)
    assert (ours[~complete] == 0).all()


# ---- the engine ---------------------------------------------------------------------------------


class HostSync(AssertionError):
    """A tensor value read on the host inside the static-buffer decode forward."""


def _no_host_reads_from_lamina(monkeypatch):
    """Make the tensor methods that read values on the host (or copy to it) raise when lamina's
    own code calls them (the Triton interpreter may: it runs kernels on host copies)."""
    import inspect

    def guarded(name, original):
        def call(*args, **kwargs):
            caller = inspect.currentframe().f_back.f_code.co_filename
            if "/lamina/" in caller:
                raise HostSync(f"{name} called from {caller}")
            return original(*args, **kwargs)

        return call

    for name in ("item", "tolist", "nonzero", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, guarded(f"Tensor.{name}", getattr(torch.Tensor, name)))
    for name in ("nonzero", "unique", "masked_select"):
        monkeypatch.setattr(torch, name, guarded(f"torch.{name}", getattr(torch, name)))


def _why_eager(runner) -> str:
    """Why the runner holds no decode graphs: the reason it recorded, and `why_not_capturable` now."""
    from lamina.worker.cuda_graphs import why_not_capturable

    return (f"runner.no_graphs_reason = {runner.no_graphs_reason!r}; "
            f"why_not_capturable(model) = {why_not_capturable(runner.model)!r}")


def _greedy(path, prompts, *, graphs: bool, kernels: str, monkeypatch, max_tokens=2, check=None, device=DEVICE,
            **kwargs):
    """Greedy tokens and logprobs; 5 slots, so three requests decode as the capture size 4 (a
    padded row), and a small `max_model_len`: the graph path scores every block of it."""
    from lamina import LLM, SamplingParams

    monkeypatch.setenv("LAMINA_KERNELS", kernels)
    monkeypatch.setenv("LAMINA_QSA_DECODE", "1")  # the default, pinned
    if DEVICE == "cuda":  # fla-core's prefill multiplies float32 in tf32 (tests/test_gdn_prefill.py)
        monkeypatch.setenv("LAMINA_GDN_PREFILL", "reference")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    with LLM(str(path), device=device, dtype="float32", show_progress=False, enforce_eager=not graphs,
             max_num_seqs=5, max_model_len=48, **kwargs) as llm:
        runner = llm.engine.executor.runner
        if graphs and DEVICE == "cpu":
            assert runner.capture_decode_graphs(llm.engine.max_num_seqs, llm.engine.max_model_len,
                                                static_off_cuda=True), _why_eager(runner)
        assert (runner.decode_graphs is not None) == graphs, _why_eager(runner)
        replays = []
        if graphs:
            run = runner.decode_graphs.run
            def counted(chunks, *args, **kw):
                replays.append(len(chunks))
                return run(chunks, *args, **kw)

            monkeypatch.setattr(runner.decode_graphs, "run", counted)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if check is not None:
            check(runner)
    if graphs:
        assert 3 in replays, f"no padded decode step of all three requests ran on the graph path: {replays}"
    return [(o.outputs[0].token_ids, [float(next(iter(d.values()))) for d in o.outputs[0].logprobs]) for o in outs]


def test_graph_static_buffers_match_reference(qwen4_short_dir, monkeypatch):
    """Three requests (run as the capture size 4: a padded row) with contexts past the QSA budget
    and EOS inside their n-gram windows: tokens and logprobs of the reference kernels; and the
    static-buffer forward reads no tensor value on the host."""
    if DEVICE == "cuda":
        pytest.skip("the CPU run of the static buffers; test_graphs_match_eager_on_gpu covers CUDA")
    def replay_without_host_reads(runner):
        """The last step's static buffers once more, with host reads from lamina's code raising
        (the CPU's tie rule in `select_top_blocks` reads the host: the GPU's rule stands in)."""
        from lamina.kernels import indexed_attention

        with monkeypatch.context() as patch:
            patch.setattr(indexed_attention, "_select_like_reference",
                          lambda scores, counts, k, _: indexed_attention._select_canonical(scores, counts, k))
            _no_host_reads_from_lamina(patch)
            logits = runner.decode_graphs._forward(4)
        assert logits.shape[0] == 4 and torch.isfinite(logits).all()

    ref = _greedy(qwen4_short_dir, PROMPTS, graphs=False, kernels="reference", monkeypatch=monkeypatch)
    # As the GPU test builds it: the PLE table on the compute device (ple_table_device="gpu"), whose
    # name carries another index than its tensors report ("cpu:0" -> "cpu", as "cuda" -> "cuda:0").
    ours = _greedy(qwen4_short_dir, PROMPTS, graphs=True, kernels="triton", monkeypatch=monkeypatch,
                   check=replay_without_host_reads, device="cpu:0", ple_table_device="gpu")
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, ours):
        assert ids == ref_ids
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_graphs_match_eager_on_gpu(qwen4_dir, monkeypatch):
    """Captured decode graphs of Qwen4-Exp against the eager decode on the same Triton kernels."""
    eager = _greedy(qwen4_dir, PROMPTS, graphs=False, kernels="triton", monkeypatch=monkeypatch, max_tokens=12)
    graphs = _greedy(qwen4_dir, PROMPTS, graphs=True, kernels="triton", monkeypatch=monkeypatch, max_tokens=12,
                     ple_table_device="gpu")
    for (eager_ids, eager_lp), (ids, lp) in zip(eager, graphs):
        assert ids == eager_ids
        torch.testing.assert_close(lp, eager_lp, atol=1e-4, rtol=0)


def test_host_ple_table_is_not_captured(qwen4_short_dir, monkeypatch):
    """A PLE table in host memory needs its row ids on the host every step: decode stays eager,
    with the reason said."""
    from lamina.worker.cuda_graphs import why_not_capturable

    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    from lamina import LLM

    monkeypatch.setenv("LAMINA_QSA_DECODE", "0")
    with LLM(str(qwen4_short_dir), device="cpu", dtype="float32", show_progress=False, enforce_eager=True) as llm:
        model = llm.engine.executor.runner.model
        assert "LAMINA_QSA_DECODE=0" in why_not_capturable(model)
    monkeypatch.delenv("LAMINA_QSA_DECODE")  # on by default
    with LLM(str(qwen4_short_dir), device="cpu", dtype="float32", show_progress=False, enforce_eager=True) as llm:
        model = llm.engine.executor.runner.model
        assert why_not_capturable(model) is None
        assert "verification graphs carry no token history" in why_not_capturable(model, verify=True)
        table = next(m for m in model.modules() if hasattr(m, "host_table"))
        table.device = torch.device("meta")  # as if the model ran on another device than the table
        assert "PLE table" in why_not_capturable(model) and "ple_table_device=gpu" in why_not_capturable(model)


def test_ple_table_on_cuda_is_not_a_host_table(monkeypatch):
    """The GPU test's model: built on torch.device("cuda") (LLM(device="cuda")), its PLE table on
    cuda:0, where a tensor allocated on "cuda" lives. Device objects compare their spelling
    (torch.device("cuda") != torch.device("cuda:0")), which made every such table a host table and
    the decode eager. Simulated without a GPU."""
    from types import SimpleNamespace

    from lamina.layers import ple

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert ple._as_reported("cuda") == torch.device("cuda:0") == ple._as_reported(torch.device("cuda", 0))
    assert ple._as_reported("cpu:0") == torch.device("cpu") and ple._as_reported("meta") == torch.device("meta")
    host_table = ple.NGramHashEmbedding.host_table.fget
    on_gpu = SimpleNamespace(ngram_embedding=SimpleNamespace(device=torch.device("cuda:0")), device=torch.device("cuda"))
    assert not host_table(on_gpu)
    in_host_memory = SimpleNamespace(ngram_embedding=SimpleNamespace(device=torch.device("cpu")), device=torch.device("cuda"))
    assert host_table(in_host_memory)

"""A request's result never depends on the rest of its step (DESIGN.md, "Batch invariance").

The discrete choices of a forward pass - QSA block top-k (ties are common: scores are sums of
ReLUs), MoE expert top-k, PLE n-gram hashing, greedy argmax, seeded sampling - are made per
request over that request's own candidates. Checked here on the CPU in float32: run alone, in
batches with longer and shorter requests, and with chunked prefill of several sizes, a request
gets the same tokens, its logprobs agree to float32 rounding, and with QSA it is transformers'
argmax at every position.

Why rounding and not bit-equality (measured, torch 2.13.0+cpu, MKL 2024.2, AVX2): MKL rounds
products of one to three rows otherwise than of four or more, and on several threads splits a
product by its row count (MKL_CBWR=AUTO,STRICT stops the second); ATen's vectorised loops compute
the tail of a tensor (numel % vector width) with the scalar function, and sigmoid, silu and
softplus differ between the two by an ulp, so an element's rounding depends on where it sits in
the batch; torch.matmul on batched views picks its kernel by the batch's total size. Padding
GEMMs to four rows and strict MKL took the drift from ~1e-5 to ~5e-7 in the family tests, not to 0.
"""

from __future__ import annotations

import random

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.kernels.indexed_attention import _select_canonical, qsa_key_mask, select_top_blocks
from tests import tiny_checkpoints as tc
from tests.reference import load_reference, reference_logits

EOS = 999
# (indexer_budget, indexer_compress_ratio): 2 indexer heads make zero scores, hence ties, common.
QSA_SHAPES = [(8, 4), (12, 2), (16, 8)]
PROMPT_LENS = [1, 7, 19, 33, 45]
MAX_TOKENS = 12  # contexts up to 57
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _prompts(seed: int, lens=PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for n in lens:
        p = [rng.randrange(0, 990) for _ in range(n)]
        if n > 12:
            p[5] = EOS  # n-grams are cut there (PLE)
        prompts.append(p)
    return prompts


def _generate(path, prompts, params=PARAMS, **kwargs):
    with LLM(str(path), device="cpu", dtype="float32", show_progress=False, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _logprobs(completion) -> list[float]:
    return [float(entry[token]) for token, entry in zip(completion.token_ids, completion.logprobs)]


def _assert_same(runs: dict[str, list], prompts) -> None:
    base_name, base = next(iter(runs.items()))
    for name, outs in runs.items():
        for i, (a, b) in enumerate(zip(base, outs)):
            assert a.token_ids == b.token_ids, f"request {i} (prompt {len(prompts[i])} tokens): {name} != {base_name}"
            torch.testing.assert_close(_logprobs(b), _logprobs(a), atol=2e-6, rtol=0)


# ---- QSA block selection: end to end ---------------------------------------------------------


@pytest.fixture(scope="module", params=QSA_SHAPES, ids=[f"budget{b}_ratio{r}" for b, r in QSA_SHAPES])
def qsa_tie_model(request, tmp_path_factory):
    budget, ratio = request.param
    path = tc.make_qwen4_exp(
        tmp_path_factory.mktemp(f"q4_ties_{budget}_{ratio}") / "ckpt", hc_count=4, ple_layer_ids=(1, 4),
        indexer_n_heads=2, indexer_budget=budget, indexer_compress_ratio=ratio, seed=5,
    )
    return path, load_reference(path)


def test_qsa_selection_is_per_request_and_equals_transformers(qsa_tie_model):
    """Alone, batched with longer and shorter requests, chunked prefill of 5 and 11 tokens: the
    same tokens and logprobs; every token is transformers' argmax and its logprob transformers'."""
    path, ref = qsa_tie_model
    prompts = _prompts(11)
    runs = {
        "alone": _generate(path, prompts, max_num_seqs=1),
        "batch": _generate(path, prompts, max_num_seqs=len(prompts)),
        "batch3": _generate(path, prompts, max_num_seqs=3),
        "chunk5": _generate(path, prompts, max_num_seqs=len(prompts), max_num_batched_tokens=5),
        "chunk11": _generate(path, prompts, max_num_seqs=len(prompts), max_num_batched_tokens=11),
    }
    _assert_same(runs, prompts)
    for prompt, out in zip(prompts, runs["batch"]):
        logprobs = torch.log_softmax(reference_logits(ref, prompt + out.token_ids), dim=-1)
        rows = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]  # [n, vocab]
        assert rows.argmax(dim=-1).tolist() == out.token_ids
        ours = torch.tensor(_logprobs(out))
        torch.testing.assert_close(ours, rows.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=1e-5, rtol=0)


# ---- QSA block selection: the kernel ---------------------------------------------------------


def _tied_scores(rows: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Scores with many exact ties, as ReLU sums give (most are 0)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (rows, num_blocks), generator=gen).float() * (torch.rand(rows, num_blocks, generator=gen) < 0.5)


def test_cpu_selection_is_transformers_topk_ties_included():
    """Each row's choice is exactly `topk` over its own candidates, the call transformers makes."""
    scores = _tied_scores(400, 24, seed=0)
    gen = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 25, (400,), generator=gen)
    for k in (1, 2, 3, 6):
        chosen = select_top_blocks(scores, counts, k)
        for row in range(scores.shape[0]):
            n = int(counts[row])
            expected = torch.zeros(24, dtype=torch.bool)
            if n > 0:
                expected[scores[row, :n].topk(min(k, n), dim=0).indices] = True
            assert torch.equal(chosen[row], expected), (k, row, n)


@pytest.mark.parametrize("select", [select_top_blocks, _select_canonical], ids=["cpu_reference", "canonical"])
def test_selection_ignores_padding_and_neighbours(select):
    """A row chooses the same blocks whatever the padded width and whatever other rows hold."""
    scores = _tied_scores(64, 10, seed=2)
    counts = torch.randint(0, 11, (64,), generator=torch.Generator().manual_seed(3))
    narrow = select(scores, counts, 3)
    wide_scores = torch.cat([scores, torch.rand(64, 30)], dim=1)  # garbage past each row's candidates
    wide = select(wide_scores, counts, 3)
    assert torch.equal(wide[:, :10], narrow) and not wide[:, 10:].any()
    for row in (0, 17, 63):  # alone
        assert torch.equal(select(scores[row : row + 1], counts[row : row + 1], 3)[0], narrow[row])


def test_canonical_rule_breaks_ties_by_lower_block_index():
    scores = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, 2.0]])
    chosen = _select_canonical(scores, torch.tensor([6]), 3)
    assert chosen[0].tolist() == [False, True, False, True, False, True]
    chosen = _select_canonical(scores, torch.tensor([5]), 3)  # block 5 is not a candidate
    assert chosen[0].tolist() == [True, True, False, True, False, False]


def test_key_mask_of_a_request_alone_equals_its_rows_in_a_padded_batch():
    """`qsa_key_mask` for request 0 (context 21) alone and batched with a 57-token prefill."""
    gen = torch.Generator().manual_seed(4)
    ratio, top_blocks, dim = 4, 2, 16
    q_short = torch.randn(1, 2, dim, generator=gen).relu()  # one decode query
    q_long = torch.randn(57, 2, dim, generator=gen)
    keys = torch.randn(2, 57 // ratio, dim, generator=gen)
    keys[0, :5] = -keys[0, :5].abs()  # queries >= 0 and keys <= 0: scores exactly 0, all tied
    alone = qsa_key_mask(q_short, keys[:1, : 21 // ratio], torch.tensor([21]), torch.tensor([0, 1]), 1, ratio, top_blocks, 24)
    batched = qsa_key_mask(
        torch.cat([q_short, q_long]), keys, torch.tensor([21, 57]), torch.tensor([0, 1, 58]), 57, ratio, top_blocks, 64,
    )
    assert torch.equal(batched[0, :1, :24], alone[0]) and not batched[0, 0, 24:].any()


@pytest.mark.gpu
def test_gpu_selection_is_batch_invariant():
    """On CUDA the canonical rule; a row's choice does not change with padding or its neighbours."""
    scores = _tied_scores(256, 40, seed=5).cuda()
    counts = torch.randint(0, 41, (256,), generator=torch.Generator().manual_seed(6)).cuda()
    chosen = select_top_blocks(scores, counts, 4)
    assert torch.equal(chosen.cpu(), _select_canonical(scores.cpu(), counts.cpu(), 4))
    wide = select_top_blocks(torch.cat([scores, torch.rand(256, 100, device="cuda")], dim=1), counts, 4)
    assert torch.equal(wide[:, :40], chosen) and not wide[:, 40:].any()
    for row in (0, 99, 255):
        assert torch.equal(select_top_blocks(scores[row : row + 1], counts[row : row + 1], 4)[0], chosen[row])


# ---- the other discrete choices --------------------------------------------------------------


def test_moe_routing_ties_are_per_token():
    """Expert top-k runs over each token's own `num_experts` probabilities: a token's experts do
    not change with the tokens beside it, ties included (identical router logits everywhere)."""
    from lamina.layers.moe import SparseMoE
    from lamina.parallel.context import ParallelContext

    moe = SparseMoE(
        hidden_size=8, num_experts=8, top_k=2, moe_intermediate_size=4, shared_expert_intermediate_size=0,
        norm_topk_prob=True, ctx=ParallelContext.single(), dtype=torch.float32,
    )
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[:4] = 1.0  # experts 0-3 tie for every input with a positive sum
    x = torch.rand(9, 8)
    weights, ids = moe.route(x)
    for row in range(9):
        w1, i1 = moe.route(x[row : row + 1])
        assert torch.equal(i1[0], ids[row]) and torch.equal(w1[0], weights[row])


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_greedy_and_seeded_outputs_do_not_depend_on_the_batch(family, qwen3_next_dir, qwen3_5_moe_dir):
    """MoE routing, greedy argmax and seeded sampling: alone, batched, chunked."""
    path = {"qwen3_next": qwen3_next_dir, "qwen3_5_moe": qwen3_5_moe_dir}[family]
    prompts = _prompts(12, [3, 17, 30])
    for params in (PARAMS, SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=8, logprobs=0)):
        runs = {
            "alone": _generate(path, prompts, params, max_num_seqs=1),
            "batch": _generate(path, prompts, params, max_num_seqs=3),
            "chunk7": _generate(path, prompts, params, max_num_seqs=3, max_num_batched_tokens=7),
        }
        _assert_same(runs, prompts)

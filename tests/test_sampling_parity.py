"""Sampling parity with vLLM (issue 13): penalties, logit_bias, allowed_token_ids, bad_words in the
sampler (batched, per row, batch independent), and n / best_of through the engine."""

import math

import pytest
import torch

from lamina.worker.logits_processors import bad_word_bans
from lamina.worker.sampler import Sampler, SamplingBatch
from lamina.sampling_params import SamplingParams

V = 32
EOS = [1]


def build(params, outputs=None, prompts=None):
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return SamplingBatch.build(params, [len(o) for o in outputs], EOS, "cpu", V,
                               output_token_ids=outputs, prompt_token_ids=prompts)


def adjusted(logits, params, outputs=None, prompts=None):
    """The logits the sampler draws from (after bans and adjustments), via greedy argmax checks."""
    batch = build(params, outputs, prompts)
    work = logits.clone()
    from lamina.worker.sampler import apply_bans_and_adjustments

    return apply_bans_and_adjustments(work, batch)


def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's penalties written out per token (the oracle)."""
    out = logits.clone()
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    for tok in set(output):
        out[tok] -= frequency * output.count(tok) + presence
    return out


def test_penalties_match_reference_per_row():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3),
        SamplingParams(),  # untouched row in the same batch
        SamplingParams(frequency_penalty=-1.0),
    ]
    outputs = [[3, 3, 5, 7], [3, 4], [9, 9, 9]]
    prompts = [[5, 11, 12], None, None]
    got = adjusted(logits, params, outputs, prompts)
    torch.testing.assert_close(got[0], reference_penalties(logits[0], [5, 11, 12], outputs[0], 0.5, 0.25, 1.3))
    torch.testing.assert_close(got[1], logits[1])
    torch.testing.assert_close(got[2], reference_penalties(logits[2], [], outputs[2], 0.0, -1.0, 1.0))


def test_logit_bias_and_allowed_tokens():
    logits = torch.zeros(3, V)
    params = [SamplingParams(logit_bias={4: 5.0, 6: -100.0}), SamplingParams(allowed_token_ids=[2, 8]),
              SamplingParams(allowed_token_ids=[9, 10], logit_bias={10: 1.0})]
    got = adjusted(logits, params)
    assert got[0, 4] == 5.0 and got[0, 6] == -100.0 and got[0, 5] == 0.0
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [2, 8]
    assert torch.isfinite(got[2]).nonzero().flatten().tolist() == [9, 10] and got[2, 10] == 1.0
    # random sampling only ever draws allowed tokens
    out = Sampler()(torch.randn(3, V), build([SamplingParams(temperature=1.0, allowed_token_ids=[3, 17])] * 3))
    assert set(out.token_ids.tolist()) <= {3, 17}


def test_bad_words_ban_last_token_after_prefix():
    assert bad_word_bans([[5]], []) == [5]
    assert bad_word_bans([[4, 5]], [1, 4]) == [5]
    assert bad_word_bans([[4, 5]], [4, 1]) == []
    assert bad_word_bans([[3, 4, 5]], [4]) == []
    p = SamplingParams(temperature=0.0)
    p.bad_words_token_ids = [[4, 5], [7]]
    logits = torch.zeros(2, V)
    logits[:, 5] = logits[:, 7] = 10.0
    out = Sampler()(logits, build([p, p], outputs=[[4], [6]]))
    # row 0 just generated 4: 5 is banned, and 7 always; row 1: only 7
    assert out.token_ids.tolist() == [0, 5]


def test_min_tokens_bans_and_bias_compose():
    logits = torch.zeros(1, V)
    out = Sampler()(logits, build([SamplingParams(temperature=0, min_tokens=2, logit_bias={1: 50.0})],
                                  outputs=[[3]]))
    assert out.token_ids.item() != 1  # EOS stays banned before min_tokens despite its bias


def test_seeded_penalised_row_is_batch_independent():
    """A seeded request with penalties draws the same tokens alone or among other rows."""
    torch.manual_seed(1)
    steps = [torch.randn(V) for _ in range(6)]
    params = SamplingParams(temperature=1.0, seed=7, presence_penalty=1.0, repetition_penalty=1.2,
                            logit_bias={3: 2.0})

    def run(batch_rows, row):
        out_tokens = []
        for step in range(6):
            logits = torch.randn(batch_rows, V)
            logits[row] = steps[step]
            ps = [SamplingParams(temperature=0.7, frequency_penalty=0.5)] * batch_rows
            ps[row] = params
            outs = [[1, 2]] * batch_rows
            outs[row] = list(out_tokens)
            prompts = [[4]] * batch_rows
            batch = SamplingBatch.build(ps, [len(o) for o in outs], EOS, "cpu", V,
                                        output_token_ids=outs, prompt_token_ids=prompts)
            out_tokens.append(Sampler()(logits, batch).token_ids[row].item())
        return out_tokens

    alone = run(1, 0)
    assert run(4, 2) == alone
    assert run(3, 0) == alone


def test_missing_history_is_an_error():
    with pytest.raises(ValueError, match="penalties but no output token ids"):
        SamplingBatch.build([SamplingParams(presence_penalty=1.0)], [0], EOS, "cpu", V)


# ---- engine: n / best_of, bad words, refusals ------------------------------------------------
@pytest.fixture(scope="module")
def llm(qwen3_next_dir):
    from lamina import LLM

    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=128, show_progress=False) as llm:
        yield llm


PROMPT = {"prompt_token_ids": list(range(3, 15))}


def test_n_returns_n_seeded_children(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=5)
    [out] = llm.generate(PROMPT, params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in out.outputs)
    # child i is the request with seed + i, alone
    for i, c in enumerate(out.outputs):
        [single] = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=5))
        assert single.outputs[0].token_ids == c.token_ids
    # and the same with other requests in the batch
    outs = llm.generate([PROMPT, {"prompt_token_ids": [5, 6, 7]}], [params, SamplingParams(temperature=0.8, max_tokens=9)])
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in out.outputs]


def test_best_of_keeps_highest_cumulative_logprob(llm):
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=4)
    [out] = llm.generate(PROMPT, params)
    assert len(out.outputs) == 2 and [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].logprobs is None  # not asked for
    cands = [llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3 + i, max_tokens=4, logprobs=0))[0].outputs[0]
             for i in range(4)]
    best = sorted(cands, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert out.outputs[0].cumulative_logprob == pytest.approx(best[0].cumulative_logprob)


def test_greedy_n_children_identical_and_penalties_change_output(llm):
    [out] = llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=6))
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    plain = out.outputs[0].token_ids
    [biased] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logit_bias={plain[0]: -100.0}))
    assert biased.outputs[0].token_ids[0] != plain[0]
    banned = set(plain)  # -inf bans, as vLLM's offline logit_bias (sampled: the race must not see a NaN)
    [out] = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=2,
                                                logit_bias={t: float("-inf") for t in banned}))
    assert not banned & set(out.outputs[0].token_ids)
    assert all(math.isfinite(lp.logprob) for entry in out.outputs[0].logprobs for lp in entry.values())
    [rep] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, logit_bias={9: 30.0},
                                                 frequency_penalty=2.0, repetition_penalty=2.0))
    tokens = rep.outputs[0].token_ids
    assert tokens[0] == 9 and tokens.count(9) < len(tokens)  # the penalty eventually beats the bias


def test_allowed_token_ids_and_out_of_vocab(llm):
    [out] = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=0, max_tokens=8, allowed_token_ids=[20, 21]))
    assert set(out.outputs[0].token_ids) <= {20, 21}
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=r"logit_bias token ids \[%d\] are outside the vocabulary" % vocab):
        llm.generate(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[vocab + 5]))


def test_bad_words_are_never_generated(llm):
    tok = llm.get_tokenizer()
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))
    first = out.outputs[0].token_ids
    word = tok.decode(first[:2])
    [banned] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, bad_words=[word]))
    ids = banned.outputs[0].token_ids
    seqs = llm.engine._bad_words_token_ids([word])
    for seq in seqs:
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids)))
    if first[:2] in seqs:
        assert ids[:2] != first[:2]


def test_options_that_read_tokens_run_with_speculative_decoding(qwen3_next_dir, tmp_path):
    """Penalties, bad words and structured output are taken under MTP (no longer refused) and give
    plain decoding's greedy text (tests/test_mtp.py checks them inside accepted drafts); n works."""
    import shutil

    from lamina import LLM
    from tests import tiny_checkpoints as tc

    path = tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, tmp_path / "ckpt"))
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=64, show_progress=False,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as spec_llm, \
            LLM(str(path), device="cpu", dtype="float32", max_model_len=64, show_progress=False) as plain_llm:
        params = [SamplingParams(temperature=0, max_tokens=6, **{field: value}) for field, value in [
            ("presence_penalty", 0.5), ("repetition_penalty", 1.2), ("bad_words", ["x"]),
            ("structured_outputs", {"regex": "a+"})]]
        outs = [o.outputs[0].token_ids for o in spec_llm.generate([PROMPT] * 4, params)]
        assert outs == [o.outputs[0].token_ids for o in plain_llm.generate([PROMPT] * 4, params)]
        [out] = spec_llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=4))  # n works with MTP
        assert len(out.outputs) == 2 and out.outputs[0].token_ids == out.outputs[1].token_ids

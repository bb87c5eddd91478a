"""Prompt logprobs (issue 13): SamplingParams(prompt_logprobs=k) equals the model's teacher-forced
logprobs, and transformers' on a tiny checkpoint, whole-prompt and under chunked prefill."""

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.worker import prompt_logprobs as plp
from tests.reference import lamina_logits, load_reference, reference_logits

PROMPT = [3, 17, 29, 4, 100, 7, 7, 250, 31, 8, 64, 12, 5, 9, 2, 77, 41, 19, 6, 33]


def check(out, expected_lp: torch.Tensor, k: int, prompt=PROMPT, atol=2e-5):
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        entry = entries[i]
        row = expected_lp[i - 1]
        assert entry[prompt[i]] == pytest.approx(row[prompt[i]].item(), abs=atol)
        top = row.topk(k).indices.tolist() if k else []
        assert set(top) <= set(entry) and len(entry) in (k, k + 1)
        for t in top:
            assert entry[t] == pytest.approx(row[t].item(), abs=atol)
        # the prompt token's rank: 1 + the tokens likelier than it (a tie within atol may go either way)
        target = row[prompt[i]]
        assert int((row > target + atol).sum()) + 1 <= out.prompt_logprob_ranks[i] <= int((row > target - atol).sum()) + 1
    assert out.prompt_logprob_ranks[0] is None


@pytest.fixture(scope="module")
def hf_logprobs(qwen3_next_dir):
    return torch.log_softmax(reference_logits(load_reference(qwen3_next_dir), PROMPT), -1)


@pytest.mark.parametrize("budget", [None, 7, 3])
def test_prompt_logprobs_match_teacher_forcing_and_transformers(qwen3_next_dir, hf_logprobs, budget, monkeypatch):
    monkeypatch.setattr(plp, "PROMPT_LOGPROBS_ROWS", 4)  # several logits pieces per chunk
    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=128, show_progress=False,
             max_num_batched_tokens=budget) as llm:
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
        other = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}
        outs = llm.generate([{"prompt_token_ids": PROMPT}, other], [params, SamplingParams(max_tokens=3)])
        assert outs[1].prompt_logprobs is None
        own = torch.log_softmax(lamina_logits(llm, PROMPT), -1)
        check(outs[0], own, 3, atol=2e-6)
        check(outs[0], hf_logprobs, 3)
        [zero] = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0))
        assert all(list(e) == [PROMPT[i + 1]] for i, e in enumerate(zero.prompt_logprobs[1:]))


def test_prompt_positions_of_chunks():
    from lamina.step_plan import ScheduledChunk

    def chunk(start, tokens, nxt, num_prompt):
        return ScheduledChunk("r", tokens, start, [], 0, nxt is None, SamplingParams(prompt_logprobs=1), 0,
                              next_token_id=nxt, num_prompt_tokens=num_prompt)

    assert plp.prompt_positions(chunk(0, [1, 2, 3], 4, 6)) == (3, [2, 3, 4])
    assert plp.prompt_positions(chunk(3, [4, 5, 6], None, 6)) == (2, [5, 6])  # last prompt position predicts output
    assert plp.prompt_positions(chunk(6, [9], None, 6)) == (0, [])  # a decode step
    assert plp.prompt_positions(chunk(0, [1], None, 1)) == (0, [])  # a one-token prompt


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_prompt_logprobs_under_parallel_layouts(qwen3_next_dir, hf_logprobs, layout):
    """Rank processes on gloo: the last stage's TP ranks score the same pieces (compute_logits is a
    collective there), and the reporting rank returns them; chunked prefill too."""
    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=128, show_progress=False,
             max_num_batched_tokens=6, debug_layouts=True, **layout) as llm:
        [out] = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=2,
                                                                          prompt_logprobs=2))
    check(out, hf_logprobs, 2)


def test_whole_vocabulary_and_the_max_logprobs_limit(qwen3_next_dir, hf_logprobs, monkeypatch):
    """vLLM's -1 for logprobs / prompt_logprobs: every token's logprob, at each prompt position (as
    transformers computes) and each sampled one, beside a request asking 2 in the same steps (chunked
    prefill, several logits pieces). The engine's max_logprobs (vLLM's default 20; -1: no limit)
    refuses more, naming it, before anything runs."""
    monkeypatch.setattr(plp, "PROMPT_LOGPROBS_ROWS", 4)
    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=128, show_progress=False) as llm:
        for params in (SamplingParams(logprobs=21), SamplingParams(logprobs=-1), SamplingParams(prompt_logprobs=-1)):
            with pytest.raises(ValueError, match="more than max_logprobs = 20 allows"):
                llm.generate({"prompt_token_ids": PROMPT}, params)
    with pytest.raises(ValueError, match="max_logprobs must be an int >= 0, or -1"):
        LLM(str(qwen3_next_dir), device="cpu", max_logprobs=-2)
    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=128, show_progress=False,
             max_num_batched_tokens=7, max_logprobs=-1) as llm:
        vocab = llm.engine.model_config.vocab_size
        whole = SamplingParams(temperature=0, max_tokens=3, logprobs=-1, prompt_logprobs=-1)
        other_prompt = [5, 6, 7, 8, 9, 10, 11]
        outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": other_prompt}],
                            [whole, SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=2)])
        check(outs[0], hf_logprobs, vocab)
        assert all(len(e) == vocab for e in outs[0].prompt_logprobs[1:])
        assert all(len(e) in (2, 3) for e in outs[1].prompt_logprobs[1:])
        assert all(len(e) in (2, 3) for e in outs[1].outputs[0].logprobs)
        completion = outs[0].outputs[0]
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert len(entry) == vocab
            assert sorted(lp.rank for lp in entry.values()) == list(range(1, vocab + 1))
            assert entry[token].rank == 1  # greedy
            assert sum(torch.tensor([float(v) for v in entry.values()], dtype=torch.float64).exp()) == \
                pytest.approx(1.0, abs=1e-5)

"""The server side of issue 13's sampling items, through the `openai` client: lm-evaluation-harness's
loglikelihood request shapes (echo + logprobs, max_tokens 0 and 1, token-id prompts) checked against
transformers' teacher-forced logprobs; n choices (streaming too); logit_bias, penalties, bad words."""

from __future__ import annotations

import openai
import pytest
import torch

from lamina import LLM
from tests.reference import load_reference, reference_logits
from tests.server_harness import MODEL_NAME, RunningServer

CONTEXT = [11, 25, 3, 99, 140, 7, 62]
CONTINUATION = [18, 200, 5]


@pytest.fixture(scope="module")
def server(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=128, show_progress=False,
             max_logprobs=-1) as llm, RunningServer(llm.engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf_logprobs(qwen3_next_dir):
    return torch.log_softmax(reference_logits(load_reference(qwen3_next_dir), CONTEXT + CONTINUATION), -1)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_shape(client, hf_logprobs, max_tokens):
    """lm-eval's local-completions loglikelihood: a batch of token-id prompts, echo, logprobs=1,
    temperature 0; it sums token_logprobs[ctxlen:-1] and checks greediness against top_logprobs."""
    seq = CONTEXT + CONTINUATION
    out = client.completions.create(model=MODEL_NAME, prompt=[seq, seq[:5]], max_tokens=max_tokens, echo=True,
                                    logprobs=1, temperature=0, seed=1234)
    assert [c.index for c in out.choices] == [0, 1]
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(seq) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(seq)):
        assert lp.token_logprobs[i] == pytest.approx(hf_logprobs[i - 1, seq[i]].item(), abs=1e-4)
        top = lp.top_logprobs[i]  # the prompt's token first, and the likeliest (one entry when they are one)
        assert next(iter(top)) == lp.tokens[i] and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(hf_logprobs[i - 1].max().item(), abs=1e-4)
    ctxlen = len(CONTEXT)
    end = len(seq)
    total = sum(lp.token_logprobs[ctxlen:end])
    expected = sum(hf_logprobs[i - 1, seq[i]].item() for i in range(ctxlen, end))
    assert total == pytest.approx(expected, abs=1e-3)
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    if max_tokens == 0:
        assert out.usage.completion_tokens == 0 and out.choices[0].finish_reason == "length"
        assert out.choices[0].text == client.completions.create(
            model=MODEL_NAME, prompt=seq, max_tokens=1, echo=True).choices[0].text[: len(out.choices[0].text)]
    assert len(out.choices[1].logprobs.tokens) == 5 + max_tokens


def test_echo_logprobs_streamed(client, hf_logprobs):
    seq = CONTEXT + CONTINUATION
    tokens, logprobs = [], []
    for event in client.completions.create(model=MODEL_NAME, prompt=seq, max_tokens=2, echo=True, logprobs=2,
                                           temperature=0, stream=True):
        for choice in event.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
    assert len(tokens) == len(seq) + 2 and logprobs[0] is None
    assert logprobs[3] == pytest.approx(hf_logprobs[2, seq[3]].item(), abs=1e-4)


def test_n_choices_streaming_and_not(client):
    kw = dict(model=MODEL_NAME, prompt=["One", "Two"], max_tokens=4, n=3, temperature=1.0, seed=5)
    out = client.completions.create(**kw)
    assert [c.index for c in out.choices] == list(range(6))
    assert out.usage.completion_tokens == sum(1 for _ in range(6)) * 4
    streamed: dict[int, str] = {}
    finished = set()
    for event in client.completions.create(**kw, stream=True):
        for choice in event.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finished
                finished.add(choice.index)
    assert finished == set(range(6))
    assert [streamed[i] for i in range(6)] == [c.text for c in out.choices]

    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=msgs, n=2, max_tokens=3, temperature=1.0, seed=9)
    assert [c.index for c in chat.choices] == [0, 1]
    deltas: dict[int, str] = {}
    for event in client.chat.completions.create(model=MODEL_NAME, messages=msgs, n=2, max_tokens=3, temperature=1.0,
                                                seed=9, stream=True):
        for choice in event.choices:
            deltas[choice.index] = deltas.get(choice.index, "") + (choice.delta.content or "")
    assert [deltas[i] for i in range(2)] == [c.message.content for c in chat.choices]


def test_best_of(client):
    out = client.completions.create(model=MODEL_NAME, prompt="One", max_tokens=3, n=2, best_of=4, temperature=1.0,
                                    seed=2, logprobs=0)
    assert [c.index for c in out.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert sums[0] >= sums[1]


def test_logit_bias_penalties_and_allowed_tokens(client):
    forced = client.completions.create(model=MODEL_NAME, prompt=[5, 6], max_tokens=4, temperature=0,
                                       logit_bias={"42": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [client_token(client, 42)] * 4
    penalised = client.completions.create(model=MODEL_NAME, prompt=[5, 6], max_tokens=6, temperature=0,
                                          logit_bias={"42": 20}, frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 2.0})
    assert penalised.usage.completion_tokens == 6
    allowed = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                             max_tokens=5, temperature=1.0, seed=3,
                                             extra_body={"allowed_token_ids": [42, 43], "ignore_eos": True},
                                             logprobs=True)
    assert {e.token for e in allowed.choices[0].logprobs.content} <= {client_token(client, 42),
                                                                      client_token(client, 43)}
    banned = client.completions.create(model=MODEL_NAME, prompt=[5, 6], max_tokens=4, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"bad_words": [client_token(client, 42)]},
                                       logprobs=0)
    assert client_token(client, 42) not in banned.choices[0].logprobs.tokens


def client_token(client, token_id: int) -> str:
    """The text the server writes for a token (one-token echo of it)."""
    out = client.completions.create(model=MODEL_NAME, prompt=[token_id], max_tokens=0, echo=True, logprobs=0)
    return out.choices[0].logprobs.tokens[0]


def test_echo_logprobs_with_n_two(client, hf_logprobs):
    seq = CONTEXT + CONTINUATION
    out = client.completions.create(model=MODEL_NAME, prompt=seq, max_tokens=2, echo=True, logprobs=1, n=2,
                                    temperature=1.0, seed=3)
    streamed: dict[int, list] = {}
    for event in client.completions.create(model=MODEL_NAME, prompt=seq, max_tokens=2, echo=True, logprobs=1, n=2,
                                           temperature=1.0, seed=3, stream=True):
        for choice in event.choices:
            streamed.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs if choice.logprobs else [])
    for choice in out.choices:
        lp = choice.logprobs.token_logprobs
        assert len(lp) == len(seq) + 2 and lp[0] is None
        assert lp[5] == pytest.approx(hf_logprobs[4, seq[5]].item(), abs=1e-4)
        assert streamed[choice.index][0] is None and streamed[choice.index][1:] == pytest.approx(lp[1:], abs=1e-6)


def test_whole_vocabulary_logprobs(client, hf_logprobs):
    """With max_logprobs=-1 (`--max-logprobs -1`), vLLM's -1: chat's top_logprobs and prompt_logprobs
    return every token of the vocabulary, the prompt's as transformers computes them."""
    seq = CONTEXT + CONTINUATION
    vocab = hf_logprobs.shape[1]
    out = client.completions.create(model=MODEL_NAME, prompt=seq, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": -1})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(seq)
    for i, entry in enumerate(entries[1:], start=1):
        assert len(entry) == vocab
        ranks = [e["rank"] for e in entry.values()]
        assert min(ranks) == 1 and max(ranks) <= vocab  # 1 + the tokens likelier: ties share a rank
        best = max(entry, key=lambda t: entry[t]["logprob"])
        assert int(best) == int(hf_logprobs[i - 1].argmax())
        assert entry[str(seq[i])]["logprob"] == pytest.approx(hf_logprobs[i - 1, seq[i]].item(), abs=1e-4)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, temperature=0, logprobs=True, top_logprobs=-1)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2
    for item in content:
        assert len(item.top_logprobs) == vocab
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy: the token is the likeliest
    legacy = client.completions.create(model=MODEL_NAME, prompt=seq, max_tokens=2, temperature=0, logprobs=-1,
                                       extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert [len(top) for top in legacy.top_logprobs] == [vocab, vocab]  # completions' -1 too, as vLLM's

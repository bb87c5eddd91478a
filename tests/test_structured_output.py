"""Structured output (issue 13): grammars from xgrammar enforced through batched token bitmasks in
the sampler; the engine API; and `lamina serve` answering 50 json_schema requests at concurrency 16
with output that validates against the schema."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.worker.sampler import apply_token_bitmask
from lamina.structured_output import StructuredOutputsParams, bitmask_words

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "count", "color", "tags"],
    "additionalProperties": False,
}


def validate(obj) -> None:
    """SCHEMA's rules, checked by hand (jsonschema is not a dependency)."""
    assert isinstance(obj, dict) and set(obj) == set(SCHEMA["required"]), obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert isinstance(obj["ok"], bool)
    assert isinstance(obj["count"], int) and not isinstance(obj["count"], bool) and 0 <= obj["count"] <= 999
    assert obj["color"] in ("red", "green", "blue")
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and all(t in ("a", "b") for t in obj["tags"])


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar, structural_tag; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{oops")
    with pytest.raises(ValueError, match="choice must be a list of non-empty strings"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="unknown keys \\['jsn'\\]"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams(structured_outputs={"json": '{"type": "object"}'}).structured_outputs.json == {"type": "object"}


def test_vllm_spellings_and_options():
    """vLLM's GuidedDecodingParams / SamplingParams(guided_decoding=...) (its name before 0.11) are
    structured_outputs; its backend options: xgrammar only, the other backends' options refused;
    extra_args kept."""
    from lamina.sampling_params import GuidedDecodingParams

    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"], backend="xgrammar"))
    assert params.structured_outputs.choice == ["a", "b"] and params.guided_decoding is None
    assert SamplingParams(guided_decoding={"regex": "x+"}).structured_outputs.regex == "x+"
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(guided_decoding={"regex": "x"}, structured_outputs={"regex": "y"})
    with pytest.raises(ValueError, match="valid: auto, xgrammar"):
        StructuredOutputsParams(regex="x", backend="outlines")
    with pytest.raises(ValueError, match="belong to other backends"):
        StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=r"\s?")
    assert SamplingParams(extra_args={"k": 1}).extra_args == {"k": 1}
    compact = StructuredOutputsParams(json={"type": "object"})
    spaced = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=False)
    assert compact.key() != spaced.key() and compact.key() == StructuredOutputsParams(
        json={"type": "object"}, disable_any_whitespace=True).key()


def test_apply_token_bitmask_matches_explicit_mask():
    vocab = 70
    allowed = [[0, 5, 31, 32, 69], [33], list(range(vocab))]
    masks = np.zeros((3, bitmask_words(vocab)), dtype=np.int64)
    for r, toks in enumerate(allowed):
        for t in toks:
            masks[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.from_numpy(masks.astype(np.uint32).view(np.int32))  # bit 31 makes a word negative
    logits = torch.randn(4, vocab)
    out = apply_token_bitmask(logits.clone(), torch.tensor([0, 2, 3]), bitmask)
    assert torch.equal(out[1], logits[1])  # a row without a mask is untouched
    for row, toks in zip([0, 2, 3], allowed):
        finite = torch.isfinite(out[row]).nonzero().flatten().tolist()
        assert finite == toks
        assert torch.equal(out[row, toks], logits[row, toks])


@pytest.fixture(scope="module")
def llm(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=256, show_progress=False) as llm:
        yield llm


def test_engine_json_schema_regex_choice(llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=150, structured_outputs={"json": SCHEMA})
              for s in range(2)]
    params.append(SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=150, structured_outputs={"json": SCHEMA}))
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=20, structured_outputs={"regex": r"[a-c]{3}-\d\d"}))
    params.append(SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"choice": ["yes", "no way"]}))
    params.append(SamplingParams(temperature=1.0, seed=4, max_tokens=30))  # unconstrained, same batch
    outs = llm.generate(["Hi"] * len(params), params)
    for out in outs[:3]:  # n > 1 too: every child follows the grammar
        for completion in out.outputs:
            validate(json.loads(completion.text))
            assert completion.finish_reason == "stop"
    assert len(outs[2].outputs) == 3
    assert re.fullmatch(r"[a-c]{3}-\d\d", outs[3].outputs[0].text)
    assert outs[4].outputs[0].text in ("yes", "no way")


def test_grammar_wins_over_min_tokens_bans(llm):
    """The grammar's one way on (`{`) is also a stop token id held back by min_tokens: the row would
    have nothing to sample (it used to emit token 0, outside the grammar); the grammar wins."""
    brace = llm.get_tokenizer().convert_tokens_to_ids("{")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=3, stop_token_ids=[brace],
                            structured_outputs={"json": schema})
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == brace and 0 not in out.token_ids[:3]
    assert out.text.startswith("{")


def test_any_whitespace_json_when_asked(llm):
    """disable_any_whitespace=False (vLLM's option) lets the JSON grammar take whitespace between
    tokens; lamina's default keeps it compact: after `{`, only the spaced grammar's mask allows a
    space."""
    manager, tokenizer = llm.engine.structured, llm.get_tokenizer()
    space = tokenizer.encode(" ", add_special_tokens=False)
    brace = tokenizer.encode("{", add_special_tokens=False)
    assert len(space) == 1 and len(brace) == 1
    allowed = {}
    for name, spec in (("compact", StructuredOutputsParams(json_object=True)),
                       ("spaced", StructuredOutputsParams(json_object=True, disable_any_whitespace=False))):
        manager.add(name, spec)
        try:
            assert manager.accept(name, brace[0])
            words = manager.bitmask(name)
            allowed[name] = bool((int(words[space[0] // 32]) >> (space[0] % 32)) & 1)
        finally:
            manager.remove(name)
    assert allowed == {"compact": False, "spaced": True}


def test_engine_rejects_grammar_that_does_not_compile(llm):
    with pytest.raises(ValueError, match="structured_outputs regex could not be compiled"):
        llm.generate("Hi", SamplingParams(structured_outputs={"regex": "(unclosed"}))
    with pytest.raises(ValueError, match="structured_outputs json could not be compiled"):
        llm.generate("Hi", SamplingParams(structured_outputs={"json": {"type": "no-such-type"}}))


# ---- `lamina serve` ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(qwen3_next_dir):
    """`lamina serve` in its own process on the tiny checkpoint (it carries the default model's
    tokenizer, a real byte-level BPE)."""
    from tests.test_server_cli import _start, _stop

    proc, url = _start(qwen3_next_dir, "--dtype", "float32", "--max-num-seqs", "16")
    try:
        yield url
    finally:
        _stop(proc)


def test_serve_json_schema_50_requests_at_concurrency_16(served):
    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=300)
        gate = asyncio.Semaphore(16)
        fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}

        async def one(i: int):
            async with gate:
                if i % 5 == 4:  # some streamed
                    text = ""
                    stream = await client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": f"record {i}"}], max_tokens=160,
                        temperature=1.0, seed=i, response_format=fmt, stream=True)
                    async for event in stream:
                        if event.choices:
                            text += event.choices[0].delta.content or ""
                    return text
                out = await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"record {i}"}], max_tokens=160,
                    temperature=1.0, seed=i, response_format=fmt)
                assert out.choices[0].finish_reason == "stop"
                return out.choices[0].message.content

        texts = await asyncio.gather(*(one(i) for i in range(50)))
        await client.close()
        return texts

    texts = asyncio.run(main())
    for text in texts:
        validate(json.loads(text))
    assert len(set(texts)) > 1


def test_serve_other_constraints(served, qwen3_next_dir):
    import httpx
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_next_dir)
    closers = {str(tok.convert_tokens_to_ids(t)): 4.0 for t in ('"', "}")}  # so that a random model finishes

    def post(path, **body):
        r = httpx.post(f"{served}/v1/{path}", json={"model": "tiny", "max_tokens": 40, "temperature": 1.0, **body},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"]

    [c] = post("completions", prompt="x", structured_outputs={"regex": r"[xyz]{4}"})
    assert re.fullmatch(r"[xyz]{4}", c["text"])
    [c] = post("completions", prompt="x", guided_choice=["alpha", "beta"])
    assert c["text"] in ("alpha", "beta")
    [c] = post("chat/completions", messages=[{"role": "user", "content": "x"}], max_tokens=200,
               response_format={"type": "json_object"}, logit_bias=closers)
    assert c["finish_reason"] == "stop" and isinstance(json.loads(c["message"]["content"]), dict)
    choices = post("completions", prompt="x", n=2, guided_json=SCHEMA, max_tokens=150)
    for c in choices:
        validate(json.loads(c["text"]))


def test_bitmasks_along_drafts_equal_the_masks_of_accepted_tokens(llm):
    """Speculative decoding's masks: position j's is the mask after really accepting drafts[:j];
    the matcher ends where it started; past a draft the grammar rejects the last mask repeats; a
    grammar waiting for its start token starts at that draft."""
    manager = llm.engine.structured
    tok = llm.get_tokenizer()
    spec = StructuredOutputsParams(regex=r"ab{2,5}c")
    ids = [tok.convert_tokens_to_ids(t) for t in ("a", "b", "b", "c")]
    manager.add("r", spec)
    masks = manager.bitmasks_along("r", ids)
    assert len(masks) == 5
    assert np.array_equal(manager.bitmask("r"), masks[0])  # rolled back: the start again
    manager.add("s", spec)
    for j, token in enumerate(ids):
        assert np.array_equal(manager.bitmask("s"), masks[j]), j
        assert manager.accept("s", token)
    final = manager.bitmask("s")
    assert (final is None and masks[4] is None) or np.array_equal(final, masks[4])
    bad = manager.bitmasks_along("r", [ids[0], ids[3], ids[1]])  # "ac": c is not allowed after a
    assert np.array_equal(bad[1], masks[1]) and np.array_equal(bad[2], bad[1]) and np.array_equal(bad[3], bad[1])
    assert np.array_equal(manager.bitmask("r"), masks[0])
    waiting = StructuredOutputsParams(regex=r"ab{2,5}c", enforce_after_token_id=ids[3])
    manager.add("w", waiting)
    started = manager.bitmasks_along("w", [ids[1], ids[3], ids[0], ids[1]])
    assert started[0] is None and started[1] is None  # not started before its token, nor at it
    assert np.array_equal(started[2], masks[0]) and np.array_equal(started[3], masks[1])
    assert manager.bitmask("w") is None and manager._matchers["w"][2] == ids[3]  # still waiting
    for request_id in "rsw":
        manager.remove(request_id)


def test_grammar_masks_reach_the_sampling_rank_under_tp2(qwen3_next_dir):
    """The bitmask travels in the plan to rank processes (gloo); the reporting rank applies it."""
    with LLM(str(qwen3_next_dir), device="cpu", dtype="float32", max_model_len=128, show_progress=False,
             tensor_parallel_size=2) as llm:
        outs = llm.generate(["a", "b"], [
            SamplingParams(temperature=1.0, seed=2, max_tokens=12, structured_outputs={"regex": r"[pq]{3}\d"}),
            SamplingParams(temperature=1.0, seed=3, max_tokens=12, logit_bias={7: 5.0}, presence_penalty=1.0),
        ])
    assert re.fullmatch(r"[pq]{3}\d", outs[0].outputs[0].text)
    assert len(outs[1].outputs[0].token_ids) >= 1

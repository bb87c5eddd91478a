"""vLLM's tokenizer routes (`/tokenize`, `/detokenize`, `/tokenizer_info`), `/v1/models`, the routes lamina
does not serve, and the requests lm-evaluation-harness's `local-completions` sends that need no prompt
logprobs (its remote-tokenizer handshake and generate_until with token-id prompts)."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest

from lamina import LLM, SamplingParams
from lamina.engine.setup import TOKENIZER_FILES
from tests.server_harness import MODEL_NAME, RunningServer

MAX_MODEL_LEN = 256
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the river."}]


def _llm(path, **kw):
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, show_progress=False, **kw)


@pytest.fixture(scope="module")
def llm(qwen3_next_dir):
    with _llm(qwen3_next_dir) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with RunningServer(llm.engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def test_tokenize_prompt(http, tok):
    text = "The baker opened the shutters <|im_end|>"
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tok.encode(text, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] is None
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text, "add_special_tokens": False,
                                     "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tok.encode(text, add_special_tokens=False)
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert http.post("/tokenize", json={"prompt": ""}).json()["count"] == 0


def test_tokenize_chat_matches_the_chat_endpoint(http, server, tok):
    expected = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    body = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert body["tokens"] == expected
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
        usage = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    no_prompt = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < body["count"] and body["tokens"][: no_prompt["count"]] == no_prompt["tokens"]
    cont = http.post("/tokenize", json={"messages": MESSAGES + [{"role": "assistant", "content": "The river"}],
                                        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert tok.decode(cont["tokens"]).endswith("The river")


def test_detokenize_round_trip(http, tok):
    text = "river baker <|im_end|> bread"
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert r.json()["prompt"] == text
    assert http.post("/detokenize", json={"tokens": [], "model": MODEL_NAME}).json() == {"prompt": ""}


def test_tokenizer_info_has_what_lm_eval_reads(http, tok):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["pad_token"] == tok.pad_token
    assert "bos_token" in info and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and info["tokenizer_class"] == type(tok).__name__
    assert info["model_max_length"] == tok.model_max_length


def test_tokenizer_info_reports_the_served_chat_template(qwen3_next_dir, tok):
    """With --chat-template, /tokenizer_info gives that template (the one /v1/chat/completions and
    /tokenize apply), not the tokenizer's: lm-eval's remote tokenizer renders chats with it."""
    from lamina.entrypoints.openai.chat_tools import ChatOptions

    override = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert override != tok.chat_template
    with _llm(qwen3_next_dir) as llm, RunningServer(llm.engine, chat=ChatOptions(chat_template=override)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/tokenizer_info").json()["chat_template"] == override
        ids = c.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert tok.decode(ids) == "[system]Be brief.[user]Tell me about the river.[assistant]"


def test_lm_eval_remote_tokenizer_handshake_and_generate_until(server, http, llm, qwen3_next_dir):
    """What lm-eval 0.4.13's local-completions does with its default tokenizer backend ("auto"): GET
    /tokenizer_info (must hold `eos_token`), POST /tokenize {"prompt": "test", "add_special_tokens": false}
    (must answer a token list); then it takes the EOS id from /tokenize of eos_token, encodes contexts
    there, sends generate_until requests with token-id prompts and decodes with /detokenize."""
    base = server.url  # lm-eval strips /v1/completions from its base_url and calls the root
    info = http.get(f"{base}/tokenizer_info").json()
    assert "eos_token" in info
    probe = http.post(f"{base}/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert isinstance(probe["tokens"], list) and probe["tokens"]
    eos_id = http.post(f"{base}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}) \
        .json()["tokens"][0]
    assert eos_id in llm.engine.eos_token_ids
    contexts = ["Question: where does the river go?\nAnswer:", "The baker opened the shutters and"]
    ids = [http.post(f"{base}/tokenize", json={"prompt": c, "add_special_tokens": False}).json()["tokens"]
           for c in contexts]
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as client:
        out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0, seed=1234,
                                        stop=[info["eos_token"], "\n\n"])
    # the offline reference on an engine of its own: the server's engine thread steps the shared one
    with _llm(qwen3_next_dir) as offline:
        expected = offline.generate([{"prompt_token_ids": p} for p in ids],
                                    SamplingParams(temperature=0, max_tokens=8, seed=1234,
                                                   stop=[info["eos_token"], "\n\n"]), use_tqdm=False)
    assert [c.text for c in out.choices] == [e.outputs[0].text for e in expected]
    decoded = [http.post(f"{base}/detokenize", json={"tokens": p}).json()["prompt"] for p in ids]
    assert decoded == contexts


def test_models_card_has_max_model_len(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
        card = client.models.list().data[0]
    assert card.id == MODEL_NAME and card.object == "model" and card.owned_by == "lamina"
    extra = card.model_dump()
    assert extra["max_model_len"] == MAX_MODEL_LEN and isinstance(card.created, int) and "root" in extra


def test_responses_and_embeddings_say_why_they_are_missing(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError, match="Responses API"):
            client.responses.create(model=MODEL_NAME, input="hi")
        with pytest.raises(openai.NotFoundError, match="generation models"):
            client.embeddings.create(model=MODEL_NAME, input="hi")


def test_without_a_tokenizer_the_routes_answer_400(qwen3_next_dir, tmp_path):
    bare = tmp_path / "no_tokenizer"
    shutil.copytree(qwen3_next_dir, bare)
    for name in TOKENIZER_FILES + ("chat_template.jinja", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    with _llm(bare) as llm, RunningServer(llm.engine) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert llm.get_tokenizer() is None
        for method, path, body in (("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/tokenizer_info", None)):
            r = c.request(method, path, json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "no_tokenizer" and "tokenizer" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200

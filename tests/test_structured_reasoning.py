"""Structured output after the reasoning: with a reasoning parser on and a prompt that opened a think
block, a request's own constraint (response_format, structured_outputs, guided_*) applies only from
the token after `</think>` (vLLM's rule), so the model thinks freely and the constrained answer is the
content; the engine's `enforce_after_token_id` does it."""

from __future__ import annotations

import json

import openai
import pytest

from lamina import LLM, SamplingParams
from lamina.entrypoints.openai.chat_tools import ChatOptions
from lamina.structured_output import StructuredOutputsParams
from tests.scripted_checkpoint import make_scripted_checkpoint
from tests.server_harness import MODEL_NAME, RunningServer
from tests.test_server_tools import HERMES_PIECES, MESSAGES, OPEN_THINK_TEMPLATE, THOUGHT, TOOLS_TEMPLATE


@pytest.fixture(scope="module")
def scripted(qwen3_next_dir, tmp_path_factory):
    """Greedy output after the generation prompt: "<think>Checking the weather.</think>\\n\\n<tool_call>..."."""
    return make_scripted_checkpoint(qwen3_next_dir, tmp_path_factory.mktemp("reasoning") / "ckpt", HERMES_PIECES,
                                    chat_template=TOOLS_TEMPLATE)


def test_engine_grammar_waits_for_its_token(scripted):
    with LLM(str(scripted), device="cpu", dtype="float32", max_model_len=512, show_progress=False) as llm:
        tok = llm.get_tokenizer()
        end = tok.convert_tokens_to_ids("</think>")
        prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
        assert free.text.startswith("<think>Checking the weather.</think>\n\n<tool_call>")
        spec = {"regex": r"[a-c]{3}", "enforce_after_token_id": end}
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec),
                           use_tqdm=False)[0].outputs[0]
        head = "<think>Checking the weather.</think>"
        assert out.text.startswith(head) and len(out.text) == len(head) + 3, out.text  # free, then the grammar
        assert all(ch in "abc" for ch in out.text[len(head):]) and out.finish_reason == "stop"
        at_once = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"regex": r"[a-c]{3}"}),
                               use_tqdm=False)[0].outputs[0]
        assert len(at_once.text) == 3  # without it: from the first token
    with pytest.raises(ValueError, match="enforce_after_token_id"):
        StructuredOutputsParams(regex="a", enforce_after_token_id=-1)


def _answer(client, **kwargs):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0,
                                              **kwargs)
    message = response.choices[0].message
    return message.model_extra.get("reasoning_content"), message.content


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}},
    {"extra_body": {"guided_choice": ["yes", "no"]}},
])
def test_server_constraint_applies_after_the_reasoning(scripted, constraint):
    for template, opened in ((OPEN_THINK_TEMPLATE, True), (TOOLS_TEMPLATE, False)):
        llm = LLM(str(scripted), device="cpu", dtype="float32", max_model_len=512, show_progress=False)
        chat = ChatOptions(reasoning_parser="qwen3", chat_template=template)
        with llm, RunningServer(llm.engine, chat=chat) as srv, \
                openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60) as client:
            reasoning, content = _answer(client, **constraint)
            if opened:  # the model reasons first; the constrained answer is the content
                assert reasoning == THOUGHT
            else:  # the block is not open: the constraint holds from the first token, all of it content
                assert reasoning is None
            if "response_format" in constraint:
                assert json.loads(content) in ({"ok": True}, {"ok": False})
            else:
                assert content in ("yes", "no")

"""Load: 500 greedy requests at concurrency 64 through the `openai` client; no errors, and every output is
the offline `LLM.generate` output for the same prompt."""

from __future__ import annotations

import asyncio
import time

import openai

from lamina import LLM, SamplingParams
from tests.server_harness import MODEL_NAME, RunningServer

NUM_REQUESTS = 500
CONCURRENCY = 64
MAX_TOKENS = 6
WORDS = "river baker bread town winter map stars north library bridge snow mountain sea garden".split()


NUM_DISTINCT = 125  # each prompt is sent 4 times (the offline reference is prefill-bound on CPU)


def _prompts() -> list[str]:
    distinct = [f"{WORDS[i % len(WORDS)]} {WORDS[(i * 7) % len(WORDS)]} number {i}" for i in range(NUM_DISTINCT)]
    return [distinct[i % NUM_DISTINCT] for i in range(NUM_REQUESTS)]


def test_500_requests_at_concurrency_64_match_offline(qwen3_next_dir):
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(str(qwen3_next_dir), device="cpu", max_model_len=256, max_num_seqs=CONCURRENCY,
             show_progress=False) as llm:
        distinct = [o.outputs[0] for o in llm.generate(prompts[:NUM_DISTINCT], params, use_tqdm=False)]
        expected = [distinct[i % NUM_DISTINCT] for i in range(NUM_REQUESTS)]
        with RunningServer(llm.engine) as server:

            async def run() -> list:
                limit = asyncio.Semaphore(CONCURRENCY)
                async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                                              timeout=120) as client:

                    async def one(i: int):
                        async with limit:
                            if i % 5 == 4:  # a fifth of them streamed
                                text, finish = "", None
                                async for chunk in await client.completions.create(
                                        model=MODEL_NAME, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                                        stream=True):
                                    for choice in chunk.choices:
                                        text += choice.text
                                        finish = choice.finish_reason or finish
                                return text, finish, None
                            out = await client.completions.create(model=MODEL_NAME, prompt=prompts[i],
                                                                  max_tokens=MAX_TOKENS, temperature=0)
                            return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens

                    return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)), return_exceptions=True)

            start = time.monotonic()
            results = asyncio.run(run())
            elapsed = time.monotonic() - start
            errors = [r for r in results if isinstance(r, BaseException)]
            assert not errors, f"{len(errors)} errors, first: {errors[0]!r}"
            mismatches = [i for i, (r, e) in enumerate(zip(results, expected))
                          if r[0] != e.text or r[1] != e.finish_reason
                          or (r[2] is not None and r[2] != len(e.token_ids))]
            assert not mismatches, (f"{len(mismatches)} outputs differ from LLM.generate, first: prompt "
                                    f"{prompts[mismatches[0]]!r}: {results[mismatches[0]]} vs "
                                    f"{expected[mismatches[0]].text!r}")
            assert server.async_engine.stats.cache_usage == 0 and server.async_engine.num_in_flight == 0
            print(f"{NUM_REQUESTS} requests at concurrency {CONCURRENCY}: {elapsed:.1f} s")

"""The engine's host path: outputs only at the end (RequestOutputKind.FINAL_ONLY, what
`LLM.generate` asks for), the garbage collector's frozen heap around the step loop, and the
detokenizer's direct decode through the fast tokenizer's backend."""

from __future__ import annotations

import gc

import pytest

from lamina import LLM, SamplingParams
from lamina.engine.gc_heap import frozen_heap
from lamina.sampling_params import RequestOutputKind

PROMPT = {"prompt_token_ids": [5, 17, 230, 44, 9, 301]}


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu", dtype="float32", show_progress=False) as llm:  # the demo model, with its tokenizer
        yield llm


def _drive(engine, params, n_prompts=2):
    """Every step's outputs of `n_prompts` requests run to the end through `engine.step()`."""
    ids = [engine.add_request(PROMPT, params) for _ in range(n_prompts)]
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return ids, steps


@pytest.mark.parametrize("n", [1, 2])
def test_final_only_reports_the_finished_output_alone(llm, n):
    cumulative = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=n)
    final = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=n, output_kind=RequestOutputKind.FINAL_ONLY)
    _, every = _drive(llm.engine, cumulative)
    ids, only = _drive(llm.engine, final)
    assert sum(len(s) for s in every) > 2  # cumulative: an output after every step
    reported = [o for step in only for o in step]
    assert sorted(o.request_id for o in reported) == sorted(ids)  # one output each, none before the end
    assert all(o.finished for o in reported)
    finished = [o for step in every for o in step if o.finished]  # same prompts: same completions
    assert [[(c.token_ids, c.text) for c in o.outputs] for o in reported] == [
        [(c.token_ids, c.text) for c in o.outputs] for o in finished
    ]
    assert all(c.text and len(c.token_ids) == 6 for o in reported for c in o.outputs)


def test_generate_matches_cumulative_outputs_and_keeps_the_callers_params(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    out = llm.generate([PROMPT], params, use_tqdm=False)  # one request, as below: same batch, same sums
    assert params.output_kind == RequestOutputKind.CUMULATIVE  # generate used its own copy
    _, steps = _drive(llm.engine, params, n_prompts=1)
    final = steps[-1][0].outputs[0]
    c = out[0].outputs[0]
    assert out[0].finished and c.token_ids == final.token_ids and c.text == final.text
    assert c.logprobs == final.logprobs and c.cumulative_logprob == final.cumulative_logprob


@pytest.mark.parametrize(
    "kind, match",
    [(RequestOutputKind.DELTA, "DELTA outputs are not supported"), (True, "output_kind"), ("final", "output_kind"),
     (7, "output_kind")],
)
def test_bad_output_kind(kind, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(output_kind=kind)


def test_output_kind_from_vllm_int_values():
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams().clone().output_kind is RequestOutputKind.CUMULATIVE


def test_frozen_heap_unfreezes_and_leaves_a_callers_freeze_alone():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == frozen  # the caller's freeze was not undone
    finally:
        gc.unfreeze()


def test_generate_leaves_nothing_frozen_even_when_it_fails(llm):
    llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)
    assert gc.get_freeze_count() == 0

    def fail(plans):
        raise RuntimeError("injected")

    executor = llm.engine.executor
    original = executor.execute_replicas
    executor.execute_replicas = fail
    try:
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        executor.execute_replicas = original
    assert gc.get_freeze_count() == 0
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)[0].finished  # still serving


def test_request_status_finished():
    from lamina.engine.request import RequestStatus

    assert {s for s in RequestStatus if s.finished} == {
        RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }

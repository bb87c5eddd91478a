"""The engine's host path: outputs only at the end (RequestOutputKind.FINAL_ONLY, what
`LLM.generate` asks for), the garbage collector's frozen heap around the step loop, and the
detokenizer's direct decode through the fast tokenizer's backend."""

from __future__ import annotations

import gc
import weakref

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


def _completions(output):
    return [(c.index, c.token_ids, c.text, c.logprobs, c.cumulative_logprob) for c in output.outputs]


@pytest.mark.parametrize(
    "extra", [dict(n=1), dict(n=2), dict(n=2, best_of=3, seed=3, temperature=0.8), dict(n=1, prompt_logprobs=2)],
    ids=["n1", "n2", "best_of3", "prompt_logprobs"],
)
def test_final_only_reports_the_finished_output_alone(llm, extra):
    base = dict(temperature=0.0, max_tokens=6, ignore_eos=True) | extra
    cumulative = SamplingParams(**base)
    final = SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY)
    _, every = _drive(llm.engine, cumulative)
    ids, only = _drive(llm.engine, final)
    if extra.get("best_of", extra["n"]) == extra["n"]:  # (ranked candidates report once anyway)
        assert sum(len(s) for s in every) > 2  # cumulative: an output after every step
    reported = [o for step in only for o in step]
    assert sorted(o.request_id for o in reported) == sorted(ids)  # one output each, none before the end
    assert all(o.finished for o in reported)
    finished = [o for step in every for o in step if o.finished]  # same prompts and seeds: same completions
    assert [_completions(o) for o in reported] == [_completions(o) for o in finished]
    assert [o.prompt_logprobs for o in reported] == [o.prompt_logprobs for o in finished]
    assert all(c.text and len(c.token_ids) == 6 for o in reported for c in o.outputs)
    if "prompt_logprobs" in extra:
        assert all(o.prompt_logprobs[1:] and all(o.prompt_logprobs[1:]) for o in reported)


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


def _assert_freeze_restored(before: int) -> None:
    if before:
        assert 0 < gc.get_freeze_count() <= before  # someone else's freeze: left in place
    else:
        assert gc.get_freeze_count() == 0  # ours: undone


def test_frozen_heap_unfreezes_and_leaves_a_callers_freeze_alone():
    # A frozen object that is freed leaves the permanent generation, so while a freeze is held
    # (by the test or by another engine loop's thread) the count can only fall: compare with
    # bounds, never equality.
    before = gc.get_freeze_count()  # 0 unless another engine loop of this process holds a freeze
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    _assert_freeze_restored(before)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert 0 < gc.get_freeze_count() <= frozen  # the caller's freeze was not undone
    finally:
        if not before:
            gc.unfreeze()


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_heap_collects_first_only_when_asked():
    """The server's loop (collect=True) frees garbage before freezing; a generate call freezes
    it for its span only, and it is collectable again afterwards."""
    if gc.get_freeze_count():
        pytest.skip("another engine loop of this process holds a freeze: frozen_heap does nothing")
    garbage = _Cycle()
    alive = weakref.ref(garbage)
    del garbage
    with frozen_heap(collect=True):
        assert alive() is None
    garbage = _Cycle()
    alive = weakref.ref(garbage)
    del garbage
    with frozen_heap():
        gc.collect()
        assert alive() is not None  # frozen with everything else
    gc.collect()
    assert alive() is None


def test_generate_leaves_nothing_frozen_even_when_it_fails(llm):
    before = gc.get_freeze_count()
    llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_freeze_restored(before)

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
    _assert_freeze_restored(before)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)[0].finished  # still serving


def test_request_status_finished():
    from lamina.engine.request import RequestStatus

    assert {s for s in RequestStatus if s.finished} == {
        RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }

"""MTP speculative decoding (K=2) under parallel layouts gives the single-rank plain-decoding tokens
(CPU, gloo, 2-4 processes, layouts checked by debug mode).

Drafts are planted (the known continuation, spoiled at rotating positions) so that every layout
runs partial acceptance: recurrent states are rolled back on every pipeline stage and TP rank,
the drafter on the last stage drafts from the accepted position, and expert-parallel replicas
step in lockstep through the drafter's passes too.
"""

from __future__ import annotations

import random
import shutil

import pytest

from lamina import LLM, SamplingParams
from tests import tiny_checkpoints as tc
from tests.test_parallel_layouts import ENGINE, PROMPT_LENS
from tests.reference import assert_greedy_agrees, load_reference

K = 2
PLAIN = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)  # (every rank scores prompts)
# The last request's sampling reads its tokens (token 9 pushed up until its count pulls it down, drafts
# before a verified row included): its output and drafts reach the sampling rank in the plan.
PENALISED = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1, logit_bias={9: 4.0},
                           frequency_penalty=1.0, repetition_penalty=1.2)
PARAMS = [PLAIN] * (len(PROMPT_LENS) - 1) + [PENALISED]
SPEC = {"method": "mtp", "num_speculative_tokens": K}


def prompts(seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(0, 990) for _ in range(n)]} for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory, qwen3_next_dir):
    root = tmp_path_factory.mktemp("mtp_layouts")
    return {
        "qwen3_next": tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, root / "q3next")),
        "qwen4_exp": tc.add_mtp_weights(tc.make_qwen4_exp(root / "q4")),
    }


_single: dict[str, tuple[list[list[int]], list]] = {}


def single_rank_plain(path) -> tuple[list[list[int]], list]:
    """(tokens, prompt logprobs) of each prompt, single rank, no speculation."""
    if str(path) not in _single:
        with LLM(str(path), **ENGINE) as llm:
            outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
            _single[str(path)] = ([o.outputs[0].token_ids for o in outs], [o.prompt_logprobs for o in outs])
    return _single[str(path)]


def run_layout_spec(path, **layout):
    reference, reference_prompt_logprobs = single_rank_plain(path)

    def plant(request, proposed):
        i, n = int(request.request_id), len(request.output_token_ids)
        drafts = list(reference[i][n : n + K])
        wrong = (n + i) % (K + 1)
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % tc.VOCAB
        return drafts

    with LLM(str(path), debug_layouts=True, speculative_config=SPEC, **ENGINE, **layout) as llm:
        llm.engine.draft_override = plant
        results = llm.generate(prompts(), PARAMS, use_tqdm=False)
        outs = [o.outputs[0].token_ids for o in results]
        metrics = llm.engine.spec_decode_metrics
        counts = list(llm.engine.step_token_counts)
    for ours, theirs in zip([o.prompt_logprobs for o in results], reference_prompt_logprobs):
        assert len(ours) == len(theirs) and ours[0] is None
        for x, y in zip(ours[1:], theirs[1:]):  # every rank scored its prompt rows (a TP collective)
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens  # partial acceptance happened
    if layout.get("enable_expert_parallel"):  # an idle replica runs the drafter's passes in lockstep too
        assert any(0 in step and sum(step) > 0 for step in counts), counts
    assert 1 < reference[-1].count(9) < len(reference[-1]) and outs[-1] == reference[-1]
    differing = [i for i, (a, b) in enumerate(zip(reference, outs)) if a != b]
    if differing:  # allowed only as near-ties of the reference (DESIGN.md)
        ref = load_reference(path)
        for i in differing:
            assert_greedy_agrees(ref, prompts()[i]["prompt_token_ids"], outs[i])
    assert len(differing) <= 1, f"sequences {differing} differ from the single-rank plain run"


LAYOUTS = {
    "qwen3_next-tp2": ("qwen3_next", dict(tensor_parallel_size=2)),
    "qwen3_next-pp2": ("qwen3_next", dict(pipeline_parallel_size=2)),
    "qwen3_next-dp2-tp2-ep-sp": ("qwen3_next", dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)),
    # PLE (and its rolled-back conv state) on the drafter's stage; the drafter's own embedding copy
    "qwen4_exp-pp2-ple-on-last-stage": ("qwen4_exp", dict(pipeline_parallel_size=2, pp_layer_partition="1,4")),
    "qwen4_exp-tp2-sp": ("qwen4_exp", dict(tensor_parallel_size=2, sequence_parallel_moe="on")),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_spec_decode_layout_matches_single_rank_plain(mtp_dirs, name):
    family, layout = LAYOUTS[name]
    run_layout_spec(mtp_dirs[family], **layout)

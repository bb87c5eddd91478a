"""MTP speculative decoding on one rank (CPU, float32): exact greedy output, rollback, metrics.

Tiny checkpoints get random `mtp.*` weights under their real names (tests.tiny_checkpoints), so
the drafter's own proposals are almost never right; partial acceptance is exercised by planting
drafts (the engine's test hook replaces the drafter's proposals with the known continuation,
spoiled at chosen positions).
"""

from __future__ import annotations

import math
import random
import re
import shutil

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.engine.spec_decode import SpeculativeConfig
from lamina.engine.spec_policy import SpecDecodePolicy
from tests import tiny_checkpoints as tc

VOCAB = tc.VOCAB
ENGINE = dict(device="cpu", dtype="float32", show_progress=False)
CHUNKED = dict(max_num_batched_tokens=16, block_size=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def spec(k: int, **extra) -> dict:
    return {"speculative_config": {"method": "mtp", "num_speculative_tokens": k, **extra}} if k else {}


def prompts(seed: int = 0, lens=(1, 6, 17, 30)) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(0, 990) for _ in range(n)]} for n in lens]


def generate(path, k: int = 0, params=GREEDY, ps=None, override=None, **kw):
    with LLM(str(path), **ENGINE, **spec(k), **kw) as llm:
        if override is not None:
            llm.engine.draft_override = override
        outs = llm.generate(ps or prompts(), params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], outs, llm.engine


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory, qwen3_next_dir, qwen3_5_moe_dir):
    root = tmp_path_factory.mktemp("mtp")
    return {
        "qwen3_next": tc.add_mtp_weights(shutil.copytree(qwen3_next_dir, root / "q3next")),
        "qwen3_5_moe": tc.add_mtp_weights(shutil.copytree(qwen3_5_moe_dir, root / "q35"), fused_experts=True),
        "qwen4_exp": tc.add_mtp_weights(tc.make_qwen4_exp(root / "q4"), shared_head=True),
    }


_plain: dict[str, list[list[int]]] = {}


def plain_tokens(mtp_models, family: str) -> list[list[int]]:
    if family not in _plain:
        _plain[family] = generate(mtp_models[family], **CHUNKED)[0]
    return _plain[family]


FAMILIES = ["qwen3_next", "qwen3_5_moe", "qwen4_exp"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identical_for_k_0_to_3(mtp_models, family):
    """Chunked prefill mixed with verification steps; drafts mostly rejected (rollback every step)."""
    expected = plain_tokens(mtp_models, family)
    for k in (1, 2, 3):
        tokens, outs, engine = generate(mtp_models[family], k, **CHUNKED)
        assert tokens == expected, f"K={k}"
        assert engine.spec_decode_metrics.num_draft_tokens > 0
        assert all(o.spec_decode is not None for o in outs)


def planting_proposer(reference: list[list[int]], k: int, max_tokens: int, log: list):
    """Drafts = the reference continuation, with draft `w` spoiled, w cycling over 0..k (k: none
    spoiled). Logs (request, drafts verified, drafts that must be accepted) of each plant."""
    counter = {}

    def override(request, proposed):
        assert len(proposed) == k  # the drafter proposed its full share
        i, n = int(request.request_id), len(request.output_token_ids)
        step = counter[i] = counter.get(i, -1) + 1
        drafts = list(reference[i][n : n + k])
        wrong = (step + i) % (k + 1)
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % VOCAB
        verified = min(k, max_tokens - n - 1)
        log.append((request.request_id, verified, min(wrong, verified)))
        return drafts

    return override


@pytest.mark.parametrize("family", FAMILIES)
def test_planted_drafts_partial_acceptance(mtp_models, family):
    """Known-correct drafts with planted wrong ones: the output is unchanged (recurrent states,
    PLE conv state and KV rolled back exactly) and acceptance is exactly as planted."""
    k = 3
    reference = plain_tokens(mtp_models, family)
    log: list = []
    override = planting_proposer(reference, k, GREEDY.max_tokens, log)
    tokens, outs, engine = generate(mtp_models[family], k, override=override, **CHUNKED)
    assert tokens == reference
    for out in outs:
        planted = [(v, a) for rid, v, a in log if rid == out.request_id and v > 0]
        metrics = out.spec_decode
        assert metrics.num_steps == len(planted)
        assert metrics.num_accepted_tokens == sum(a for _, a in planted)
        assert metrics.accepted_per_position == [sum(a > j for _, a in planted) for j in range(k)]
        assert metrics.draft_tokens_per_position == [sum(v > j for v, _ in planted) for j in range(k)]
    total = engine.spec_decode_metrics
    assert total.num_accepted_tokens == sum(o.spec_decode.num_accepted_tokens for o in outs)
    assert 0 < total.acceptance_rate < 1
    assert len(total.per_position_acceptance_rate) == k and total.mean_acceptance_length > 1.5


def test_preemption_and_recompute(mtp_models):
    """A cache too small for every request: preempted requests keep their drafts, recompute from
    scratch (drafter KV included, the kept drafts verified at the end) and still give the plain
    tokens."""
    path = mtp_models["qwen3_next"]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    small = dict(block_size=4, max_model_len=96, num_gpu_blocks_override=40, max_num_batched_tokens=64)
    ps = prompts(5, lens=(6, 17, 31, 45, 58))
    expected = generate(path, ps=ps, params=params, **small)[0]
    log: list = []
    tokens, _, engine = generate(
        path, 2, ps=ps, params=params, override=planting_proposer(expected, 2, 20, log), **small
    )
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert engine.cache.usage() == 0.0
    assert tokens == expected
    assert engine.spec_decode_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("family", ["qwen3_next", "qwen4_exp"])
def test_seeded_sampling_does_not_depend_on_preemption(mtp_models, family, monkeypatch):
    """Seeded random requests draw random numbers for every row they verify. A request preempted
    in mid-decode keeps its drafts (and the drafter's probabilities of them), and its
    recomputation verifies them as its next step would have: the draws, and so the text, are
    those of a run where no request was preempted (other requests cause the preemption, so
    anything else would make a request's text depend on its batch)."""
    from lamina.engine.scheduler import Scheduler

    preempted_with_drafts = []
    preempt = Scheduler._preempt

    def spy(self, request, plan):
        preempted_with_drafts.append(len(request.output_token_ids) > 0 and len(request.spec_token_ids) == 2)
        return preempt(self, request, plan)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    path = mtp_models[family]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=16, ignore_eos=True) for i in range(5)]
    roomy = dict(block_size=4, max_model_len=40)
    ps = prompts(5, lens=(3, 6, 9, 5, 7))
    expected = generate(path, 2, params=params, ps=ps, **roomy)[0]
    assert not preempted_with_drafts
    tokens = generate(path, 2, params=params, ps=ps, num_gpu_blocks_override=14, **roomy)[0]
    assert any(preempted_with_drafts), "the cache was meant to be too small"
    assert tokens == expected
    assert len({tuple(t) for t in tokens}) == len(tokens)


def test_preempted_seeded_request_recomputes_under_a_small_budget(mtp_models):
    """A small token budget: a seeded request preempted with its K drafts cannot recompute its last
    chunk and verify all of them in one step. Its chunk stops one token short, the last token goes
    with all the drafts in the next step, and every request finishes with the text it has without
    preemption (it used to wait for room that never came, and the engine spun)."""
    path = mtp_models["qwen3_next"]
    rng = random.Random(3)
    ps = [{"prompt_token_ids": [rng.randrange(0, 990) for _ in range(n)]} for n in (5, 11, 10)]
    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=m, ignore_eos=True)
              for i, m in enumerate((8, 11, 15))]
    small = dict(block_size=4, max_model_len=32, max_num_batched_tokens=7)
    expected = generate(path, 2, params=params, ps=ps, **small)[0]
    with LLM(str(path), **ENGINE, **spec(2), num_gpu_blocks_override=9, **small) as llm:
        engine = llm.engine
        ids = [engine.add_request(p, sp) for p, sp in zip(ps, params)]
        finals = {}
        for _ in range(200):
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests(), f"unfinished after 200 steps: {sorted(set(ids) - set(finals))}"
        assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert [list(finals[i].outputs[0].token_ids) for i in ids] == expected


def test_drafts_match_an_independent_reference(mtp_models):
    """The drafter's proposals against transformers' own decoder layer run over the whole
    sequence (no cache): the first pass reads (target hidden at p, token p+1) at every position,
    the second pass (its own output at the last position, draft 1)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    from safetensors.torch import load_file

    from tests.reference import load_reference

    path = mtp_models["qwen3_next"]
    target = load_reference(path)
    config = Qwen3NextConfig.from_pretrained(path)
    config.layer_types = ["full_attention"]
    config._attn_implementation = "eager"
    layer = hf.Qwen3NextDecoderLayer(config, 0).float().eval()
    mtp = load_file(str(path / "mtp.safetensors"))
    state = {k.removeprefix("mtp.layers.0."): v for k, v in mtp.items() if k.startswith("mtp.layers.0.")}
    experts = range(config.num_experts)  # transformers keeps experts fused: [E, 2I, H] and [E, H, I]
    state["mlp.experts.gate_up_proj"] = torch.stack([
        torch.cat([state.pop(f"mlp.experts.{e}.gate_proj.weight"), state.pop(f"mlp.experts.{e}.up_proj.weight")])
        for e in experts
    ])
    state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    layer.load_state_dict(state)
    norm = {n: hf.Qwen3NextRMSNorm(64, eps=config.rms_norm_eps) for n in ("e", "h", "out")}
    for n, name in (("e", "pre_fc_norm_embedding"), ("h", "pre_fc_norm_hidden"), ("out", "norm")):
        norm[n].weight.data.copy_(mtp[f"mtp.{name}.weight"])
    rotary = hf.Qwen3NextRotaryEmbedding(config)
    embed, head = target.model.embed_tokens, target.lm_head

    @torch.no_grad()
    def reference_logits(sequence: list[int], draft: int):
        """Logits of draft 1 (after `sequence`) and of draft 2 given draft 1 = `draft`."""
        ids = torch.tensor([sequence])
        hidden = target.model(input_ids=ids).last_hidden_state[0, :-1]  # [P+1, H]: target states up to P
        x = torch.cat([norm["e"](embed(ids[0, 1:])), norm["h"](hidden)], dim=-1) @ mtp["mtp.fc.weight"].T  # [P+1, H]

        def run(x):
            n = x.shape[0]
            cos_sin = rotary(x[None], torch.arange(n)[None])
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            return norm["out"](layer(x[None], position_embeddings=cos_sin, attention_mask=mask)[0])  # [n, H]

        out = run(x)
        second = torch.cat([norm["e"](embed(torch.tensor([draft]))), norm["h"](out[-1:])], dim=-1) @ mtp["mtp.fc.weight"].T
        out2 = run(torch.cat([x, second]))
        return head(out[-1]), head(out2[-1])

    seen = []

    def record(request, proposed):
        seen.append((list(request.all_token_ids), list(proposed)))
        return proposed

    generate(path, 2, ps=prompts(7, lens=(5, 19)), override=record, **CHUNKED)
    assert len(seen) > 10
    for sequence, (d1, d2) in seen[::3]:
        first, second = reference_logits(sequence, d1)
        assert first[d1] >= first.max() - 1e-3 and second[d2] >= second.max() - 1e-3


def _plant_reference(reference: list[list[int]], k: int, exact: tuple[int, ...] = ()):
    """Drafts = the reference continuation, the last one spoiled every other step (never for the
    requests numbered in `exact`)."""
    def override(request, proposed):
        i, n = int(request.request_id), len(request.output_token_ids)
        drafts = list(reference[i][n : n + k])
        if (n + i) % 2 and drafts and i not in exact:
            drafts[-1] = (drafts[-1] + 1) % VOCAB
        return drafts

    return override


def test_stops_logprobs_and_min_tokens_inside_accepted_drafts(mtp_models):
    """A stop token met among accepted drafts ends the request there; min_tokens bans apply per
    verified position; logprobs come back for every emitted token, as in plain decoding."""
    path = mtp_models["qwen3_next"]
    base = generate(path)[0]
    stop_at = [toks[6] for toks in base]  # the 7th token of each plain sequence
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[t], min_tokens=3, logprobs=2) for t in stop_at
    ]
    reference, ref_outs, _ = generate(path, params=params)
    tokens, outs, _ = generate(path, 3, params=params, override=_plant_reference(reference, 3))
    assert tokens == reference
    for ours, theirs in zip(outs, ref_outs):
        a, b = ours.outputs[0], theirs.outputs[0]
        assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
        assert len(a.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_logit_bias_and_allowed_token_ids_inside_accepted_drafts(mtp_models):
    """logit_bias and allowed_token_ids (the same at every position) under MTP: every verified row
    applies them, so greedy and seeded random output equal plain decoding's, drafts accepted."""
    path = mtp_models["qwen3_next"]
    ps = prompts(3, lens=(6, 17))
    plain = generate(path, ps=ps)[0]
    favoured = [toks[2] for toks in plain]  # a token plain decoding reaches, pushed up
    allowed = sorted({t for toks in plain for t in toks} | {3, 5, 7, 11})
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias={favoured[0]: 2.5}),
              SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed,
                             logit_bias={favoured[1]: -1.5})]
    reference = generate(path, params=params, ps=ps)[0]
    assert reference != plain  # the options change the text
    assert all(t in allowed for t in reference[1])
    tokens, _, engine = generate(path, 2, params=params, ps=ps, override=_plant_reference(reference, 2))
    assert tokens == reference and engine.spec_decode_metrics.num_accepted_tokens > 0
    unplanted = generate(path, 2, params=params, ps=ps)[0]  # the drafter's own drafts (biased outputs: rejected more)
    assert unplanted == reference


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_bad_words_and_grammars_inside_accepted_drafts(mtp_models, async_scheduling):
    """Options that read a request's tokens under MTP: each verified position applies the
    penalties, bad words and grammar mask of the output plus the drafts before it, so greedy and
    seeded random output equal plain decoding's, with planted drafts (accepted, and spoiled ones a
    grammar may rule out) and with the drafter's own; such steps are never planned ahead."""
    path = mtp_models["qwen3_next"]
    ps = prompts(4, lens=(6, 17, 9, 12))
    plain = generate(path, ps=ps)[0]
    with LLM(str(path), **ENGINE) as llm:
        word = llm.get_tokenizer().decode(plain[1][1:3])  # two tokens the seeded row might write
    params = [
        # token 9 pushed up, until its count in the output (drafts before a row included) pulls it down
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={9: 4.0}, repetition_penalty=1.2,
                       frequency_penalty=1.0, presence_penalty=0.5),
        SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, logit_bias={9: 5.0},
                       presence_penalty=2.0, frequency_penalty=2.0, bad_words=[word]),
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": r"[a-d]{2,4}-[0-9]{1,3}"}),
        SamplingParams(temperature=0.8, seed=11, max_tokens=12, structured_outputs={"choice": ["abc", "dcba", "bad"]}),
    ]
    reference, ref_outs, _ = generate(path, params=params, ps=ps)
    assert 1 < reference[0].count(9) < 12 and reference[1].count(9) == 1  # the penalties change the text
    assert re.fullmatch(r"[a-d]{2,4}-[0-9]{1,3}", ref_outs[2].outputs[0].text)
    assert ref_outs[3].outputs[0].text in ("abc", "dcba", "bad")
    # the penalised rows' drafts all right (a row past accepted 9s must count them), the grammars'
    # last draft spoiled every other step (often a token the grammar rules out)
    tokens, outs, engine = generate(path, 3, params=params, ps=ps, override=_plant_reference(reference, 3, exact=(0, 1)),
                                    async_scheduling=async_scheduling)
    assert tokens == reference and outs[0].spec_decode.num_accepted_tokens >= 6
    assert engine.num_overlapped_steps == 0  # every step reported before the next was planned
    assert generate(path, 3, params=params, ps=ps, async_scheduling=async_scheduling)[0] == reference


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_with_mtp(mtp_models, async_scheduling):
    """prompt_logprobs under MTP (prompts in chunks beside other requests' verification steps; steps
    planned ahead or not): the plain run's prompt logprobs and its tokens."""
    path = mtp_models["qwen3_5_moe"]
    ps = prompts(4, lens=(9, 23, 5))
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=0, logprobs=1)]
    small = dict(max_num_batched_tokens=8)  # the 23-token prompt in chunks, beside the others' steps
    reference, ref_outs, _ = generate(path, params=params, ps=ps, **small)
    tokens, outs, engine = generate(path, 2, params=params, ps=ps, async_scheduling=async_scheduling, **small)
    assert tokens == reference and engine.spec_decode_metrics.num_steps > 0
    assert engine.async_scheduling == async_scheduling
    for ours, theirs, p in zip(outs, ref_outs, params):
        if p.prompt_logprobs is None:
            assert ours.prompt_logprobs is None
            continue
        assert len(ours.prompt_logprobs) == len(theirs.prompt_logprobs) == len(ours.prompt_token_ids)
        for x, y in zip(ours.prompt_logprobs, theirs.prompt_logprobs):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_logprobs_modes_inside_accepted_drafts(mtp_models, mode):
    """logprobs_mode under MTP: every verified position reports what plain decoding reports, for a
    greedy row with min_tokens bans and a seeded random row with temperature and top-k."""
    path = mtp_models["qwen3_next"]
    params = [SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=10, logprobs=3, ignore_eos=True)]
    ps = prompts(2, lens=(6, 17))
    reference, ref_outs, _ = generate(path, params=params, ps=ps, logprobs_mode=mode)
    tokens, outs, engine = generate(path, 2, params=params, ps=ps, override=_plant_reference(reference, 2),
                                    logprobs_mode=mode)
    assert tokens == reference and engine.spec_decode_metrics.num_accepted_tokens > 0
    for ours, theirs in zip(outs, ref_outs):
        for x, y in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            finite = {t for t in y if math.isfinite(y[t])}
            assert {t for t in x if math.isfinite(x[t])} == finite and all(abs(x[t] - y[t]) < 1e-4 for t in finite)
    if mode == "processed_logprobs":  # the seeded row's top 3 of 5 left by top-k: finite; the greedy row's too
        assert all(math.isfinite(v) for o in ref_outs for entry in o.outputs[0].logprobs for v in entry.values())


@pytest.mark.parametrize("family,layout", [("qwen3_5_moe", []), ("qwen4_exp", []), ("qwen3_5_moe", ["-pp", "2"])])
def test_plan_counts_the_drafter(mtp_models, capsys, family, layout):
    """`lamina plan --speculative-config` counts what the engine holds with MTP: the drafter's weights
    (its own embedding on a pipeline's last stage) and its KV cache, beside the target's."""
    import json

    from lamina.entrypoints.cli import main

    path = mtp_models[family]
    spec_json = '{"method": "mtp", "num_speculative_tokens": 2}'
    assert main(["plan", str(path), "--device", "cpu", "--dtype", "float32", "--json", *layout]) == 0
    plain = json.loads(capsys.readouterr().out)["ranks"][-1]["estimate"]
    assert main(["plan", str(path), "--device", "cpu", "--dtype", "float32", "--json", *layout,
                 "--speculative-config", spec_json]) == 0
    planned = json.loads(capsys.readouterr().out)["ranks"][-1]["estimate"]
    assert planned["weight_bytes"] > plain["weight_bytes"] and planned["kv_bytes_per_token"] > plain["kv_bytes_per_token"]
    if layout:
        return
    with LLM(str(path), **ENGINE, **spec(2)) as llm:
        runner = llm.engine.executor.runner
        params = {id(p): p for p in runner.model.parameters()}.values()
        held = sum(p.numel() * p.element_size() for p in params)
        assert planned["weight_bytes"] + planned["ple_table_bytes"] == held  # (Qwen4-Exp: its PLE table apart)
        assert planned["kv_bytes_per_token"] == runner.paged_cache_bytes_per_block(16) // 16


def test_generation_up_to_max_model_len(mtp_models):
    """Drafts and the drafter's lookahead are cut at max_model_len; the last steps still verify."""
    path = mtp_models["qwen3_5_moe"]
    ps = prompts(9, lens=(25, 31))
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    small = dict(max_model_len=40, block_size=4)
    reference = generate(path, ps=ps, params=params, **small)[0]
    assert [len(t) for t in reference] == [15, 9]
    tokens, _, engine = generate(path, 3, ps=ps, params=params, override=_plant_reference(reference, 3), **small)
    assert tokens == reference and engine.spec_decode_metrics.num_accepted_tokens > 0


def test_sampling_runs_and_is_reproducible(mtp_models):
    params = SamplingParams(temperature=0.9, top_k=50, max_tokens=10, ignore_eos=True, seed=123)
    path = mtp_models["qwen4_exp"]
    first = generate(path, 2, params=params)[0]
    assert first == generate(path, 2, params=params)[0]
    assert all(len(t) == 10 and all(0 <= x < VOCAB for x in t) for t in first)


# ---- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, r"method must be one of \['mtp', 'qwen3_next_mtp'\], got 'eagle'"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "integer >= 1"),
    ({"method": "mtp", "num_speculative_tokens": "2"}, "integer >= 1"),
    ({"method": "mtp"}, "integer >= 1"),
    ({"method": "mtp", "num_speculative_tokens": 2, "policy": "sometimes"}, "policy must be one of"),
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown key"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_config(qwen3_next_dir, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(qwen3_next_dir), **ENGINE, speculative_config=config)


def test_checkpoint_without_mtp_is_refused_before_loading(qwen3_next_dir, tmp_path, monkeypatch):
    import lamina.worker.model_loader as model_loader

    def no_load(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(model_loader, "build_model", no_load)
    monkeypatch.setattr("lamina.engine.llm_engine.build_model", no_load)
    with pytest.raises(ValueError, match="num_nextn_predict_layers nor mtp_num_hidden_layers"):
        LLM(str(qwen3_next_dir), **ENGINE, **spec(2))
    declared = shutil.copytree(qwen3_next_dir, tmp_path / "declared")
    text = (declared / "config.json").read_text().replace('"num_hidden_layers"', '"num_nextn_predict_layers": 1, "num_hidden_layers"')
    (declared / "config.json").write_text(text)
    with pytest.raises(ValueError, match="holds no mtp.\\* tensors"):
        LLM(str(declared), **ENGINE, **spec(2))


def test_the_qwen_cards_method_name_runs_mtp(mtp_models):
    """vLLM's "qwen3_next_mtp" (the Qwen model cards' launch lines) is lamina's "mtp"."""
    expected = plain_tokens(mtp_models, "qwen3_5_moe")
    with LLM(str(mtp_models["qwen3_5_moe"]), **ENGINE, **CHUNKED,
             speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": 2}) as llm:
        assert llm.engine.spec_config.method == "mtp"
        outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.engine.spec_decode_metrics.num_draft_tokens > 0


def test_cli_flag():
    from lamina.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']
    )
    assert engine_kwargs(args)["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="not valid JSON"):
        engine_kwargs(build_parser().parse_args(["generate", "--speculative-config", "{oops"]))


# ---- auto policy ----------------------------------------------------------------------------
def _policy(**extra):
    config = SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 3, "policy": "auto", **extra})
    return SpecDecodePolicy(config, num_hidden_layers=40, num_mtp_layers=1, device_type="cuda", probe_interval=4)


def test_auto_policy_follows_acceptance_and_batch_size():
    policy = _policy(auto_cost="model")
    for _ in range(30):
        policy.observe([(3, 3)] * 8)  # every draft accepted
    assert policy.decide(1) == 3
    assert policy.decide(512) < 3  # a big batch is compute bound: extra tokens cost their price
    for _ in range(60):
        policy.observe([(3, 0)] * 8)  # nothing accepted
    assert policy.decide(1) == 0
    decisions = "".join(str(policy.decide(1)) for _ in range(48))
    runs = decisions.replace("0", " ").split()
    gaps = [len(z) for z in decisions.strip("0").replace("1", " ").split()]
    assert len(runs) >= 3 and all(r == "111" for r in runs[:-1]), decisions
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], decisions
    # probes while off: one draft for three steps (the later two are timed k = 1 steps) after 4 idle
    # steps, then after 8, 16, ...: the gap doubles while drafts keep not paying
    for _ in range(60):
        policy.observe([(1, 1)] * 8)
    assert policy.decide(1) > 0  # raised again once drafts pay
    assert _policy(policy="fixed").decide(4096) == 3
    assert policy.decide(2) == 3  # measured costs are off: no baseline timing either


def test_auto_policy_explores_untimed_k():
    """Timed at k = 0 and k = 1 only, a larger k is assumed as cheap as k = 1: with drafts that are
    usually right it is tried, timed, and kept when it pays; a probe while speculation is off
    tries the most promising k."""
    policy = _policy()
    for _ in range(40):
        policy.observe([(3, 3)] * 9 + [(3, 0)])
    for _ in range(3):
        policy.observe_step_time(64, 0, 0.100)
        policy.observe_step_time(64, 1, 0.200)
    assert policy.decide(64) == 3
    for _ in range(3):
        policy.observe_step_time(64, 3, 0.220)
    assert policy.decide(64) == 3  # 3.4 tokens for 2.2x the time
    for _ in range(3):
        policy.observe_step_time(64, 3, 0.500)
    assert policy.decide(64) < 3
    off = SpecDecodePolicy(
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 3, "policy": "auto"}),
        num_hidden_layers=40, num_mtp_layers=1, device_type="cuda", probe_interval=2,
    )
    for _ in range(3):
        off.observe_step_time(8, 0, 0.100)
        off.observe_step_time(8, 1, 0.300)
    off.observe([(3, 3)] * 2 + [(3, 0)] * 6)
    # off at k = 0; the probe after 2 idle steps tries k = 3 (untimed, so assumed as cheap as k = 1
    # plus 10 %, and more drafts promise clearly more tokens) for three steps
    assert [off.decide(8) for _ in range(6)] == [0, 3, 3, 3, 0, 0]


def test_auto_policy_trusts_measured_step_times():
    """The model says a draft is nearly free at batch 64; timed steps say a k = 1 step costs twice
    a k = 0 step (launch bound, as measured on an H200): with 70% acceptance speculation is a loss
    there, while at batch 1 (cheap drafts, timed) it stays on."""
    policy = _policy()
    for _ in range(40):
        policy.observe([(3, 3)] * 5 + [(3, 0)] * 2)  # c_1 about 0.7, later drafts always accepted
    assert policy.best_k(64) > 0  # the model alone: speculate
    assert [policy.decide(64) for _ in range(3)] == [0, 0, 0]  # but first, steps time k = 0 at this size
    assert [policy.decide(1) for _ in range(3)] == [0, 0, 0]  # and at batch 1
    for _ in range(5):
        policy.observe_step_time(64, 0, 0.100)
        policy.observe_step_time(64, 1, 0.200)
        policy.observe_step_time(64, 2, 0.300)
        policy.observe_step_time(64, 3, 0.400)
        policy.observe_step_time(1, 0, 0.100)
        policy.observe_step_time(1, 3, 0.120)
    assert policy.decide(64) == 0
    assert policy.step_cost(40, 1) == policy.model_cost(40, 1)  # 32-63: another size class, not timed yet
    assert policy.decide(1) == 3
    # untimed: as cheap as the nearest cheaper timed k, plus the exploration margin
    assert abs(policy.step_cost(1, 1) - 1.1 * policy.step_cost(1, 0)) < 1e-9
    assert abs(policy.step_cost(64, 2) - 0.300) < 1e-9 and abs(policy.step_cost(1, 3) - 0.120) < 1e-9
    # a timing not refreshed for long goes stale: k = 3 is then assumed as cheap as k = 0, re-tried
    for _ in range(600):
        policy.observe_step_time(64, 0, 0.100)
    assert abs(policy.step_cost(64, 3) - 1.1 * policy.step_cost(64, 0)) < 1e-9
    assert policy.decide(64) > 0
    model_only = _policy(auto_cost="model")
    model_only.observe_step_time(64, 1, 10.0)
    assert model_only.step_cost(64, 1) == model_only.model_cost(64, 1)
    with pytest.raises(ValueError, match="auto_cost"):
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1, "auto_cost": "guess"})


def test_engine_times_only_steady_decode_steps(mtp_models):
    """The auto policy is told the time of steps where every request verifies k drafts and
    proposes k, never of steps holding prompt tokens (a request joins mid-decode here), of steps
    where k changes, or of requests whose drafts were cut; the batch it is told is the number of
    requests that ran."""
    path = mtp_models["qwen3_next"]
    ps = prompts(3, lens=(7, 30, 12, 9))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(path), **ENGINE, **spec(2, policy="auto")) as llm:
        engine = llm.engine
        policy = engine.spec_policy
        policy.probe_interval = 3  # switch k often
        timed = []
        real_observe = policy.observe_step_time
        policy.observe_step_time = lambda b, k, t: (timed.append((b, k, t)), real_observe(b, k, t))
        for p in ps[:3]:
            engine.add_request(p, params)
        log = []  # per step: (k decided, prompt tokens in it, requests run, timings reported)
        step = 0
        while engine.has_unfinished_requests():
            if step == 8:
                engine.add_request(ps[3], params)  # a prompt chunk among decodes
            before = len(timed)
            outs = engine.step()
            prompt_step = step == 8 or step == 0
            log.append((engine.num_draft_tokens, prompt_step, len(outs), timed[before:]))
            step += 1
    assert sum(len(entry[3]) for entry in log) >= 5
    for i, (k, prompt_step, ran, reported) in enumerate(log):
        if prompt_step or i == 0:
            assert not reported, (i, log[i])
        for b, k_timed, t in reported:
            assert t > 0 and k_timed == k == log[i - 1][0], (i, log[i - 1], log[i])
            assert b == ran
    b, k, _ = timed[-1]
    assert policy.step_cost(b, k) != policy.model_cost(b, k)  # the timing reached the cost estimate


def test_auto_policy_speculates_when_the_baseline_cannot_be_timed():
    """Steps that always hold prompt chunks are never timed: the baseline attempt is retried now
    and then, but speculation does not stop (review finding)."""
    policy = _policy()
    policy.probe_interval = 32
    for _ in range(40):
        policy.observe([(3, 3)] * 8)
    decisions = [policy.decide(8) for _ in range(200)]
    assert sum(k > 0 for k in decisions) > 150 and decisions.count(0) >= 6


def test_auto_policy_distrusts_a_lone_first_timing():
    """A first step at a new shape may carry one-off costs: alone it does not count as timed, and a
    second, faster one replaces it (review finding)."""
    policy = _policy()
    policy.observe_step_time(64, 0, 0.1)
    policy.observe_step_time(64, 0, 0.1)
    policy.observe_step_time(64, 1, 1.0)  # allocation on first use
    assert not policy.is_timed(64, 1)
    assert abs(policy.step_cost(64, 1) - 1.1 * policy.step_cost(64, 0)) < 1e-9  # still optimistic
    policy.observe_step_time(64, 1, 0.11)
    assert policy.is_timed(64, 1) and abs(policy.step_cost(64, 1) - 0.11) < 1e-9


def test_set_policy_bounds():
    policy = _policy()
    policy.set_policy("fixed", 2)
    assert policy.decide(1) == 2
    with pytest.raises(ValueError, match="0..3"):
        policy.set_policy("fixed", 4)
    with pytest.raises(ValueError, match="policy"):
        policy.set_policy("sometimes", 1)


def test_auto_policy_in_the_engine(mtp_models):
    """Drafts that stop paying switch speculation off; when they pay again it comes back; the
    output never changes."""
    path = mtp_models["qwen3_next"]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ps = prompts(3, lens=(7,))
    reference = generate(path, ps=ps, params=params)[0][0]
    history = []

    def override(request, proposed):
        n = len(request.output_token_ids)
        good = n < 8 or n >= 24
        history.append((n, len(proposed)))
        drafts = list(reference[n : n + len(proposed)])
        return drafts if good else [(t + 1) % VOCAB for t in drafts]

    with LLM(str(path), **ENGINE, **spec(3, policy="auto", auto_saturation_tokens=64, auto_draft_cost=0.25,
                                          auto_cost="model")) as llm:
        llm.engine.spec_policy.probe_interval = 2
        llm.engine.draft_override = override
        tokens = llm.generate(ps, params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens == reference
    sizes = [k for _, k in history]
    assert 0 in sizes and min(n for n, k in history if k == 0) >= 8, history  # off only once drafts went bad
    assert max(sizes) >= 2 and sizes[-1] >= 2, history  # back up once drafts are right again

"""Qwen4-Exp (hyper-connections, N-gram PLE, QSA indexed attention) against transformers on tiny
random checkpoints (CPU, float32).

Two checkpoints: hc_count 2 with PLE on one layer (silu output gate), and hc_count 4 with PLE on
two layers (sigmoid output gate, partial RoPE, the multimodal wrapper's text part). Both have an
indexer budget of 8 tokens (2 blocks of 4) far below the contexts used, and prompts contain EOS
(999) in the middle, so n-grams are cut and blocks are really dropped.
"""

from __future__ import annotations

import random

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.layers.metadata import ForwardMetadata
from lamina.models.qwen4_exp import Qwen4ExpForCausalLM
from lamina.parallel.context import ParallelContext
from lamina.worker.model_loader import build_model, read_model_config
from tests import tiny_checkpoints as tc
from tests.reference import assert_greedy_agrees, lamina_logits, load_reference, reference_logits

EOS = 999
PROMPT_LENS = [1, 6, 17, 31, 45, 58]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CONFIGS = {
    "hc2_ple1": dict(hc_count=2, ple_layer_ids=(2,)),
    "hc4_ple2": dict(
        hc_count=4, ple_layer_ids=(1, 4), output_gate_type="sigmoid", partial_rotary_factor=0.5, conditional=True, seed=5
    ),
}


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_prompts(seed: int) -> list[list[int]]:
    """Random prompts with EOS inside (single and doubled) wherever they are long enough."""
    rng = random.Random(seed)
    prompts = []
    for n in PROMPT_LENS:
        p = [rng.randrange(0, 990) for _ in range(n)]
        for pos in (3, 9, 10, 24):
            if pos < n - 1:
                p[pos] = EOS
        prompts.append(p)
    return prompts


@pytest.fixture(scope="module", params=list(CONFIGS))
def model_pair(request, tmp_path_factory):
    path = tc.make_qwen4_exp(tmp_path_factory.mktemp(f"q4_{request.param}") / "ckpt", **CONFIGS[request.param])
    return path, load_reference(path)


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", show_progress=False, debug_layouts=True, **kwargs)


def _check_outputs(ref, prompts, outputs, max_tokens):
    exact = total = 0
    for prompt, out in zip(prompts, outputs):
        ids = out.outputs[0].token_ids
        assert out.prompt_token_ids == prompt
        assert len(ids) == max_tokens and out.outputs[0].finish_reason == "length"
        exact += assert_greedy_agrees(ref, prompt, ids)
        total += len(ids)
    assert exact >= total - 2, f"only {exact}/{total} greedy tokens are the exact reference argmax"


# ---- logits ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [None, [13, 1, 30, 20], [2, 1, 6, 9, 3, 43]])
def test_per_position_logits_close(model_pair, chunks):
    """Chunks that end mid n-gram window and mid indexer block; EOS at 3, 9, 10, 24."""
    path, ref = model_pair
    tokens = make_prompts(1)[-1] + make_prompts(2)[2][:6]  # 64 tokens
    with _llm(path) as llm:
        ours = lamina_logits(llm, tokens, chunks)
    torch.testing.assert_close(ours, reference_logits(ref, tokens), atol=2e-4, rtol=2e-4)


# ---- generation ------------------------------------------------------------------------------


def _generate_small_budget(path, **kwargs):
    prompts = make_prompts(3)
    with _llm(path, max_num_batched_tokens=7, block_size=8, **kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return prompts, outputs


def test_greedy_chunked_prefill_and_host_ple_table(model_pair):
    """A 7-token budget splits n-gram windows and indexer blocks across prefill chunks and mixes
    prefill with decode; the table in host memory (`ple_table_device="cpu"`) gives the same tokens."""
    path, ref = model_pair
    prompts, outputs = _generate_small_budget(path)
    _check_outputs(ref, prompts, outputs, GREEDY.max_tokens)
    _, host_outputs = _generate_small_budget(path, ple_table_device="cpu")
    assert [o.outputs[0].token_ids for o in host_outputs] == [o.outputs[0].token_ids for o in outputs]


def test_greedy_requests_join_while_others_decode(model_pair):
    path, ref = model_pair
    prompts = make_prompts(4)
    with _llm(path, max_num_batched_tokens=24) as llm:
        engine = llm.engine
        finished = {}
        for i, p in enumerate(prompts[:2]):
            engine.add_request({"prompt_token_ids": p}, GREEDY, request_id=f"r{i}")
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            steps += 1
            if steps == 6:  # the first two are decoding by now
                for i, p in enumerate(prompts[2:], start=2):
                    engine.add_request({"prompt_token_ids": p}, GREEDY, request_id=f"r{i}")
    _check_outputs(ref, prompts, [finished[f"r{i}"] for i in range(len(prompts))], GREEDY.max_tokens)


def test_greedy_with_preemption(model_pair):
    path, ref = model_pair
    prompts = make_prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with _llm(path, block_size=4, max_model_len=96, num_gpu_blocks_override=40, max_num_batched_tokens=64) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"
        assert llm.engine.cache.usage() == 0.0
    _check_outputs(ref, prompts, outputs, params.max_tokens)


# ---- pipeline seam and declared layouts ------------------------------------------------------


def _whole_sequence_meta(tokens: list[int], block_size: int) -> ForwardMetadata:
    n = len(tokens)
    blocks = -(-n // block_size)
    return ForwardMetadata(
        num_tokens=n, num_reqs=1, max_query_len=n, max_seq_len=n,
        positions=torch.arange(n), query_start_loc=torch.tensor([0, n]), seq_lens=torch.tensor([n]),
        slot_mapping=torch.arange(n), block_tables=torch.arange(blocks)[None], state_slots=torch.tensor([0]),
        has_initial_state=torch.tensor([False]), history_token_ids=torch.full((1, 2), -1),
        token_request_index=torch.zeros(n, dtype=torch.long),
    )


def _stage(path, hf_config, layer_range, ctx):
    model, _, report = build_model(path, hf_config, ctx, dtype=torch.float32, device=torch.device("cpu"),
                                   progress=False, layer_range=layer_range)
    for m in model.paged_cache_modules():
        m.bind_paged_cache(8, 16, torch.float32, "cpu")
    for m in model.state_modules():
        m.bind_state(2, torch.float32, "cpu")
    return model, report


def test_two_pipeline_stages_and_debug_layouts(model_pair):
    """Stage 0 (layers 0-1, embedding) hands [T, hc*H] to stage 1 (layers 2-4, mixer, LM head),
    each loading only its own weights; layouts are checked (debug mode) on every module."""
    path, ref = model_pair
    hf_config = read_model_config(path)
    tokens = make_prompts(6)[-1]
    ctx = ParallelContext(debug_layouts=True)
    first, first_report = _stage(path, hf_config, (0, 2), ctx)
    last, last_report = _stage(path, hf_config, (2, 5), ctx)
    assert not first_report.unexpected and not last_report.unexpected
    assert not any("hyper_connection_mixer" in n or n == "lm_head.weight" for n in first_report.loaded)
    assert not any("embed_tokens" in n or "layers.0." in n for n in last_report.loaded)
    meta = _whole_sequence_meta(tokens, 16)
    with torch.inference_mode():
        streams = first(torch.tensor(tokens), meta)
        assert streams.shape == (len(tokens), first.stream_width())
        logits = last.compute_logits(last(torch.tensor(tokens), meta, hidden=streams))
    torch.testing.assert_close(logits, reference_logits(ref, tokens), atol=2e-4, rtol=2e-4)


# ---- config checks ---------------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(ple_layer_ids=[3]), r"ple_layer_ids \[3\] are not linear-attention layers.*valid ids are \[1, 2, 4\]"),
    (dict(ple_layer_ids=[0]), r"ple_layer_ids \[0\] are out of range.*\[1, 5\]"),
    (dict(ple_layer_ids=[6]), r"ple_layer_ids \[6\] are out of range"),
    (dict(ple_embed_dim=30), r"ple_embed_dim = 30 is not divisible by .* = 4"),
    (dict(indexer_budget=None), r"QSA indexer config is incomplete: .*indexer_budget missing"),
    (dict(indexer_kv_heads=2), r"indexer_kv_heads = 2 is not supported.*exactly 1"),
    (dict(indexer_budget=10), r"indexer_budget = 10 is not divisible by indexer_compress_ratio = 4"),
    (dict(hc_count=1), r"hc_count = 1 is not supported"),
    (dict(output_gate_type="gelu"), r"output_gate_type = 'gelu' is not supported; supported: silu, sigmoid"),
]


@pytest.fixture(scope="module")
def small_config_dir(tmp_path_factory):
    return tc.make_qwen4_exp(tmp_path_factory.mktemp("q4_cfg") / "ckpt", qsa=True)


BAD_CONFIG_IDS = ["{}={}".format(*next(iter(c.items()))) for c, _ in BAD_CONFIGS]


@pytest.mark.parametrize("changes,message", BAD_CONFIGS, ids=BAD_CONFIG_IDS)
def test_config_errors_before_weights_load(small_config_dir, tmp_path, changes, message, monkeypatch):
    hf_config = read_model_config(small_config_dir)
    for key, value in changes.items():
        object.__setattr__(hf_config, key, value)  # bypass transformers' own validation
    with pytest.raises(ValueError, match=message):
        Qwen4ExpForCausalLM.parse_config(hf_config, "Qwen4ExpForCausalLM")
    # Through the loader: the error comes before any shard is opened.
    import lamina.models.loader as loader

    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match=message):
        build_model(small_config_dir, hf_config, ParallelContext.single(), dtype=torch.float32, device=torch.device("cpu"))


def test_config_reads_real_checkpoint_spelling(small_config_dir):
    """Real checkpoints say `full_attention` for indexed layers; QSA off means plain attention."""
    hf_config = read_model_config(small_config_dir)
    object.__setattr__(hf_config, "layer_types", list(tc.QWEN4_LAYER_TYPES))
    cfg = Qwen4ExpForCausalLM.parse_config(hf_config, "Qwen4ExpForCausalLM")
    assert cfg.layer_types == tuple(tc.QWEN4_LAYER_TYPES) and cfg.has_qsa
    assert cfg.ple_layers == (1,) and cfg.indexed_attention_layers == (2, 4)
    for name in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"):
        object.__setattr__(hf_config, name, None)
    assert not Qwen4ExpForCausalLM.parse_config(hf_config, "x").has_qsa


# ---- parallel layouts (gloo, one process per rank) ------------------------------------------

PARALLEL_LAYOUTS = {
    # PLE on layers 1 and 3 (ids 2 and 4). The first field report's case: every PLE layer on a
    # later stage (the incumbent refused any PP > 1, then anything but "all PLE on stage 0").
    "pp2_every_ple_on_stage1": dict(pipeline_parallel_size=2, pp_layer_partition="1,4"),
    "pp2_ple_split_across_stages": dict(pipeline_parallel_size=2),  # stages [0-2], [3-4]
    "pp3_ple_on_middle_and_last": dict(pipeline_parallel_size=3, pp_layer_partition="1,2,2"),
    "tp2_sp": dict(tensor_parallel_size=2, sequence_parallel_moe="on"),
    "dp2_tp2_ep_sp": dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
}


@pytest.fixture(scope="module")
def two_ple_dir(tmp_path_factory):
    return tc.make_qwen4_exp(tmp_path_factory.mktemp("q4_par") / "ckpt", **CONFIGS["hc4_ple2"])


def _run_parallel_case(path, **layout) -> list[list[int]]:
    prompts = make_prompts(7)[1:4]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with _llm(path, max_num_batched_tokens=9, **layout) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def two_ple_single_rank(single_torch_thread, two_ple_dir):
    """The single-rank tokens every layout must give, run once for all of them."""
    return _run_parallel_case(two_ple_dir)


@pytest.mark.parametrize("name", list(PARALLEL_LAYOUTS))
def test_parallel_layout_matches_single_rank(two_ple_dir, two_ple_single_rank, name):
    assert _run_parallel_case(two_ple_dir, **PARALLEL_LAYOUTS[name]) == two_ple_single_rank


@pytest.mark.parametrize("spelling", ["full_attention", "indexed_attention", "qwen_sparse_attention"])
@pytest.mark.parametrize("conditional", [False, True], ids=["causal_lm", "multimodal"])
def test_every_transformers_spelling_of_indexed_layers_loads(tmp_path_factory, spelling, conditional):
    """Real checkpoints, transformers 5.18+ and 5.17 spell the sparse layers differently, and each
    transformers refuses the others' spelling; lamina reads all three whatever is installed (the
    config.json dict is normalised before transformers sees it)."""
    import json
    import shutil

    from lamina.models.qwen4_exp_config import normalise_layer_type_spelling

    src = tc.make_qwen4_exp(tmp_path_factory.mktemp("q4_spell_src") / "ckpt", conditional=conditional)
    path = tmp_path_factory.mktemp(f"q4_spell_{spelling}") / "ckpt"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    part = config["text_config"] if conditional else config
    part["layer_types"] = [t if t == "linear_attention" else spelling for t in part["layer_types"]]
    (path / "config.json").write_text(json.dumps(config))

    assert normalise_layer_type_spelling(json.loads(json.dumps(config))) == (spelling != "full_attention")
    hf_config = read_model_config(path)
    arch = "Qwen4ExpForConditionalGeneration" if conditional else "Qwen4ExpForCausalLM"
    cfg = Qwen4ExpForCausalLM.parse_config(hf_config, arch)
    assert cfg.indexed_attention_layers == (2, 4) and cfg.has_qsa
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = []
    for model in (src, path):
        with _llm(model) as llm:
            outputs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1]


def test_spelling_normaliser_leaves_other_models_alone():
    from lamina.models.qwen4_exp_config import normalise_layer_type_spelling

    config = {"model_type": "qwen3_next", "layer_types": ["linear_attention", "indexed_attention"]}
    assert not normalise_layer_type_spelling(config)
    assert config["layer_types"] == ["linear_attention", "indexed_attention"]

"""Every parallel layout gives the single-rank greedy tokens (CPU, gloo, 2-4 processes).

Prompts are long enough and the token budget small enough that prefills are chunked and mixed
with decodes; generation covers plenty of one-token decode steps. Tokens are compared exactly; a
sequence that differs must still agree with transformers under the near-tie rule (DESIGN.md).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import types

import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.engine.mp_executor import WorkerError, find_free_port
from lamina.parallel.layout import LayoutError, S, tag
from tests.reference import assert_greedy_agrees, load_reference

PROMPT_LENS = (1, 3, 9, 17, 26)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, show_progress=False)


def prompts(seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(0, 990) for _ in range(n)]} for n in PROMPT_LENS]


_single: dict[str, list[list[int]]] = {}


def single_rank_tokens(path) -> list[list[int]]:
    key = str(path)
    if key not in _single:
        with LLM(key, **ENGINE) as llm:
            _single[key] = [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]
    return _single[key]


def run_layout(path, **layout):
    with LLM(str(path), debug_layouts=True, **ENGINE, **layout) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]
        counts = list(llm.engine.step_token_counts)
    return outs, counts


def assert_matches_single_rank(path, outs):
    expected = single_rank_tokens(path)
    differing = [i for i, (a, b) in enumerate(zip(expected, outs)) if a != b]
    if differing:  # allowed only as near-ties of the reference
        ref = load_reference(path)
        for i in differing:
            assert_greedy_agrees(ref, prompts()[i]["prompt_token_ids"], outs[i])
    assert len(differing) <= 1, f"sequences {differing} differ from the single-rank run"


LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "pp3_uneven": dict(pipeline_parallel_size=3, pp_layer_partition="1,3,1"),
    "dp2": dict(data_parallel_size=2),
    "tp2_ep_no_sp": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "tp2_sp_forced_dp1": dict(tensor_parallel_size=2, sequence_parallel_moe="on"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_rank(qwen3_next_dir, name):
    outs, _ = run_layout(qwen3_next_dir, **LAYOUTS[name])
    assert_matches_single_rank(qwen3_next_dir, outs)


def test_dp2_tp2_ep_sp_world4_second_seed_case(qwen3_next_dir):
    """The second field report's setup: EP + SP at DP2 x TP2, with one-token decode steps on a
    replica (T=1 at TP=2) and token counts not divisible by tp."""
    outs, counts = run_layout(qwen3_next_dir, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    assert_matches_single_rank(qwen3_next_dir, outs)
    flat = [t for step in counts for t in step]
    assert 1 in flat, counts
    assert any(t % 2 == 1 and t > 1 for t in flat), counts
    assert any(0 in step and sum(step) > 0 for step in counts), counts  # an idle replica steps too (lockstep)


def test_dp_replicas_draw_their_own_unseeded_noise(qwen3_next_dir):
    """Unseeded sampling draws from each rank's global RNG: each data-parallel replica has its own
    stream, so the same prompt on two replicas does not get the same "random" text; one replica
    draws what a single-rank engine does. The engine restarts the ranks' streams after its GPU
    warm-up (`restart_unseeded_streams`), as a single-rank engine restarts its own: then the same
    requests draw the same text again."""
    prompt = {"prompt_token_ids": [5, 77, 300, 12, 9, 41, 600]}
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def texts(llm, n):
        return [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)]

    with LLM(str(qwen3_next_dir), data_parallel_size=2, **ENGINE) as llm:
        first, second = texts(llm, 2)
        llm.engine.executor.restart_unseeded_streams(llm.engine.args.seed)
        again = texts(llm, 2)
    with LLM(str(qwen3_next_dir), **ENGINE) as one:
        (alone,) = texts(one, 1)
    assert first != second
    assert again == [first, second]
    assert alone in (first, second)


def test_sp_with_mixed_dense_and_moe_layers(qwen3_next_mixed_dir):
    outs, _ = run_layout(qwen3_next_mixed_dir, tensor_parallel_size=2, sequence_parallel_moe="on")
    assert_matches_single_rank(qwen3_next_mixed_dir, outs)


def test_sp_with_ep_on_mixed_dense_model_dp2(qwen3_next_mixed_dir):
    outs, _ = run_layout(qwen3_next_mixed_dir, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    assert_matches_single_rank(qwen3_next_mixed_dir, outs)


def test_sp_with_pp2(qwen3_5_moe_dir):
    outs, _ = run_layout(qwen3_5_moe_dir, tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel_moe="on")
    assert_matches_single_rank(qwen3_5_moe_dir, outs)


def test_wrong_layout_raises_under_layout_checking(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), debug_layouts=True, **ENGINE) as llm:
        model = llm.engine.executor.runner.model
        x = tag(torch.zeros(3, 64), S, model.ctx)  # a sharded tensor where the layer expects R
        with pytest.raises(LayoutError, match="decoder layer 0 input expects layout R but received S"):
            model.layers["0"](x, types.SimpleNamespace(num_tokens=3), None, None)
        with pytest.raises(LayoutError, match="GatedAttention input expects layout R"):
            model.layers["1"].self_attn(x, None, None, None)


def test_killed_rank_raises_not_hangs(qwen3_next_dir):
    llm = LLM(str(qwen3_next_dir), tensor_parallel_size=2, fail_at_step=3, fail_rank=1, **ENGINE)
    procs = list(llm.engine.executor.procs.procs.values())
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.shutdown()
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("mode, timeout_s, error", [
    ("raise", None, "rank 1 failed: RuntimeError: injected failure on rank 1 at step 2"),
    # the first stage waits past the control group's timeout for the last stage's tokens
    ("stall", "5", "longer than LAMINA_DIST_TIMEOUT_S = 5 s for its peers"),
], ids=["raising", "stalled"])
def test_failing_rank_is_named_with_its_error(qwen3_next_dir, monkeypatch, mode, timeout_s, error):
    """A rank whose step raises is named with its error; one that stalls past
    LAMINA_DIST_TIMEOUT_S fails its peers, and the error says which setting to raise."""
    if timeout_s is not None:
        monkeypatch.setenv("LAMINA_DIST_TIMEOUT_S", timeout_s)
    llm = LLM(str(qwen3_next_dir), pipeline_parallel_size=2, fail_at_step=2, fail_rank=1, fail_mode=mode, **ENGINE)
    procs = list(llm.engine.executor.procs.procs.values())
    with pytest.raises(WorkerError, match=error):
        llm.generate(prompts(), PARAMS, use_tqdm=False)
    llm.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_idle_engine_outlives_the_collective_timeout(qwen3_next_dir, monkeypatch):
    """The other ranks wait for rank 0's next command inside a control-group broadcast, which fails
    after the control group's timeout: an engine left idle for longer (a server without traffic)
    lost every rank but 0 (gloo: "Timed out waiting ... for recv operation"). Rank 0 now sends a
    no-op every sixth of the timeout; here the timeout is 8 s and the engine idles 10 s between
    two requests, then 10 s before shutting down."""
    monkeypatch.setenv("LAMINA_DIST_TIMEOUT_S", "8")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM(str(qwen3_next_dir), tensor_parallel_size=2, **ENGINE) as llm:
        procs = llm.engine.executor.procs
        first = llm.generate(prompts()[:2], params, use_tqdm=False)
        time.sleep(10)
        again = llm.generate(prompts()[:2], params, use_tqdm=False)
        time.sleep(10)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert [p.exitcode for p in procs.procs.values()] == [0, 0]  # every rank ended cleanly ("bye"), none timed out


@pytest.mark.parametrize("raw", ["0.5", "soon", "nan", "inf"])
def test_bad_collective_timeout_raises_before_the_ranks_start(qwen3_next_dir, monkeypatch, raw):
    monkeypatch.setenv("LAMINA_DIST_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match=f"LAMINA_DIST_TIMEOUT_S = '{raw}' must be a number of seconds >= 1"):
        LLM(str(qwen3_next_dir), tensor_parallel_size=2, **ENGINE)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_rank_start_methods_give_single_rank_tokens(qwen3_next_dir, method, monkeypatch):
    """Both ways of starting rank processes (`worker_start_method`; the suite runs on forkserver,
    conftest, and the engine's default is spawn) give the single-rank tokens under TP2; then, with
    the processes started the same way, a rank reads the launching process's environment as it is
    at the ranks' start, not as it was when the forkserver started: a bad LAMINA_KERNELS set now
    fails the ranks' model build, naming it."""
    monkeypatch.setenv("LAMINA_WORKER_MULTIPROC_METHOD", method)
    with LLM(str(qwen3_next_dir), debug_layouts=True, tensor_parallel_size=2, **ENGINE) as llm:
        popens = {type(p._popen).__module__ for p in llm.engine.executor.procs.procs.values()}
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]
    assert popens == {{"spawn": "multiprocessing.popen_spawn_posix", "forkserver": "multiprocessing.popen_forkserver"}[method]}, popens
    assert_matches_single_rank(qwen3_next_dir, outs)
    monkeypatch.setenv("LAMINA_KERNELS", "bogus")
    with pytest.raises(WorkerError, match="LAMINA_KERNELS = 'bogus' is not one of"):
        LLM(str(qwen3_next_dir), tensor_parallel_size=2, **ENGINE)


def test_rank_start_method_choice(monkeypatch):
    import importlib.util

    from lamina.engine.mp_executor import FORKSERVER_PRELOAD, _forked_rank_main, worker_start_method

    for name in ("LAMINA_WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.delenv(name, raising=False)
    assert worker_start_method() == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")  # vLLM's spelling
    assert worker_start_method() == "forkserver"
    monkeypatch.setenv("LAMINA_WORKER_MULTIPROC_METHOD", "spawn")  # lamina's wins
    assert worker_start_method() == "spawn"
    monkeypatch.setenv("LAMINA_WORKER_MULTIPROC_METHOD", "fork")
    with pytest.raises(ValueError, match="LAMINA_WORKER_MULTIPROC_METHOD = 'fork': rank processes start by one of "
                                         "spawn, forkserver"):
        worker_start_method()
    monkeypatch.delenv("LAMINA_WORKER_MULTIPROC_METHOD")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # vLLM's default value: spawn, with a warning
    with pytest.warns(UserWarning, match="VLLM_WORKER_MULTIPROC_METHOD = 'fork'"):
        assert worker_start_method() == "spawn"
    for module in FORKSERVER_PRELOAD:  # (a forkserver skips preloads that fail to import)
        assert importlib.util.find_spec(module) is not None, module
    saved = dict(os.environ)
    seen = {}
    handed = {"ONLY": "this", **({"TRITON_INTERPRET": saved["TRITON_INTERPRET"]} if "TRITON_INTERPRET" in saved else {})}
    try:  # a forked rank's entry replaces the environment it inherited with the one it is handed
        _forked_rank_main(lambda *args: seen.update(args=args, env=dict(os.environ)), handed, 1, "two")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert seen == {"args": (1, "two"), "env": handed}
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET = 'other' here but"):
        _forked_rank_main(lambda *args: None, {**handed, "TRITON_INTERPRET": "other"})
    assert os.environ == saved


def test_two_nodes_on_loopback(qwen3_next_dir):
    port = find_free_port()
    common = ["--model", str(qwen3_next_dir), "--device", "cpu", "--dtype", "float32", "-tp", "2", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-num-batched-tokens", "16"]
    node1 = subprocess.Popen([sys.executable, "-m", "lamina.entrypoints.cli", "generate", *common, "--node-rank", "1"],
                             env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with LLM(str(qwen3_next_dir), tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                 master_port=port, **ENGINE) as llm:
            assert len(llm.engine.executor.procs.procs) == 1  # only this node's rank is local
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]
        assert node1.wait(timeout=60) == 0, node1.stderr.read()
    finally:
        if node1.poll() is None:
            node1.kill()
    assert_matches_single_rank(qwen3_next_dir, outs)

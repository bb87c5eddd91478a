"""vLLM's `LLM.collective_rpc`: a ModelRunner method by name or a callable given the runner, on every
rank (one process here; two rank processes under TP2 on the CPU), results in rank order; a rank's
failure raises in the caller and the engine keeps generating."""

from __future__ import annotations

import pytest

from lamina import LLM, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, show_progress=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def tp_rank_and_scale(runner, scale, *, offset=0):
    """Module level, so that it pickles by reference into the rank processes."""
    return runner.model.ctx.tp_rank * scale + offset


def fail_on_rank_one(runner):
    if runner.model.ctx.tp_rank == 1:
        raise ValueError("rank one says no")
    return "ok"


def unpicklable_result(runner):
    return (x for x in range(2))  # a generator does not pickle


def test_in_process(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), **ENGINE) as llm:
        before = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        runner = llm.engine.executor.runner
        assert llm.collective_rpc("paged_cache_bytes_per_block", args=(16,)) == [runner.paged_cache_bytes_per_block(16)]
        assert llm.collective_rpc(tp_rank_and_scale, args=(10,), kwargs={"offset": 3}) == [3]
        # asked after start-up, a slot's state bytes leave the pools in place (generation below still equal)
        assert llm.collective_rpc("state_bytes_per_slot") == [runner.spare_state_bytes] and runner.spare_state_bytes > 0
        assert llm.collective_rpc(lambda runner: runner.block_size) == [llm.engine.args.block_size]
        with pytest.raises(AttributeError, match="no method 'nope'"):
            llm.collective_rpc("nope")
        with pytest.raises(TypeError, match="method name or a callable"):
            llm.collective_rpc(42)
        rid = llm.engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
        with pytest.raises(RuntimeError, match="between generations"):
            llm.collective_rpc("paged_cache_bytes_per_block", args=(16,))
        llm.engine.abort_request(rid)
        after = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert after == before


def test_tensor_parallel_ranks(qwen3_next_dir):
    with LLM(str(qwen3_next_dir), **ENGINE, tensor_parallel_size=2) as llm:
        assert llm.collective_rpc(tp_rank_and_scale, args=(10,), kwargs={"offset": 1}) == [1, 11]
        sizes = llm.collective_rpc("paged_cache_bytes_per_block", args=(16,))
        assert len(sizes) == 2 and sizes[0] == sizes[1] > 0  # each rank's share of the KV heads
        with pytest.raises(RuntimeError, match="collective_rpc failed on rank 1: ValueError: rank one says no"):
            llm.collective_rpc(fail_on_rank_one)
        with pytest.raises(TypeError, match="does not pickle"):
            llm.collective_rpc(lambda runner: 1)
        with pytest.raises(RuntimeError, match="collective_rpc failed on rank 0: .*pickle"):
            llm.collective_rpc(unpicklable_result)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert len(out) == 3  # the ranks kept serving

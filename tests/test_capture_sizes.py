"""vLLM's compilation_config cudagraph_capture_sizes / max_cudagraph_capture_size (in tokens): which
decode and MTP verification steps replay a CUDA graph, and the cap on the prefill / mixed graphs'
tokens (lamina.worker.cuda_graphs.graph_sizes). Larger steps run eagerly, with the same results.

On the CPU the graphs' static buffers run eagerly on the Triton kernels under Triton's interpreter
(`static_off_cuda`), as in tests/test_mixed_graphs.py; on a GPU they are captured.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it before anything imports Triton
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton's interpreter must be on before Triton is imported"

from lamina.config import EngineArgs  # noqa: E402
from lamina.entrypoints.cli_args import expand_argv  # noqa: E402
from lamina.vllm_compat import cudagraph_overrides  # noqa: E402
from lamina.worker.cuda_graphs import capture_sizes, graph_sizes, graph_token_limit  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU the graphs are captured


def test_sizes_count_tokens_as_vllm_does(monkeypatch):
    assert graph_sizes(20) == capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(20, 1, None, 8) == [1, 2, 4, 8]  # only a max: the default sizes up to it
    assert graph_sizes(20, 3, None, 24) == [1, 2, 4, 8]  # 24 tokens hold 8 requests of K + 1 = 3
    assert graph_sizes(20, 1, None, 100) == capture_sizes(20)  # never past max_num_seqs
    assert graph_sizes(4, 1, (1, 3, 6)) == [1, 3, 4]  # 6 requests are more than max_num_seqs: its 4
    assert graph_sizes(4, 1, (512,)) == [4]
    assert graph_sizes(64, 2, (1, 3, 6, 16)) == [1, 3, 8]  # S // Q requests; 1 token holds none of 2
    assert graph_sizes(64, 4, (2,)) == []
    assert graph_sizes(64, 1, None, 0) == []
    assert graph_token_limit((1, 3, 6), None) == 6 and graph_token_limit((8, 1), None) == 8
    assert graph_token_limit(None, 32) == 32
    from lamina.worker.mixed_graphs import capped_tokens, mixed_graph_max_tokens

    assert [capped_tokens(512, limit) for limit in (None, 512, 1000, 300, 16, 15)] == [512, 512, 512, 256, 16, 0]
    assert capped_tokens(0, 64) == 0
    monkeypatch.delenv("LAMINA_MIXED_GRAPHS", raising=False)
    assert mixed_graph_max_tokens(100) == 64  # the memory plan's reserve and the runner's graphs agree
    assert graph_token_limit(None, None) is None


def test_bad_sizes_are_refused_before_loading():
    ok = EngineArgs(model="/m", cudagraph_capture_sizes=[8, 1, 4, 4], max_cudagraph_capture_size=8)
    ok.validate()
    assert ok.cudagraph_capture_sizes == (1, 4, 8)
    for sizes, max_size, match in (
        ([], None, "non-empty list of positive token counts"),
        ([1, 0], None, "0 is not one"),
        ([1, 2.5], None, "2.5 is not one"),
        ("1,2", None, "must be a list"),
        ([1, True], None, "True is not one"),
        ([1, 2, 4], 8, "max_cudagraph_capture_size = 8 differs from the largest of cudagraph_capture_sizes \\(4\\)"),
        (None, -2, "max_cudagraph_capture_size must be a positive integer, got -2"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineArgs(model="/m", cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=max_size).validate()


def test_compilation_config_carries_the_sizes(monkeypatch):
    """From LLM(compilation_config=...), its JSON, a vLLM config object, and `lamina serve -O`
    in its whole-JSON, key-by-key and level forms."""
    from lamina import LLM
    from lamina.entrypoints import llm as llm_module
    from lamina.entrypoints.cli import engine_kwargs

    assert cudagraph_overrides({"cudagraph_capture_sizes": [1, 2, 4]}) == {"cudagraph_capture_sizes": [1, 2, 4]}
    assert cudagraph_overrides('{"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 64}') == {
        "prefill_graphs": False, "max_cudagraph_capture_size": 64}
    config = type("CompilationConfig", (), {"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 8],
                                            "max_cudagraph_capture_size": None})()
    assert cudagraph_overrides(config) == {"cudagraph_capture_sizes": [1, 8]}
    made = []
    monkeypatch.setattr(llm_module, "LLMEngine", lambda args: made.append(args))
    LLM("/m", compilation_config={"max_cudagraph_capture_size": 16})
    assert made[0].max_cudagraph_capture_size == 16 and made[0].cudagraph_capture_sizes is None

    def parsed(*tokens):
        return expand_argv(["serve", "/m", *tokens], {})

    assert parsed("-O.max_cudagraph_capture_size", "64") == ["serve", "/m", "--compilation-config",
                                                             '{"max_cudagraph_capture_size": 64}']
    assert parsed("-O", '{"cudagraph_mode": "NONE"}', "-O.cudagraph_capture_sizes=[1,2]") == [
        "serve", "/m", "--compilation-config", '{"cudagraph_mode": "NONE", "cudagraph_capture_sizes": [1, 2]}']
    assert parsed("--compilation-config.cudagraph_capture_sizes+", "1,2", "-O3") == [
        "serve", "/m", "--compilation-config", '{"cudagraph_capture_sizes": [1, 2], "optimization_level": 3}']
    assert parsed("-O", "3") == ["serve", "/m", "--compilation-config", '{"optimization_level": 3}']
    assert parsed("-O0", "-cc.max_cudagraph_capture_size=8") == [
        "serve", "/m", "--compilation-config", '{"optimization_level": 0, "max_cudagraph_capture_size": 8}']
    assert parsed("-cc", '{"cudagraph_mode": "FULL"}') == ["serve", "/m", "--compilation-config",
                                                           '{"cudagraph_mode": "FULL"}']
    for text in ("-O my god", "-Obvious", "-ccx"):  # free text (a prompt, a stop string) is not an option
        assert expand_argv(["generate", "/m", "--prompt", text], {}) == ["generate", "/m", "--prompt", text]
    with pytest.raises(ValueError, match="--compilation-config is not valid JSON"):
        parsed("-O", "fast")
    # vLLM's optimisation level 0: no CUDA graphs, unless a mode is named; 1-3 keep them
    assert cudagraph_overrides('{"optimization_level": 0}') == {"enforce_eager": True}
    assert cudagraph_overrides(None, 0) == {"enforce_eager": True}
    assert cudagraph_overrides({"cudagraph_mode": "FULL_DECODE_ONLY"}, 0) == {"prefill_graphs": False}
    assert cudagraph_overrides(None, 2) == {} and cudagraph_overrides({"optimization_level": 3}) == {}
    with pytest.raises(ValueError, match="optimization_level 4 is not one of 0, 1, 2, 3"):
        cudagraph_overrides(None, 4)
    LLM("/m", optimization_level=0)
    assert made[-1].enforce_eager
    with pytest.raises(ValueError, match="optimization_level=7 is not supported; valid: 0, 1, 2 or 3"):
        LLM("/m", optimization_level=7)
    serve_args = argparse.Namespace(compilation_config='{"cudagraph_capture_sizes": [1, 2]}', tokenizer=None,
                                    device="cpu", dtype="auto", max_model_len=None, max_num_seqs=None,
                                    max_num_batched_tokens=None, block_size=16, seed=0, num_gpu_blocks_override=None,
                                    gpu_memory_utilization=0.9, ple_table_device="auto", load_format="auto",
                                    enforce_eager=False)
    kwargs = engine_kwargs(serve_args)
    assert kwargs["cudagraph_capture_sizes"] == [1, 2] and kwargs["max_cudagraph_capture_size"] is None
    serve_args.optimization_level, serve_args.compilation_config = 0, None
    assert engine_kwargs(serve_args)["enforce_eager"] is True


def _decode(path, monkeypatch, *, graphs: bool, k: int = 0, **capture):
    """Greedy tokens and logprobs of three requests that finish one after another (decode batches
    of 3, 2 and 1); with `graphs`, through the decode graphs of `capture`'s sizes (static buffers on
    the CPU), or with `k` > 0 MTP's verification graphs. Returns (results, graph sizes (decode) or
    keys (verification), the model runner)."""
    from lamina import LLM, SamplingParams

    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    prompts = [[5, 17, 300], [9] * 6, list(range(40, 49))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (3, 5, 7)]
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
    with LLM(str(path), device=DEVICE, dtype="float32", show_progress=False, enforce_eager=True, max_num_seqs=4,
             **spec) as llm:
        runner = llm.engine.executor.runner
        sizes = []
        if graphs:
            assert runner.capture_decode_graphs(llm.engine.max_num_seqs, llm.engine.max_model_len, static_off_cuda=True,
                                                num_speculative_tokens=k, **capture)
            sizes = sorted(runner.verify_graphs.graphs) if k else sorted(runner.decode_graphs.graphs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = [(o.outputs[0].token_ids, [float(next(iter(d.values()))) for d in o.outputs[0].logprobs]) for o in outs]
    return results, sizes, runner


def test_steps_past_the_largest_size_run_eagerly(qwen3_5_moe_short_dir, monkeypatch):
    """Sizes 1 and 2 of max_num_seqs 4: a decode of three requests runs eagerly, those of two and
    one replay; the tokens and logprobs are the eager run's."""
    eager, _, _ = _decode(qwen3_5_moe_short_dir, monkeypatch, graphs=False)
    ours, sizes, runner = _decode(qwen3_5_moe_short_dir, monkeypatch, graphs=True, capture_sizes=(1, 2))
    assert sizes == [1, 2]
    assert runner.graph_replays == 2 + 2, runner.graph_replays  # 2 decodes of three requests eager; 2 of two, 2 of one replayed
    for (eager_ids, eager_lp), (ids, lp) in zip(eager, ours):
        assert ids == eager_ids
        torch.testing.assert_close(lp, eager_lp, atol=1e-4, rtol=0)


def test_sizes_shrink_the_verification_state_buffers(mtp_short_dir, monkeypatch):
    """The verify graphs' state capture rows follow the capture sizes (at K = 3, 8 tokens at most:
    6 rows instead of 192), as the memory plan's reserve does; MTP K = 2 under a 6-token cap (3
    requests of 2 tokens, 2 of 3: 4 rows instead of 8) gives the eager run's tokens and logprobs."""
    from lamina.worker.verify_graphs import verify_state_rows

    monkeypatch.delenv("LAMINA_VERIFY_GRAPH_MAX_BATCH", raising=False)
    assert verify_state_rows(256, 3) == 64 * 3
    assert verify_state_rows(256, 3, None, 8) == 2 * 3  # Q = 4: two requests; Q = 2: four requests, one row each
    assert verify_state_rows(256, 1, (1, 2, 4, 512)) == 64  # 512 tokens: 256 requests of 2, past the 64 cap
    assert verify_state_rows(256, 2, (2,)) == 1 and verify_state_rows(256, 2, (1,)) == 0
    assert verify_state_rows(256, 0) == 0 and verify_state_rows(4, 2) == 8
    eager, _, _ = _decode(mtp_short_dir, monkeypatch, graphs=False, k=2)
    ours, keys, runner = _decode(mtp_short_dir, monkeypatch, graphs=True, k=2, max_capture_size=6)
    assert keys == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2)], keys
    assert runner.verify_graphs.buffers.capacity == 4  # was max_num_seqs 4 * K 2 = 8
    assert runner.graph_replays > 0
    for (eager_ids, eager_lp), (ids, lp) in zip(eager, ours):
        assert ids == eager_ids
        torch.testing.assert_close(lp, eager_lp, atol=1e-4, rtol=0)


def test_sizes_shape_the_verify_and_mixed_graphs(mtp_short_dir, qwen3_5_moe_short_dir, monkeypatch):
    """MTP K = 1: sizes of 2 and 4 tokens are graphs of 2 and 4 one-token requests and of 1 and 2
    two-token verifications. A max of 20 tokens caps the mixed graphs at 16; one of 8 leaves none."""
    from lamina import LLM

    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with LLM(str(mtp_short_dir), device=DEVICE, dtype="float32", show_progress=False, enforce_eager=True,
             max_num_seqs=4, speculative_config=spec) as llm:
        runner = llm.engine.executor.runner
        assert runner.capture_decode_graphs(4, llm.engine.max_model_len, num_speculative_tokens=1, static_off_cuda=True,
                                            capture_sizes=(2, 4))
        assert sorted(runner.verify_graphs.graphs) == [(1, 2), (1, 4), (2, 1), (2, 2)]
    with LLM(str(qwen3_5_moe_short_dir), device=DEVICE, dtype="float32", show_progress=False, enforce_eager=True,
             max_num_seqs=4) as llm:
        runner = llm.engine.executor.runner
        for max_size, mixed in ((20, 16), (8, None)):
            assert runner.capture_decode_graphs(4, llm.engine.max_model_len, static_off_cuda=True, mixed_max_tokens=512,
                                                max_capture_size=max_size)
            assert sorted(runner.decode_graphs.graphs) == capture_sizes(4 if max_size > 4 else max_size)
            if mixed is None:
                assert runner.mixed_graphs is None and "below 16" in runner.no_mixed_graphs_reason
            else:
                assert runner.mixed_graphs.max_tokens == mixed
        assert runner.capture_decode_graphs(4, llm.engine.max_model_len, static_off_cuda=True, capture_sizes=(8,))
        assert sorted(runner.decode_graphs.graphs) == [4]  # 8 requests' size serves max_num_seqs

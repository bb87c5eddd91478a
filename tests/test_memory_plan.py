"""The GPU memory plan (lamina.engine.memory_plan) and its use by the engine: recurrent states,
speculation and activations counted before the KV cache, a default max_num_seqs lowered to what
fits, an explicit one refused with every figure. CPU only: the engine's CUDA branch runs against a
stand-in executor that reports an H100's figures."""

from __future__ import annotations

import types

import pytest
import torch

from lamina.engine import llm_engine
from lamina.engine.llm_engine import LLMEngine
from lamina.engine.memory_plan import GIB, MIB, activation_headroom_bytes, plan_gpu_memory
from lamina.entrypoints.presets import DEFAULT_PRESET, preset_dir
from lamina.models.registry import resolve_model_class
from lamina.worker.model_loader import read_model_config

STATE = 61 * MIB + 410 * 1024  # a Qwen3.5-35B-A3B request's states (30 delta-net layers, session 30: 1.979 GiB / 33 slots)
BLOCK = 10 * 2 * 2 * 256 * 16 * 2  # its 10 attention layers' K and V, 2 KV heads of 256, 16 tokens, bf16


def _plan(**over):
    args = dict(usable_bytes=6 * GIB, bytes_per_block=BLOCK, block_size=16, max_model_len=2048, max_num_seqs=256,
                max_num_seqs_is_default=True, state_bytes_per_slot=STATE, speculation_bytes=lambda n: 0,
                activation_bytes=lambda n: GIB + n * 16 * MIB)
    args.update(over)
    return plan_gpu_memory(**args)


def test_everything_fits_takes_the_kv_cache_the_sequences_need():
    plan = _plan(usable_bytes=60 * GIB, max_num_seqs=64)
    assert (plan.max_num_seqs, plan.lowered_from) == (64, None)
    assert plan.num_kv_blocks == 64 * 2048 // 16  # capped at max_num_seqs full sequences, not the rest of the memory
    assert plan.state_bytes == 65 * STATE and plan.activation_bytes == GIB + 64 * 16 * MIB
    tight = _plan(usable_bytes=8 * GIB, max_num_seqs=64)  # the rest of 8 GiB goes to the KV cache
    assert tight.num_kv_blocks == (8 * GIB - 65 * STATE - GIB - 64 * 16 * MIB) // BLOCK < 64 * 128
    assert tight.state_bytes + tight.activation_bytes + tight.kv_cache_bytes <= 8 * GIB


def _balanced(n, usable=6 * GIB):  # _plan's defaults: states at most half of what the headroom leaves
    return 2 * (n + 1) * STATE <= usable - (GIB + n * 16 * MIB)


def _whole_lengths(n, usable=6 * GIB, blocks=128):  # n requests with KV for all of them at max_model_len
    return (n + 1) * STATE + GIB + n * 16 * MIB + n * blocks * BLOCK <= usable


def test_a_default_max_num_seqs_is_lowered_so_states_and_kv_cache_share_the_memory():
    plan = _plan()  # 256 requests' states alone are 15.4 GiB of 6 usable (an H100 after the weights)
    assert plan.lowered_from == 256 and 1 <= plan.max_num_seqs < 256
    n = plan.max_num_seqs
    assert _balanced(n) or _whole_lengths(n)  # one of the two rules holds ...
    assert not _balanced(n + 1) and not _whole_lengths(n + 1)  # ... and neither would for one more request
    left = 6 * GIB - plan.activation_bytes
    # the KV cache: the rest, or the requests' whole lengths if less
    assert plan.num_kv_blocks == min(n * 128, (left - plan.state_bytes) // BLOCK) >= 128
    # short sequences: as many requests as fit with their whole lengths, past the balanced rule's
    short = _plan(max_model_len=256)
    assert short.max_num_seqs > n and _whole_lengths(short.max_num_seqs, blocks=16)
    assert not _balanced(short.max_num_seqs) and short.num_kv_blocks == short.max_num_seqs * 16
    # long ones: the balanced rule, the KV cache the rest
    long = _plan(max_model_len=65536)
    assert _balanced(long.max_num_seqs) and not _balanced(long.max_num_seqs + 1)
    # when the balanced rule does not hold even for one request: one request, which fits
    one = _plan(usable_bytes=GIB + 16 * MIB + 2 * STATE + 128 * BLOCK + MIB, activation_bytes=lambda n: GIB + n * 16 * MIB)
    assert one.max_num_seqs == 1 and one.num_kv_blocks >= 128
    assert _plan(max_num_seqs=1, max_num_seqs_is_default=False, usable_bytes=2 * GIB).max_num_seqs == 1


def test_an_explicit_max_num_seqs_that_does_not_fit_names_the_most_that_do():
    with pytest.raises(ValueError) as err:
        _plan(max_num_seqs=128, max_num_seqs_is_default=False)
    message = str(err.value)
    assert "max_num_seqs = 128 needs 61.4 MiB of recurrent state per request" in message
    most = int(message.split("At most max_num_seqs = ")[1].split(" ")[0])
    assert _plan(max_num_seqs=most, max_num_seqs_is_default=False).max_num_seqs == most
    with pytest.raises(ValueError, match="At most"):
        _plan(max_num_seqs=most + 1, max_num_seqs_is_default=False)
    assert _plan(max_num_seqs=most, max_num_seqs_is_default=False).num_kv_blocks >= 128  # one whole sequence


def test_nothing_fits_says_so_default_or_not():
    for default in (True, False):
        with pytest.raises(ValueError, match="Not even one request fits: lower max_model_len"):
            _plan(max_model_len=262144, max_num_seqs_is_default=default)  # 5 GiB of KV for one sequence, 6 usable


def test_speculation_counts_per_request():
    plain = _plan(max_num_seqs=32, max_model_len=8192)  # the KV cache takes what is left (2.5 of 5 GiB wanted)
    spec = _plan(max_num_seqs=32, max_model_len=8192, speculation_bytes=lambda n: n * 8 * MIB)
    assert spec.speculation_bytes == 32 * 8 * MIB
    assert abs(plain.kv_cache_bytes - spec.kv_cache_bytes - 32 * 8 * MIB) < BLOCK


def _preset_config():
    hf = read_model_config(preset_dir(DEFAULT_PRESET))
    architecture, model_cls = resolve_model_class(hf)
    return model_cls.parse_config(hf, architecture)


def test_headroom_covers_the_activation_peaks_measured_on_an_h100():
    """benchmarks/results/memory_peak_h100_s30.json, bf16: the peak over what stays allocated of a
    whole-budget prefill step (0.24 / 0.95 / 1.89 GiB at 2k / 8k / 16k tokens) and of decode at
    max_num_seqs (0.51 GiB at 64, plus 0.27 GiB of graph pools and buffers allocated at start)."""
    cfg = _preset_config()
    for tokens, peak in ((2048, 0.237), (8192, 0.947), (16384, 1.894)):
        assert activation_headroom_bytes(cfg, 2, tokens, 1) > 1.2 * peak * GIB
    assert activation_headroom_bytes(cfg, 2, 2048, 64) > 1.2 * (0.51 + 0.27) * GIB
    fixed = 512 * MIB  # MTP: (K + 1) rows a request, where decode's rows are the larger part
    assert activation_headroom_bytes(cfg, 2, 2048, 64, 3) - fixed == 4 * (activation_headroom_bytes(cfg, 2, 2048, 64) - fixed)
    assert activation_headroom_bytes(cfg, 2, 8192, 256) < 5 * GIB  # not so wide that an H200 loses its KV cache
    # the prefill / mixed steps' graphs: their largest bucket's activations (a 512-token prefill's) and two
    # vocabulary rows (float32 and bf16 logits) a request row, max_num_seqs + 1 of them
    mixed = activation_headroom_bytes(cfg, 2, 8192, 256, 0, 512) - activation_headroom_bytes(cfg, 2, 8192, 256)
    prefill_512 = activation_headroom_bytes(cfg, 2, 512, 0) - fixed  # no decode rows: the prefill part alone
    assert mixed == prefill_512 + 2 * 4 * cfg.vocab_size * 257
    assert 0.5 * GIB < mixed < 0.7 * GIB
    # MTP: the graphs end at the final hidden states (no logits buffer): a [512, hidden] buffer instead
    mtp_mixed = activation_headroom_bytes(cfg, 2, 8192, 256, 2, 512) - activation_headroom_bytes(cfg, 2, 8192, 256, 2)
    assert mtp_mixed == prefill_512 + 2 * cfg.hidden_size * 512


class _FakeExecutor:
    """An H100 after the Qwen3.5-35B-A3B weights: 13.9 GiB free of 79.2."""

    def min_free_bytes(self):
        return int(13.9 * GIB)

    def bytes_per_block(self, block_size):
        return BLOCK * block_size // 16

    def state_bytes_per_slot(self):
        return STATE


def _fake_engine(max_num_seqs=None, spec_config=None, kv_cache_dtype=None, fp8_kv_cache_possible=False, **over):
    args = dict(block_size=16, num_gpu_blocks_override=None, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9,
                max_num_seqs=max_num_seqs, enforce_eager=True, max_model_len=None)
    args.update(over)
    engine = types.SimpleNamespace(
        args=types.SimpleNamespace(**args),
        max_model_len=2048, device=torch.device("cuda"), spec_config=spec_config, executor=_FakeExecutor(),
        model_config=_preset_config(), dtype=torch.bfloat16, ssm_state_dtype=torch.float32,
        kv_cache_dtype=kv_cache_dtype or torch.bfloat16, fp8_kv_cache_possible=fp8_kv_cache_possible,
    )
    engine._speculation_reserve = types.MethodType(LLMEngine._speculation_reserve, engine)
    engine._fit_max_model_len = types.MethodType(LLMEngine._fit_max_model_len, engine)
    return engine


@pytest.fixture
def h100(monkeypatch):
    props = types.SimpleNamespace(total_memory=int(79.18 * GIB))
    monkeypatch.setattr(llm_engine.torch.cuda, "get_device_properties", lambda device: props)


def test_engine_plans_an_h100_default_instead_of_running_out(h100, caplog):
    engine = _fake_engine()
    with caplog.at_level("WARNING"):
        num_blocks, seqs = LLMEngine._num_kv_blocks(engine, 256, 8192)
    assert 16 <= seqs < 64 and engine.memory_plan.lowered_from == 256
    assert "max_num_seqs lowered from its default 256" in caplog.text
    assert "or keep the recurrent states in bfloat16 (mamba_ssm_cache_dtype='bfloat16'" in caplog.text
    usable = 13.9 * GIB - 0.1 * 79.18 * GIB
    assert engine.memory_plan.state_bytes + engine.memory_plan.activation_bytes + num_blocks * BLOCK <= usable
    assert num_blocks >= seqs * 128 // 2  # the KV cache holds half of the requests' full lengths at least


def test_engine_refuses_an_explicit_max_num_seqs_the_gpu_cannot_hold(h100):
    with pytest.raises(ValueError, match=r"max_num_seqs = 256 needs .* At most max_num_seqs = \d+ fit.*raise "
                                         r"gpu_memory_utilization, or keep the recurrent states in bfloat16"):
        LLMEngine._num_kv_blocks(_fake_engine(max_num_seqs=256), 256, 8192)
    bf16 = _fake_engine(max_num_seqs=256)
    bf16.ssm_state_dtype = torch.bfloat16  # already 16-bit: nothing to suggest
    with pytest.raises(ValueError, match=r"raise gpu_memory_utilization$"):
        LLMEngine._num_kv_blocks(bf16, 256, 8192)
    num_blocks, seqs = LLMEngine._num_kv_blocks(_fake_engine(max_num_seqs=32), 32, 8192)
    assert seqs == 32 and num_blocks == 32 * 128  # 32 fit with their whole lengths
    # on a GPU with FP8 and a 16-bit KV cache, the FP8 cache is named too; not once the cache is FP8
    fp8_gpu = _fake_engine(max_num_seqs=256, kv_cache_dtype=torch.bfloat16, fp8_kv_cache_possible=True)
    fp8_gpu.ssm_state_dtype = torch.bfloat16
    with pytest.raises(ValueError, match=r"raise gpu_memory_utilization, or keep the KV cache in FP8 "
                                         r"\(kv_cache_dtype='fp8': half its bytes or less\)$"):
        LLMEngine._num_kv_blocks(fp8_gpu, 256, 8192)
    fp8_gpu.kv_cache_dtype = torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"raise gpu_memory_utilization$"):
        LLMEngine._num_kv_blocks(fp8_gpu, 256, 8192)


def test_a_given_kv_size_skips_the_plan(h100):
    engine = _fake_engine(max_num_seqs=256, kv_cache_memory_bytes=1024 * BLOCK)
    assert LLMEngine._num_kv_blocks(engine, 256, 8192) == (1024, 256)
    assert not hasattr(engine, "memory_plan")
    engine = _fake_engine(max_num_seqs=256, num_gpu_blocks_override=700)
    assert LLMEngine._num_kv_blocks(engine, 256, 8192) == (700, 256) and not hasattr(engine, "memory_plan")


def test_engine_plan_counts_mtp(h100):
    from lamina.engine.spec_decode import SpeculativeConfig

    plain = _fake_engine(max_num_seqs=16)
    LLMEngine._num_kv_blocks(plain, 16, 8192)
    spec = _fake_engine(max_num_seqs=16, spec_config=SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2}))
    LLMEngine._num_kv_blocks(spec, 16, 8192)
    vocab = spec.model_config.vocab_size
    assert spec.memory_plan.speculation_bytes == 16 * 2 * (STATE + 4 * vocab)  # eager: no verify graphs' rows
    assert spec.memory_plan.activation_bytes > plain.memory_plan.activation_bytes  # (K + 1) rows a request
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    LLMEngine._num_kv_blocks(_fake_engine(max_num_seqs=48), 48, 8192)  # fits without MTP ...
    with pytest.raises(ValueError, match=r"max_num_seqs = 48 needs .* speculation 5.\d\d GiB"):  # ... not with it
        LLMEngine._num_kv_blocks(_fake_engine(max_num_seqs=48, spec_config=SpeculativeConfig.parse(mtp)), 48, 8192)


def test_engine_plan_counts_the_verify_graphs_rows_its_capture_sizes_keep(h100, monkeypatch):
    """With verification graphs, the reserve holds their state capture rows: max_num_seqs 16 * K 2
    = 32 rows; under vLLM's max_cudagraph_capture_size 8 (4 requests of 2 tokens, 2 of 3) 4 rows."""
    from lamina.engine.spec_decode import SpeculativeConfig
    from lamina.worker import cuda_graphs

    monkeypatch.delenv("LAMINA_VERIFY_GRAPH_MAX_BATCH", raising=False)
    monkeypatch.setattr(cuda_graphs, "model_is_capturable", lambda model, verify: True)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    vocab = _preset_config().vocab_size
    for max_size, rows in ((None, 32), (8, 4)):
        engine = _fake_engine(max_num_seqs=16, spec_config=SpeculativeConfig.parse(mtp), enforce_eager=False,
                              cudagraph_capture_sizes=None, max_cudagraph_capture_size=max_size)
        engine.parallel_config = types.SimpleNamespace(is_single_rank=True)
        engine.executor.runner = types.SimpleNamespace(model=None)
        assert engine._speculation_reserve(16) == 16 * 2 * (STATE + 4 * vocab) + rows * STATE


def test_out_of_memory_at_start_up_names_the_plan_and_shuts_down():
    shut = []
    engine = _fake_engine()
    engine.executor.shutdown = lambda: shut.append(True)
    engine.memory_plan = _plan()
    with pytest.raises(RuntimeError, match=r"out of GPU memory while warming up \(memory plan: 6.00 GiB usable: "
                                           r"recurrent states .*requests of max_model_len = 2048 at once\)\): lower "
                                           r"max_num_seqs, max_num_batched_tokens or gpu_memory_utilization \(= 0.9\)"):
        with LLMEngine._out_of_memory_explained(engine, "warming up"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 130.00 MiB")
    assert shut == [True]
    from lamina.engine.mp_executor import WorkerError

    rank_error = WorkerError("rank 1 failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 514.00 MiB\n...")
    with pytest.raises(RuntimeError, match="out of GPU memory while capturing") as info:  # from a rank process
        with LLMEngine._out_of_memory_explained(engine, "capturing"):
            raise rank_error
    assert info.value.__cause__ is rank_error and shut == [True, True]
    other = WorkerError("rank 1 failed: ValueError: bad")
    with pytest.raises(WorkerError) as info:
        with LLMEngine._out_of_memory_explained(engine, "capturing"):
            raise other
    assert info.value is other and shut == [True, True]
    with pytest.raises(KeyError):  # other errors pass through untouched
        with LLMEngine._out_of_memory_explained(engine, "warming up"):
            raise KeyError("x")


def test_bench_latency_warns_when_its_batch_does_not_fit_the_kv_cache(capsys):
    from lamina.entrypoints.bench import _warn_if_preempting

    engine = types.SimpleNamespace(args=types.SimpleNamespace(block_size=16), num_kv_blocks=130)
    _warn_if_preempting(engine, 10, 208)  # 10 x 13 blocks: fits
    assert capsys.readouterr().err == ""
    _warn_if_preempting(engine, 64, 208)
    assert "the KV cache holds 2080 tokens, fewer than batch 64 x 208 tokens" in capsys.readouterr().err


def _plan_json(capsys, *flags):
    import json

    from lamina.entrypoints.cli import main as cli_main

    assert cli_main(["plan", str(preset_dir(DEFAULT_PRESET)), "--dtype", "bfloat16", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_lamina_plan_previews_the_memory_plan_on_a_given_gpu(capsys):
    """`lamina plan --gpu-memory-gib`: the engine's plan from config.json alone. On the H100 of
    session 30 the engine itself found 5.77 GiB usable (memory_peak_h100_s30.json)."""
    one = _plan_json(capsys, "--gpu-memory-gib", "79.18", "--max-model-len", "2048")["ranks"][0]["gpu_memory"]
    assert one["fits"] and one["max_num_seqs_lowered_from"] == 256 and 32 <= one["max_num_seqs"] <= 48
    assert 5.5 * GIB < one["usable_bytes"] < 5.9 * GIB and one["kv_cache_tokens"] == one["max_num_seqs"] * 2048
    tp2 = _plan_json(capsys, "--gpu-memory-gib", "79.18", "--max-model-len", "2048", "-tp", "2")["ranks"]
    assert [r["gpu_memory"]["max_num_seqs"] for r in tp2] == [256, 256]  # half the weights and states a rank
    refused = _plan_json(capsys, "--gpu-memory-gib", "79.18", "--max-num-seqs", "128")["ranks"][0]["gpu_memory"]
    assert not refused["fits"] and "At most max_num_seqs = " in refused["error"]
    h200 = _plan_json(capsys, "--gpu-memory-gib", "139.8", "--max-model-len", "2048")["ranks"][0]["gpu_memory"]
    assert h200["max_num_seqs"] == 256 and h200["max_num_seqs_lowered_from"] is None
    assert "gpu_memory" not in _plan_json(capsys)["ranks"][0]


def test_lamina_plan_previews_fp8_experts_as_a_gpu_keeps_them(capsys, monkeypatch):
    """Previewing a GPU from a machine without one: the experts of an FP8 model stay FP8 on a GPU
    engine's kernel set (session 44 on an H100: 256 requests at a 262k max_model_len ran with
    --quantization fp8), so half their bytes are counted; without triton installed (the layers of
    that kernel set import it) they are counted dequantized, as before."""
    from lamina.entrypoints import plan_cmd

    flags = ("--quantization", "fp8", "--gpu-memory-gib", "79.2", "--max-num-seqs", "256", "--max-model-len", "32768")
    kept = _plan_json(capsys, *flags)["ranks"][0]
    bf16 = _plan_json(capsys, *flags[2:])["ranks"][0]
    assert kept["gpu_memory"]["fits"] and kept["gpu_memory"]["max_num_seqs"] == 256
    assert kept["estimate"]["weight_bytes"] < 0.6 * bf16["estimate"]["weight_bytes"]
    assert not bf16["gpu_memory"]["fits"]
    cpu = _plan_json(capsys, *flags, "--device", "cpu")["ranks"][0]  # a CPU engine dequantizes them
    assert cpu["estimate"]["weight_bytes"] == bf16["estimate"]["weight_bytes"]
    real_find_spec = plan_cmd.importlib.util.find_spec
    monkeypatch.setattr(plan_cmd.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    assert _plan_json(capsys, *flags)["ranks"][0]["estimate"]["weight_bytes"] == bf16["estimate"]["weight_bytes"]


def test_lamina_plan_counts_the_verify_graphs_rows_its_capture_sizes_keep(capsys, monkeypatch):
    """MTP K = 3 at 64 requests: the verification graphs' state capture rows are 64 x 3 (~11.5 GiB
    of float32 states on this model); under vLLM's max_cudagraph_capture_size 8 (-cc key by key, as
    `lamina plan` now takes it) 6, and the KV cache gets the difference."""
    monkeypatch.delenv("LAMINA_VERIFY_GRAPH_MAX_BATCH", raising=False)
    flags = ("--load-format", "dummy", "--hf-overrides", '{"mtp_num_hidden_layers": 1}', "--speculative-config",
             '{"method": "mtp", "num_speculative_tokens": 3}', "--gpu-memory-gib", "141", "--max-num-seqs", "64")
    full, capped = (_plan_json(capsys, *flags, *more)["ranks"][0] for more in ((), ("-cc.max_cudagraph_capture_size", "8")))
    per_slot = full["estimate"]["state_bytes_per_request"]
    full, capped = full["gpu_memory"], capped["gpu_memory"]
    assert full["speculation_bytes"] - capped["speculation_bytes"] == (64 * 3 - 6) * per_slot
    assert capped["kv_cache_bytes"] - full["kv_cache_bytes"] > 0.95 * (64 * 3 - 6) * per_slot
    assert 11 * GIB < 64 * 3 * per_slot < 12 * GIB


def test_lamina_plan_refuses_a_bad_gpu_size(capsys):
    from lamina.entrypoints.cli import main as cli_main

    assert cli_main(["plan", str(preset_dir(DEFAULT_PRESET)), "--gpu-memory-gib", "0"]) == 2
    assert "--gpu-memory-gib must be positive, got 0.0" in capsys.readouterr().err


def test_bench_latency_says_where_a_refused_max_num_seqs_came_from(monkeypatch):
    import argparse

    from lamina.entrypoints import bench
    import lamina

    def refuse(model, **kwargs):
        raise ValueError(f"max_num_seqs = {kwargs['max_num_seqs']} needs 61.4 MiB ... At most max_num_seqs = 60 fit")

    monkeypatch.setattr(lamina, "LLM", refuse)
    args = argparse.Namespace(batch_size=[1, 64], input_len=128, output_len=64, device="cpu")
    monkeypatch.setattr(bench, "_engine_kwargs", lambda a: {"max_num_seqs": None})
    with pytest.raises(ValueError, match=r"At most max_num_seqs = 60 fit \(bench latency sets max_num_seqs to the "
                                         r"largest --batch-size, 64\)"):
        bench.run_latency(args, "model")
    monkeypatch.setattr(bench, "_engine_kwargs", lambda a: {"max_num_seqs": 64})  # the user's own: no note
    with pytest.raises(ValueError) as info:
        bench.run_latency(args, "model")
    assert "bench latency sets" not in str(info.value)

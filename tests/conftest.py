import os

import torch

# lamina's Triton kernels run under Triton's CPU interpreter where there is no GPU. Triton reads
# this when it is first imported (other packages import it too, e.g. xgrammar), so it is set here,
# before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests import tiny_checkpoints as tc  # noqa: E402
from tests import triton_interpreter  # noqa: E402

# On the CPU, rank processes fork from one server that has imported torch, transformers and lamina
# once (the engine's default, spawn, imports them in every rank: seconds per rank, hundreds of ranks
# in the suite); test_parallel_layouts.py checks both start methods. GPU runs keep spawn, the
# engine's default: forkserver has not been run with GPU ranks.
if not torch.cuda.is_available():
    os.environ.setdefault("LAMINA_WORKER_MULTIPROC_METHOD", "forkserver")

# Triton's interpreter without its re-patching at every call of a jitted helper (same results, about
# half the interpreted time: tests/triton_interpreter.py), here and in the rank processes the engine spawns.
if triton_interpreter.install():
    from lamina.engine import mp_executor

    mp_executor.worker_main = triton_interpreter.worker_main


@pytest.fixture(scope="module")
def single_torch_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("single_torch_thread")`):
    the tiny models run faster so, far faster on a busy machine, and float32 CPU GEMMs of one thread
    are the same whatever else runs."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def qwen3_next_dir(tmp_path_factory):
    return tc.make_qwen3_next(tmp_path_factory.mktemp("q3next") / "ckpt")


@pytest.fixture(scope="session")
def qwen3_next_mixed_dir(tmp_path_factory):
    return tc.make_qwen3_next(tmp_path_factory.mktemp("q3next_mixed") / "ckpt", mixed_dense=True, seed=3)


@pytest.fixture(scope="session")
def qwen3_5_moe_dir(tmp_path_factory):
    return tc.make_qwen3_5_moe(tmp_path_factory.mktemp("q35") / "ckpt")


@pytest.fixture(scope="session")
def qwen3_5_moe_short_dir(tmp_path_factory):
    """Qwen3.5-MoE at three layers (tc.SHORT_LAYER_TYPES: delta net, attention, delta net): the
    engine tests on the Triton kernel set, which the CPU runs under Triton's interpreter, one
    interpreted launch per kernel and layer."""
    return tc.make_qwen3_5_moe(tmp_path_factory.mktemp("q35short") / "ckpt", layer_types=tc.SHORT_LAYER_TYPES)


@pytest.fixture(scope="session")
def mtp_short_dir(tmp_path_factory, qwen3_5_moe_short_dir):
    """The three-layer Qwen3.5-MoE with MTP weights: the MTP tests that run the Triton kernels under
    the interpreter on the CPU, where every layer's launches are interpreted."""
    import shutil

    return tc.add_mtp_weights(shutil.copytree(qwen3_5_moe_short_dir, tmp_path_factory.mktemp("mtp_short") / "q35"),
                              fused_experts=True)


@pytest.fixture(scope="session")
def qwen3_5_moe_vl_dir(tmp_path_factory):
    return tc.make_qwen3_5_moe_vl(tmp_path_factory.mktemp("q35vl") / "ckpt")


@pytest.fixture(scope="session")
def qwen3_next_fused_dir(tmp_path_factory, qwen3_next_dir):
    return tc.fuse_experts_copy(qwen3_next_dir, tmp_path_factory.mktemp("q3next_fused") / "ckpt")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests need CUDA: skipped where there is none (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

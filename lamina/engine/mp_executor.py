"""One process per rank on this node; commands go to rank 0, which broadcasts them.

The executor watches every local process: if one exits or reports an error, `execute` raises an
error naming the rank within about a second, and every child is terminated (nothing hangs).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import atexit
import contextlib
import os
import socket
import sys
import time
import warnings

from lamina.engine.setup import EngineSetup, resolve_setup
from lamina.parallel.distributed import timeout_from_env
from lamina.step_plan import SampledToken, StepPlan
from lamina.worker.rpc import check_picklable, raise_failures
from lamina.worker.worker import WorkerSpec, worker_main


class WorkerError(RuntimeError):
    """A rank died or raised; the message names it."""


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _main_module_hidden():
    """Spawned children re-import the parent's `__main__` script unless told not to; our workers
    need nothing from it, so user scripts need no `if __name__ == "__main__"` guard."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    try:
        if "__file__" in saved:
            delattr(main, "__file__")
        if main is not None:
            main.__spec__ = None
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


START_METHODS = ("spawn", "forkserver")
# What a forkserver imports once, before it forks rank processes: the worker and what it builds.
FORKSERVER_PRELOAD = ["lamina.worker.worker", "lamina.worker.model_loader", "lamina.worker.model_runner"]


def worker_start_method() -> str:
    """How rank processes start: `LAMINA_WORKER_MULTIPROC_METHOD` (or vLLM's
    `VLLM_WORKER_MULTIPROC_METHOD`), "spawn" by default: a fresh interpreter per rank. "forkserver":
    each rank forks from one server process that has imported torch, transformers and lamina's
    worker once (FORKSERVER_PRELOAD), so a rank starts in a fraction of a second rather than
    seconds (the test suite starts hundreds). A forked rank is handed this process's environment
    at its start, as a spawned one inherits it; what torch, Triton or transformers read from the
    environment when they are imported is the server's, fixed when it started (the first
    executor of this process); a forked rank refuses a TRITON_INTERPRET other than the server's.
    LAMINA_WORKER_MULTIPROC_METHOD="fork" is refused (an engine that has initialised CUDA cannot
    fork); vLLM's variable, whose values are "fork" (its default) and "spawn", is honoured when it
    says "forkserver" or "spawn", and any other value of it gives spawn with a warning."""
    method = os.environ.get("LAMINA_WORKER_MULTIPROC_METHOD")
    if method is not None:
        if method not in START_METHODS:
            raise ValueError(f"LAMINA_WORKER_MULTIPROC_METHOD = {method!r}: rank processes start by one of "
                             f"{', '.join(START_METHODS)}")
        return method
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if method is not None and method not in START_METHODS:
        warnings.warn(f"VLLM_WORKER_MULTIPROC_METHOD = {method!r}: lamina starts rank processes by "
                      f"{' or '.join(START_METHODS)}; spawning them", stacklevel=2)
        return "spawn"
    return method or "spawn"


def _forked_rank_main(entry, environment: dict, *args) -> None:
    """A forkserver rank's entry: the launching process's environment at its start (a spawned rank
    inherits it; a forked one would have the server's), then `entry(*args)`. Triton chose between
    its interpreter and its compiler when the server imported it, so the launching process must
    agree with the server on TRITON_INTERPRET."""
    if environment.get("TRITON_INTERPRET") != os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError(f"TRITON_INTERPRET = {environment.get('TRITON_INTERPRET')!r} here but "
                           f"{os.environ.get('TRITON_INTERPRET')!r} in the forkserver, which imported Triton with it: "
                           "set it before the first executor starts, or use LAMINA_WORKER_MULTIPROC_METHOD=spawn")
    os.environ.clear()
    os.environ.update(environment)
    entry(*args)


class RankProcesses:
    """Rank processes of one node (`worker_start_method`), each with a pipe, and their supervision."""

    def __init__(self, spec: WorkerSpec, ranks: list[int]):
        self.spec = spec
        method = worker_start_method()
        ctx = mp.get_context(method)
        if method == "forkserver":  # (only the first call before the server starts takes effect)
            ctx.set_forkserver_preload(sorted({*FORKSERVER_PRELOAD, worker_main.__module__}))
        self.ranks = ranks
        self.conns: dict[int, mpc.Connection] = {}
        self.errors: dict[int, str] = {}
        self.procs: dict[int, mp.Process] = {}
        for rank in ranks:
            parent, child = ctx.Pipe()
            target, args = worker_main, (rank, spec, child)
            if method == "forkserver":
                target, args = _forked_rank_main, (worker_main, dict(os.environ), *args)
            proc = ctx.Process(target=target, args=args, daemon=True, name=f"lamina-rank{rank}")
            with _main_module_hidden():
                proc.start()
            child.close()
            self.conns[rank], self.procs[rank] = parent, proc

    def _drain_reports(self) -> None:
        for rank, conn in self.conns.items():
            if rank == 0:
                continue  # rank 0's pipe carries results; wait_rank0 reads it
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "error":
                        self.errors.setdefault(rank, msg[2])
            except (EOFError, OSError):
                pass  # the process ended; its exit code tells the rest

    def failure(self) -> str | None:
        """A description of the first failure, naming ranks that died before ranks that only
        reported errors caused by the loss of a peer; None while every rank is healthy."""
        self._drain_reports()
        dead = {r: p for r, p in self.procs.items() if not p.is_alive() and p.exitcode not in (0, None)}
        if not dead and not self.errors:
            return None
        time.sleep(0.3)  # let simultaneous deaths show up
        self._drain_reports()
        dead = {r: p for r, p in self.procs.items() if not p.is_alive() and p.exitcode not in (0, None)}
        silent = [r for r in dead if r not in self.errors]
        parts = [f"rank {r} (pid {dead[r].pid}) died with exit code {dead[r].exitcode}" for r in sorted(silent)]
        parts += [f"rank {r} failed: {self.errors[r]}" for r in sorted(self.errors)]
        message = "; then ".join(parts)
        if any("timed out" in e.lower() for e in self.errors.values()):
            message += (f" (a rank waited longer than LAMINA_DIST_TIMEOUT_S = {self.spec.dist_timeout_s:g} s for its "
                        "peers: raise it where ranks load or step at very different speeds)")
        return message

    def check(self) -> None:
        """Raise WorkerError if any rank died or reported an error."""
        message = self.failure()
        if message is not None:
            raise WorkerError(message)

    def wait_rank0(self, timeout: float | None = None):
        conn = self.conns[0]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            watch = [conn] + [p.sentinel for p in self.procs.values()] + [c for r, c in self.conns.items() if r != 0]
            ready = mpc.wait(watch, timeout=0.5)
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self.check()
                    raise WorkerError("rank 0 closed its pipe unexpectedly") from None
                if msg[0] == "error":
                    self.errors.setdefault(msg[1], msg[2])
                    self.check()
                return msg
            if ready:
                self.check()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"no answer from rank 0 within {timeout} s")

    def join(self, timeout: float = 5.0) -> int:
        """Wait for all local ranks; returns the first non-zero exit code (0 if none)."""
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        return next((p.exitcode for p in self.procs.values() if p.exitcode), 0) or 0

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 3
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1)
        for conn in self.conns.values():
            conn.close()


class MultiprocExecutor:
    def __init__(self, spec: WorkerSpec, local_ranks: list[int], *, startup_timeout: float = 600.0):
        self.spec = spec
        self.procs = RankProcesses(spec, local_ranks)
        self._closed = False
        atexit.register(self.shutdown)  # a script that never calls LLM.shutdown() still ends its ranks cleanly
        try:
            msg = self.procs.wait_rank0(startup_timeout)
            assert msg[0] == "ready", msg
            self.rank_info = msg[1]
        except BaseException:
            self.shutdown()
            raise

    def _call(self, command, expect: str):
        if self._closed:
            raise WorkerError("the executor has been shut down")
        try:
            self.procs.conns[0].send(command)
            msg = self.procs.wait_rank0()
        except (WorkerError, BrokenPipeError, EOFError, OSError) as e:
            self.shutdown()
            raise e if isinstance(e, WorkerError) else WorkerError(f"lost rank 0: {e}") from e
        assert msg[0] == expect, msg
        return msg[1]

    def min_free_bytes(self) -> int | None:
        frees = [i["free_bytes"] for i in self.rank_info if i and i["free_bytes"] is not None]
        return min(frees) if frees else None

    def bytes_per_block(self, block_size: int) -> int:
        return self._call(("bytes_per_block", block_size), "bytes_per_block")

    def state_bytes_per_slot(self) -> int:
        return self._call(("state_bytes_per_slot",), "state_bytes_per_slot")

    def allocate(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        self._call(("allocate", num_blocks, block_size, num_slots), "allocated")

    def restart_unseeded_streams(self, seed: int) -> None:
        """Every rank starts its replica's noise stream again (`seed` is the engine's: the spec's)."""
        assert seed == self.spec.seed, (seed, self.spec.seed)
        self._call(("reseed",), "reseeded")

    def capture_decode_graphs(self, max_batch: int, max_model_len: int, *, num_speculative_tokens: int = 0,
                              static_off_cuda: bool = False, capture_sizes: tuple[int, ...] | None = None,
                              max_capture_size: int | None = None) -> list:
        """Every rank captures its decode graphs (`ModelRunner.capture_decode_graphs`; with MTP the
        verification graphs of K = `num_speculative_tokens`); returns each rank's (captured, why not).
        Ranks keep their graphs only when all captured. `static_off_cuda` (tests on the CPU): the
        graphs' static buffers run eagerly."""
        return self._call(("capture", max_batch, max_model_len, num_speculative_tokens, static_off_cuda,
                           capture_sizes, max_capture_size), "captured")

    def graph_replays(self) -> list[int]:
        """Each rank's count of decode steps replayed from its graphs."""
        return self._call(("graph_replays",), "graph_replays")

    def execute_replicas(self, plans: list[StepPlan]) -> list[dict[str, SampledToken]]:
        return self._call(("step", plans), "result")

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's: `method` (a ModelRunner method's name, or a picklable callable given the runner)
        on every rank, in rank order (lamina.worker.rpc); a rank's failure raises here."""
        check_picklable(method, tuple(args), kwargs)
        return raise_failures(self._call(("rpc", method, tuple(args), dict(kwargs or {})), "rpc"))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            if all(p.is_alive() for p in self.procs.procs.values()):
                self.procs.conns[0].send(("shutdown",))
                self.procs.join(timeout=10)
        except (BrokenPipeError, OSError):
            pass
        self.procs.kill_all()


def worker_spec(setup: EngineSetup) -> WorkerSpec:
    """What every rank process needs; identical on every node for the same arguments."""
    args, pc = setup.args, setup.parallel_config
    return WorkerSpec(
        model_path=str(setup.model_path), hf_overrides=args.hf_overrides, dtype=setup.dtype,
        ssm_state_dtype=setup.ssm_state_dtype, kv_cache_dtype=setup.kv_cache_dtype,
        device_type=setup.device.type, plan=setup.plan,
        master_addr=pc.master_addr, master_port=pc.master_port or find_free_port(),
        eos_token_ids=setup.eos_token_ids, vocab_size=setup.model_config.vocab_size, load_format=args.load_format,
        seed=args.seed, model_options=setup.model_options(), debug_layouts=args.debug_layouts,
        gpu_memory_utilization=args.gpu_memory_utilization,
        fail_at_step=args.fail_at_step, fail_rank=args.fail_rank, fail_mode=args.fail_mode,
        logprobs_mode=args.logprobs_mode, dist_timeout_s=timeout_from_env(),
    )


def run_headless_node(engine_args) -> int:
    """Run this node's ranks of a multi-node layout (node_rank > 0) until the engine on node 0 ends."""
    pc = engine_args.parallel_config()
    if pc.node_rank == 0:
        raise ValueError("node 0 runs the engine itself; run_headless_node is for node_rank > 0")
    setup = resolve_setup(engine_args)
    procs = RankProcesses(worker_spec(setup), setup.node_ranks())
    try:
        while any(p.is_alive() for p in procs.procs.values()):
            procs.check()
            time.sleep(0.2)
        return procs.join(timeout=1)
    except WorkerError as e:
        print(f"lamina: node {pc.node_rank}: {e}", file=sys.stderr)
        return 1
    finally:
        procs.kill_all()

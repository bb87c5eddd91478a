"""One process per rank on this node; commands go to rank 0, which broadcasts them.

The executor watches every local process: if one exits or reports an error, `execute` raises an
error naming the rank within about a second, and every child is terminated (nothing hangs).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import contextlib
import socket
import sys
import time

from lamina.engine.step_plan import StepPlan
from lamina.worker.model_runner import SampledToken
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


class RankProcesses:
    """Spawned rank processes of one node, each with a pipe, and their supervision."""

    def __init__(self, spec: WorkerSpec, ranks: list[int]):
        ctx = mp.get_context("spawn")
        self.ranks = ranks
        self.conns: dict[int, mpc.Connection] = {}
        self.procs: dict[int, mp.Process] = {}
        for rank in ranks:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, spec, child), daemon=True, name=f"lamina-rank{rank}")
            with _main_module_hidden():
                proc.start()
            child.close()
            self.conns[rank], self.procs[rank] = parent, proc

    def check(self) -> None:
        """Raise WorkerError if any rank died or reported an error."""
        for rank, conn in self.conns.items():
            if rank != 0 and conn.poll():
                msg = conn.recv()
                if msg[0] == "error":
                    raise WorkerError(f"rank {rank} failed: {msg[2]}")
        for rank, proc in self.procs.items():
            if not proc.is_alive() and proc.exitcode not in (0, None):
                if rank == 0 and self.conns[0].poll():
                    return  # rank 0 left a message: let the caller read it
                raise WorkerError(f"rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}")

    def wait_rank0(self, timeout: float | None = None):
        conn = self.conns[0]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            watch = [conn] + [p.sentinel for p in self.procs.values()] + [c for r, c in self.conns.items() if r != 0]
            ready = mpc.wait(watch, timeout=0.5)
            if conn in ready:
                try:
                    msg = conn.recv()
                except EOFError:
                    self.check()
                    raise WorkerError("rank 0 closed its pipe unexpectedly") from None
                if msg[0] == "error":
                    raise WorkerError(f"rank {msg[1]} failed: {msg[2]}")
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

    def allocate(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        self._call(("allocate", num_blocks, block_size, num_slots), "allocated")

    def execute_replicas(self, plans: list[StepPlan]) -> list[dict[str, SampledToken]]:
        return self._call(("step", plans), "result")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if all(p.is_alive() for p in self.procs.procs.values()):
                self.procs.conns[0].send(("shutdown",))
                self.procs.join(timeout=10)
        except (BrokenPipeError, OSError):
            pass
        self.procs.kill_all()

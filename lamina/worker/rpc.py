"""vLLM's `collective_rpc` on a rank: a method of the rank's ModelRunner, by name, or a callable
given the runner first (vLLM hands its callables the worker; lamina's per-rank object is the
ModelRunner: `runner.model`, `runner.device`, the caches). A failure is reported, not raised, on a
rank process, so the other ranks and the engine keep serving."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any


@dataclass
class RpcFailure:
    """What a rank reports when its call raised (picklable, unlike some exceptions)."""

    rank: int
    message: str


def call_on_runner(runner, method, args: tuple = (), kwargs: dict | None = None) -> Any:
    """`runner.<method>(*args, **kwargs)` for a method name, else `method(runner, *args, **kwargs)`."""
    kwargs = kwargs or {}
    if isinstance(method, str):
        target = getattr(runner, method, None)
        if target is None or not callable(target):
            raise AttributeError(f"collective_rpc: the model runner has no method {method!r}")
        return target(*args, **kwargs)
    if not callable(method):
        raise TypeError(f"collective_rpc takes a method name or a callable, got {type(method).__name__}")
    return method(runner, *args, **kwargs)


def call_reporting(runner, rank: int, method, args: tuple, kwargs: dict | None) -> Any:
    """`call_on_runner`, its exception, or a result that does not pickle (it travels to rank 0 and the
    engine), turned into an RpcFailure."""
    try:
        result = call_on_runner(runner, method, args, kwargs)
        pickle.dumps(result)
        return result
    except Exception as error:  # reported to the engine, which raises it there
        return RpcFailure(rank, f"{type(error).__name__}: {error}")


def check_picklable(method, args: tuple, kwargs: dict | None) -> None:
    """Rank processes receive the call pickled: say so plainly when it does not pickle (a lambda, a
    nested function)."""
    try:
        pickle.dumps((method, args, kwargs))
    except Exception as error:
        raise TypeError(f"collective_rpc with rank processes sends the call pickled, and {method!r} (or its "
                        f"arguments) does not pickle ({type(error).__name__}: {error}); pass a method name or "
                        f"a module-level function") from error


def raise_failures(per_rank: list) -> list:
    """The ranks' results, or a RuntimeError naming the first rank whose call failed."""
    for result in per_rank:
        if isinstance(result, RpcFailure):
            raise RuntimeError(f"collective_rpc failed on rank {result.rank}: {result.message}")
    return per_rank

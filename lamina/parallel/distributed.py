"""torch.distributed set-up for one rank: the process groups of a ParallelPlan and their collectives.

The only module (with `launch`) that calls torch.distributed. Every rank creates every group in
the same order (a torch.distributed requirement) and keeps the ones it belongs to. A gloo
"control" group carries step plans and results as Python objects even when tensors travel
over NCCL.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lamina.parallel.context import GroupCollectives, ParallelContext
from lamina.parallel.plan import ParallelPlan


TIMEOUT_ENV = "LAMINA_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0


def timeout_from_env() -> float:
    """How long a rank waits for its peers at the rendezvous and on the control group (step plans
    out, results back; on CPUs that is the default group, which also carries the pipeline's
    send / recv) before it fails: `LAMINA_DIST_TIMEOUT_S`, default 120 s. The TP / DP / EP groups'
    collectives inside a step keep torch's defaults. Raise it where ranks load or step at very
    different speeds (slow shared storage, huge prompts on CPUs)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 1.0 or value == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} = {raw!r} must be a number of seconds >= 1")
    return value


class DistGroup(GroupCollectives):
    def __init__(self, group, ranks: list[int], rank_in_group: int):
        super().__init__(size=len(ranks), rank=rank_in_group)
        self.group = group
        self.ranks = ranks

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self.size == 1:
            return x
        chunks = [c.contiguous() for c in x.chunk(self.size, dim=dim)]
        if x.device.type == "cuda":
            out = torch.empty_like(chunks[self.rank])
            dist.reduce_scatter(out, chunks, group=self.group)
            return out
        # gloo has no reduce_scatter: all-reduce and keep this rank's slice.
        full = x.contiguous()
        dist.all_reduce(full, group=self.group)
        return full.chunk(self.size, dim=dim)[self.rank].contiguous()


@dataclass
class RankGroups:
    ctx: ParallelContext
    control: object  # gloo group of all ranks, for object broadcast / gather
    rank: int
    world_size: int


def init_rank(
    plan: ParallelPlan,
    rank: int,
    *,
    master_addr: str,
    master_port: int,
    device: torch.device,
    debug_layouts: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RankGroups:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        # NCCL >= 2.19 allocates with cuMem by default, which costs 1-2 GiB more per GPU once CUDA graphs
        # capture its collectives (NVIDIA/nccl#1234), memory the plan does not count; vLLM turns it off
        # too. Set before any communicator exists; an explicit setting wins.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    dist.init_process_group(
        backend=backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
        world_size=plan.world_size, timeout=datetime.timedelta(seconds=timeout_s),
    )
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) if backend != "gloo" else dist.group.WORLD
    me = plan.ranks[rank]

    def make(groups: list[list[int]]) -> DistGroup:
        mine = None
        for ranks in groups:  # every rank creates every group, in the same order
            g = dist.new_group(ranks=ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine = DistGroup(g, ranks, ranks.index(rank))
        assert mine is not None
        return mine

    tp_groups = [[plan.rank_of(d, p, t) for t in range(plan.tp)] for d in range(plan.dp) for p in range(plan.pp)]
    dp_groups = [[plan.rank_of(d, p, t) for d in range(plan.dp)] for p in range(plan.pp) for t in range(plan.tp)]
    ep_groups = [[plan.rank_of(d, p, t) for d in range(plan.dp) for t in range(plan.tp)] for p in range(plan.pp)]
    tp, dp_group, ep = make(tp_groups), make(dp_groups), make(ep_groups)
    ctx = ParallelContext(
        tp=tp, device=device, dp=dp_group, ep=ep if plan.ep_enabled else GroupCollectives(),
        ep_enabled=plan.ep_enabled, expert_range=me.experts, sp=plan.sp, debug_layouts=debug_layouts,
    )
    return RankGroups(ctx=ctx, control=control, rank=rank, world_size=plan.world_size)


def broadcast_object(obj, groups: RankGroups, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=groups.control)
    return box[0]


def gather_objects(obj, groups: RankGroups, dst: int = 0) -> list | None:
    out = [None] * groups.world_size if groups.rank == dst else None
    dist.gather_object(obj, out, dst=dst, group=groups.control)
    return out


def send_tensor(x: torch.Tensor, dst: int) -> None:
    dist.send(x.contiguous(), dst=dst)


def recv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=src)
    return x


def shutdown() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort during teardown
            pass

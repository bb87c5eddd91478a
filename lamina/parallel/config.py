"""Parallel configuration as the user gives it (vLLM flag names)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

PARTITION_ENV = "LAMINA_PP_LAYER_PARTITION"
VLLM_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"  # what deployment scripts written for vLLM set: an alias

logger = logging.getLogger(__name__)
_logged_sources: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    sequence_parallel_moe: str = "auto"  # auto | on | off
    pp_layer_partition: str | None = None  # "2,16,16,14"; None: env LAMINA_PP_LAYER_PARTITION, else default
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port is picked (single node only)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.sequence_parallel_moe not in ("auto", "on", "off"):
            raise ValueError(f"sequence_parallel_moe must be one of auto, on, off; got {self.sequence_parallel_moe!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank = {self.node_rank} must be in [0, nnodes = {self.nnodes})")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need an explicit --master-port (and --master-addr) to meet at")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def is_single_rank(self) -> bool:
        return self.world_size == 1

    def partition_spec(self) -> tuple[str | None, str]:
        """The partition string in force and where it came from (the flag wins over the env;
        VLLM_PP_LAYER_PARTITION is an alias of LAMINA_PP_LAYER_PARTITION, and both set differently is an
        error)."""
        if self.pp_layer_partition is not None:
            return self.pp_layer_partition, "--pp-layer-partition"
        ours, vllm = os.environ.get(PARTITION_ENV), os.environ.get(VLLM_PARTITION_ENV)
        if ours and vllm and ours.replace(" ", "") != vllm.replace(" ", ""):
            raise ValueError(f"{PARTITION_ENV} = {ours!r} and {VLLM_PARTITION_ENV} = {vllm!r} disagree; set one "
                             "(or the same value in both)")
        for name, value in ((PARTITION_ENV, ours), (VLLM_PARTITION_ENV, vllm)):
            if value:
                if (name, value) not in _logged_sources:  # once per process and value
                    _logged_sources.add((name, value))
                    logger.info("pipeline layer partition %r read from %s", value, name)
                return value, name
        return None, "default"

"""Executors carry step plans to the ranks of every replica and bring back sampled tokens.

`InProcessExecutor` runs the single rank in this process; `MultiprocExecutor`
(lamina.engine.mp_executor) runs one process per rank. Both take one plan per data-parallel
replica and return one {request_id: SampledToken} per replica.
"""

from __future__ import annotations

import torch

from lamina.step_plan import SampledToken, StepPlan
from lamina.worker.model_runner import ModelRunner
from lamina.worker.rpc import call_on_runner
from lamina.worker.sampling_rng import seed_unseeded_stream


class InProcessExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def min_free_bytes(self) -> int | None:
        if self.runner.device.type == "cuda":
            return torch.cuda.mem_get_info(self.runner.device)[0]
        return None

    def bytes_per_block(self, block_size: int) -> int:
        return self.runner.paged_cache_bytes_per_block(block_size)

    def state_bytes_per_slot(self) -> int:
        return self.runner.state_bytes_per_slot()

    def allocate(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        self.runner.allocate_caches(num_blocks, block_size, num_slots)

    def restart_unseeded_streams(self, seed: int) -> None:
        """Start the noise of unseeded requests again at `seed` (lamina.worker.sampling_rng)."""
        seed_unseeded_stream(seed, self.runner.device)

    def execute_replicas(self, plans: list[StepPlan]) -> list[dict[str, SampledToken]]:
        return [self.runner.execute(plans[0])]

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's: `method` on the one rank's ModelRunner (lamina.worker.rpc), as a one-element list."""
        return [call_on_runner(self.runner, method, tuple(args), kwargs)]

    def launch(self, plan: StepPlan):
        """Queue the step on the device; its tokens come from the returned handle's `result()`."""
        return self.runner.launch(plan)

    def shutdown(self) -> None:
        self.runner = None

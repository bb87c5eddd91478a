"""Executors carry a step plan to the ranks of one replica and bring back sampled tokens.

`InProcessExecutor` runs the single rank in this process. A multi-process executor (one process
per rank) delivers the same plan to every rank; only the last stage's sampled tokens come back.
"""

from __future__ import annotations

from lamina.engine.step_plan import StepPlan
from lamina.worker.model_runner import ModelRunner, SampledToken


class InProcessExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, plan: StepPlan) -> dict[str, SampledToken]:
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        self.runner = None

"""Executor interface: the engine's only way to reach workers (plan in, output out)."""

from __future__ import annotations

from aspire_ray.config import EngineConfig
from aspire_ray.plan import ShardInfo, StepOutput, StepPlan


class WorkerDiedError(RuntimeError):
    """A shard worker is gone: in-flight requests fail, the engine reports unhealthy."""


class Executor:
    def describe(self) -> ShardInfo:
        """Facts about the shards (num_pages = the minimum over ranks, model limits, device)."""
        raise NotImplementedError

    def execute(self, plan: StepPlan) -> StepOutput:
        raise NotImplementedError

    def dead_ranks(self, timeout_s: float = 1.0) -> list[int]:
        """Ranks whose process is gone, found without running a step (an idle health check).
        In-process workers cannot die alone: []."""
        return []

    def resident_memory(self) -> dict[str, int]:
        """Resident bytes of the worker processes apart from the caller's, by role ("shard0",
        ...; ``aspire_ray.process_memory``), as last sampled: the engine asks after every
        step, so a sample is cheap and not always fresh. In-process workers are the caller's
        own memory: {}."""
        return {}

    def shutdown(self) -> None:
        """Release the workers; idempotent. Later steps raise WorkerDiedError."""


class LocalExecutor(Executor):
    """tp_size 1: the worker lives in the driver's process."""

    def __init__(self, cfg: EngineConfig) -> None:
        from aspire_ray.worker.worker import Worker

        self.worker = Worker(cfg)

    def describe(self) -> ShardInfo:
        return self.worker.describe()

    def execute(self, plan: StepPlan) -> StepOutput:
        if self.worker is None:
            raise WorkerDiedError("the executor was shut down")
        return self.worker.execute(plan)

    def shutdown(self) -> None:
        self.worker = None  # the model and the KV pool go with it

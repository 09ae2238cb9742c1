"""How the driver reaches the shard workers: in-process (tp 1) or Ray actors."""

from aspire_ray.config import EngineConfig

from .base import Executor, LocalExecutor


def make_executor(cfg: EngineConfig) -> Executor:
    """The executor of a deployment: the worker in this process at tp 1, else one Ray actor
    per shard (imported only then: Ray is not needed at tp 1)."""
    if cfg.tp_size == 1:
        return LocalExecutor(cfg)
    from .ray_executor import RayExecutor

    return RayExecutor(cfg)


__all__ = ["Executor", "make_executor"]

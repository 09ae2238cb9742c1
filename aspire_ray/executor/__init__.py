"""How the driver reaches the shard workers: in-process (tp 1) or Ray actors."""

from .base import Executor, make_executor

__all__ = ["Executor", "make_executor"]

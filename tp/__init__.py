"""Tensor parallelism (installed as ``aspire_ray.tp``): process groups, collectives and
Megatron-style parallel layers that carry their own weight loaders. Knows nothing of scheduling."""

from .group import TPGroup, single_rank

__all__ = ["TPGroup", "single_rank"]

"""The tensor-parallel group a shard belongs to, and the collectives the model uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """rank/size of this shard; ``group`` is the torch.distributed group (None when size 1).

    Passed explicitly to every parallel layer (no global state).
    """

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise max over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def single_rank() -> TPGroup:
    return TPGroup()


def shard_heads(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int, int]:
    """(q heads, kv heads, first kv head) held by this rank.

    q heads split evenly; kv heads split evenly when kv_heads >= tp, else replicated so that
    each rank holds the one kv head its q heads use.
    """
    if num_heads % tp.size:
        raise ValueError(
            f"{num_heads} attention heads cannot be split over tp_size={tp.size} ranks "
            f"(tp_size must divide the head count)"
        )
    if num_kv_heads % tp.size and tp.size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} kv heads cannot be split over or replicated to tp_size={tp.size} "
            f"(one must divide the other)"
        )
    q_local = num_heads // tp.size
    if num_kv_heads >= tp.size:
        kv_local = num_kv_heads // tp.size
        return q_local, kv_local, tp.rank * kv_local
    return q_local, 1, tp.rank * num_kv_heads // tp.size

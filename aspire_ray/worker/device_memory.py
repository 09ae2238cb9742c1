"""Room on the device for a buffer made after the KV pool took its share
(``CacheConfig.gpu_memory_utilization``): the self-planning graphs' stores of sampled drafts'
q (``async_graphs.AsyncStepGraphs.q_store``, ``draft_graphs.DraftStepGraphs.q_round``)."""

from __future__ import annotations

import torch

SPARE_BYTES = 1 << 30  # left free beside a new store (activations, graph pools, allocator slack)


def free_device_bytes(device: torch.device) -> int:
    """Memory a new tensor may take on the device: free memory plus what torch's caching
    allocator holds unused (no limit on the CPU)."""
    if device.type != "cuda":
        return 1 << 62
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def room_for(nbytes: int, device: torch.device, tp) -> bool:
    """Whether ``nbytes`` fit with ``SPARE_BYTES`` to spare, on every shard of the
    tensor-parallel group ``tp`` (a max over it: each shard then takes the same path, a graph
    on one and the host's steps on another would not meet in their collectives)."""
    short = nbytes + SPARE_BYTES > free_device_bytes(device)
    flag = torch.tensor([int(short)], device=device)
    return not bool(tp.all_reduce_max(flag).item())

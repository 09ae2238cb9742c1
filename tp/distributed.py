"""Process-group set-up for one tensor-parallel group of shard processes.

Rendezvous without hard-coded ports: rank 0 opens a TCP store on port 0 (the OS picks a free
port, so there is no pick-then-bind race), reports (host, port) to whoever launches the ranks,
and every rank joins with that address. Knows nothing of Ray or scheduling: the launcher
(``aspire_ray.worker.ray_worker``) moves the address between processes.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .group import TPGroup

# Environment for NCCL shard processes: NVLink SHARP (NVLS) multicast stays off (it needs
# fabric-manager support that shared hosts often lack, and hangs instead of failing).
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def backend_for(device: str | torch.device) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def open_store(host: str, world_size: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0: a TCP store on a free port of ``host`` (read it back from ``store.port``)."""
    return dist.TCPStore(host, 0, world_size, is_master=True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def init_group(backend: str, rank: int, size: int, host: str, port: int,
               store: dist.TCPStore | None = None, timeout_s: float = 300.0) -> TPGroup:
    """Join the default process group of ``size`` ranks and return this rank's TPGroup.

    Rank 0 passes the store it opened with ``open_store``; the others connect to host:port.
    ``timeout_s`` bounds a collective whose peer is gone (the launcher also kills survivors).
    One group per process: each shard worker is its own process.
    """
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    if backend == "nccl":
        for key, value in NCCL_ENV.items():
            os.environ.setdefault(key, value)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    group = dist.group.WORLD
    # One tiny collective so that a broken rendezvous fails here, not in the first step.
    probe = torch.ones(1, device="cuda" if backend == "nccl" else "cpu")
    dist.all_reduce(probe, group=group)
    if int(probe.item()) != size:
        raise RuntimeError(f"process group check failed: sum of ones = {probe.item()}, "
                           f"expected {size}")
    return TPGroup(rank, size, group)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

"""Room on the device for a buffer made after the KV pool took its share
(``CacheConfig.gpu_memory_utilization``): the self-planning graphs' stores of sampled drafts'
q (``async_graphs.AsyncStepGraphs.q_store``, ``draft_graphs.DraftStepGraphs.q_round``)."""

from __future__ import annotations

import torch

# left free beside a new store, at least (activations, graph pools, allocator slack); the
# worker passes its measured step workspace where larger (``kv_budget.step_workspace``)
SPARE_BYTES = 1 << 30


def free_device_bytes(device: torch.device) -> int:
    """Memory a new tensor may take on the device: free memory plus what torch's caching
    allocator holds unused (no limit on the CPU)."""
    if device.type != "cuda":
        return 1 << 62
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def room_for(nbytes: int, device: torch.device, tp, spare: int = SPARE_BYTES) -> bool:
    """Whether ``nbytes`` fit with ``spare`` bytes to spare, on every shard of the
    tensor-parallel group ``tp`` (a max over it: each shard then takes the same path, a graph
    on one and the host's steps on another would not meet in their collectives)."""
    short = nbytes + spare > free_device_bytes(device)
    flag = torch.tensor([int(short)], device=device)
    return not bool(tp.all_reduce_max(flag).item())


class RowStore:
    """float32 [planes, rows, V] stores on the device that every row bucket n views
    ([:, :n], strided), ``copies`` of them (a store and its snapshot): one allocation for the
    largest bucket where each bucket had its own (their sum ~2x the largest: 2.4 GB at 64 rows
    of Qwen2.5's vocabulary, 20 GB at 512). Made at the first ``view``; ``fits`` says whether
    it exists or would fit now with ``spare`` bytes left (``room_for``: the steps' workspace,
    which the captures of its graphs and the eager steps need after it), so that a caller can
    plan on the host instead. A bucket's view holds the rows of that bucket's run; the rows of
    the next run are loaded in again (runs of different buckets never overlap)."""

    def __init__(self, planes: int, rows: int, vocab: int, device: torch.device, tp,
                 copies: int = 1, spare: int = SPARE_BYTES) -> None:  # fmt: skip
        self.shape = (max(planes, 1), rows, vocab)
        self.device, self.tp, self.copies, self.spare = device, tp, copies, spare
        self.data: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        planes, rows, vocab = self.shape
        return self.copies * planes * rows * vocab * 4

    def fits(self) -> bool:
        return self.data is not None or room_for(self.nbytes, self.device, self.tp, self.spare)

    def view(self, n: int, copy: int = 0) -> torch.Tensor:
        """Copy ``copy``'s float32 [planes, n, V] view for bucket n (n <= rows)."""
        if n > self.shape[1]:
            raise ValueError(f"bucket of {n} rows past the store's {self.shape[1]}")
        if self.data is None:
            self.data = [torch.zeros(self.shape, dtype=torch.float32, device=self.device)
                         for _ in range(self.copies)]  # fmt: skip
        return self.data[copy][:, :n]

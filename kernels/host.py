"""Host-side planning helpers: ragged index arithmetic in numpy and host->device uploads.

A step plans its metadata on the host (no device sync) and uploads it asynchronously. Pinned
memory makes the copy asynchronous, but allocating it (``cudaHostAlloc``) costs ~0.3 ms per
call: uploads reuse pinned buffers from a small pool, each reused only once the copy that last
read it has completed (a CUDA event, so the host never waits for the device).
"""

from __future__ import annotations

import numpy as np
import torch


def offsets(counts: np.ndarray) -> np.ndarray:
    """[R] counts -> [R + 1] exclusive prefix sums (int64)."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """[R] counts -> the concatenation of arange(c) for each c."""
    starts = offsets(counts)
    return np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], counts)


def next_power_of_2(x: np.ndarray) -> np.ndarray:
    """Elementwise smallest power of two >= x (x >= 1), int64."""
    x = np.asarray(x, dtype=np.int64)
    return np.left_shift(1, np.ceil(np.log2(np.maximum(x, 1))).astype(np.int64))


class _PinnedPool:
    """Pinned host buffers, each with the event of the last copy that read it."""

    def __init__(self) -> None:
        self.buffers: list[list] = []  # [uint8 pinned tensor, torch.cuda.Event | None]

    def take(self, nbytes: int) -> list:
        for entry in self.buffers:
            if entry[0].numel() >= nbytes and (entry[1] is None or entry[1].query()):
                return entry
        size = max(1 << 16, 1 << (nbytes - 1).bit_length())
        entry = [torch.empty(size, dtype=torch.uint8, pin_memory=True), None]
        self.buffers.append(entry)
        return entry


_POOL = _PinnedPool()


def upload(host: np.ndarray, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy a host array to ``device`` (into ``out`` when given, contiguous) without a device
    sync. On the CPU the result may share memory with ``host``."""
    src = torch.from_numpy(np.ascontiguousarray(host))
    if device.type != "cuda":
        return src if out is None else out.copy_(src)
    nbytes = src.numel() * src.element_size()
    entry = _POOL.take(max(nbytes, 1))
    pinned = entry[0][:nbytes].view(src.dtype).view(src.shape)
    pinned.copy_(src)
    if out is None:
        out = torch.empty(src.shape, dtype=src.dtype, device=device)
    out.copy_(pinned, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    entry[1] = event
    return out

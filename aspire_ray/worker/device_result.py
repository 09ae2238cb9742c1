"""A plan's tokens on their way from the device to the host, waited for on their own."""

from __future__ import annotations

import time

import torch


class DeviceResult:
    """int64 tensors on the device, copied to pinned host memory behind an event: waiting
    waits for the work queued before it only, not for steps replayed after it (the next
    plan's, started early)."""

    def __init__(self, outs: list[torch.Tensor]) -> None:
        flat = torch.cat(outs)
        self.event = None
        if flat.device.type != "cuda":  # CPU (tests: graphs emulated), already computed
            self.host = flat
            return
        self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        self.host.copy_(flat, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> tuple[list[int], float]:
        """-> (the values, the seconds the host waited)."""
        t0 = time.perf_counter()
        if self.event is not None:
            self.event.synchronize()  # the plan's one device sync
        return self.host.tolist(), time.perf_counter() - t0

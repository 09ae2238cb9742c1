"""A plan's tokens on their way from the device to the host, waited for on their own."""

from __future__ import annotations

import time

import numpy as np
import torch

from . import gc_waits

_ONES: dict[torch.device, torch.Tensor] = {}  # device -> int32 [1] = 1: the "spin" flag's source


class DeviceResult:
    """int64 tensors on the device, copied to pinned host memory: waiting waits for the work
    queued before it only, not for steps replayed after it (the next plan's, started early).

    spin=False: the copy is followed by a CUDA event, and ``wait`` syncs on it. spin=True
    (``EngineConfig.device_wait``): a second copy, stream-ordered after the first, writes a
    1 into a pinned flag, and ``wait`` polls the flag (no CUDA call while waiting)."""

    def __init__(self, outs: list[torch.Tensor], spin: bool = False) -> None:
        flat = torch.cat(outs)
        self.event = self.flag = None
        if flat.device.type != "cuda":  # CPU (tests: graphs emulated), already computed
            self.host = flat
            return
        self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        self.host.copy_(flat, non_blocking=True)
        if spin:
            one = _ONES.get(flat.device)
            if one is None:
                one = _ONES[flat.device] = torch.ones(1, dtype=torch.int32, device=flat.device)
            self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self.flag.copy_(one, non_blocking=True)  # lands after the tokens (one stream)
            return
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> tuple[np.ndarray, float]:
        """-> (the values, int64 [N] on the host, the seconds the host waited: after the
        garbage collections that the device's queued work hides, ``gc_waits.collect``)."""
        if self.flag is not None or self.event is not None:
            gc_waits.collect()
        t0 = time.perf_counter()
        if self.flag is not None:
            flag = self.flag.numpy()  # the pinned memory itself, read afresh each time
            while not flag[0]:
                time.sleep(0)  # lets other threads (the serving loop) run meanwhile
        elif self.event is not None:
            self.event.synchronize()  # the plan's one device sync
        # a copy: the pinned buffer goes back to torch's cache when this object does
        return self.host.numpy().copy(), time.perf_counter() - t0

"""What one all-reduce of hidden-size activations costs on a TP group, measured at start-up.

The cost model (``aspire_ray.spec.cost_model.CollectiveCost``) turns it into a per-step and a
per-token term: every layer all-reduces its [n_tokens, hidden] output twice. At TP=1 nothing
is exchanged and the cost is zero.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .group import TPGroup

# Tokens of [n, hidden] activations timed: the small end pins the latency, the large end the
# per-token slope (decode batches of 1-256 rows, prefill chunks of ~1k tokens).
SIZES = (1, 32, 256, 1024)
CALLS = 10  # back-to-back all-reduces per timed trial (averages the launch jitter)
TRIALS = 3  # the fastest trial of each size is kept (noise only adds)


@dataclass(frozen=True)
class AllReduceCost:
    """seconds(n) = latency + per_token * n for one all-reduce of [n, hidden] activations.

    A lower envelope of the measured points (the line lies on or below every one of them),
    the same on every rank; zero at TP=1."""

    latency: float = 0.0  # seconds per call
    per_token: float = 0.0  # seconds per token of hidden-size activations

    def seconds(self, n_tokens: float) -> float:
        return self.latency + self.per_token * n_tokens


def measure_all_reduce(
    tp: TPGroup,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    sizes: tuple[int, ...] = SIZES,
) -> AllReduceCost:
    """Time all-reduces of [n, hidden] ``dtype`` activations for n in ``sizes`` on the real
    process group. A collective: every rank of ``tp`` must call it with the same arguments."""
    if tp.size == 1:
        return AllReduceCost()
    n = np.array(sizes, dtype=np.float64)
    seconds = np.array([_time_all_reduce(tp, torch.zeros(s, hidden, dtype=dtype, device=device))
                        for s in sizes])  # fmt: skip
    # ranks wait for each other in every call, so their times differ only by noise and skew:
    # the smallest is the closest to the collective itself (and every rank keeps the same)
    agreed = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp.group)
    seconds = agreed.cpu().numpy()
    slope = max(float(np.polyfit(n, seconds, 1)[0]), 0.0) if len(sizes) > 1 else 0.0
    latency = max(float((seconds - slope * n).min()), 0.0)  # the line under every point
    return AllReduceCost(latency=latency, per_token=slope)


def _time_all_reduce(tp: TPGroup, x: torch.Tensor) -> float:
    """Seconds of one all-reduce of x: the fastest of ``TRIALS`` runs of ``CALLS`` calls."""
    cuda = x.device.type == "cuda"
    tp.all_reduce(x)  # first call of this size (buffers, connections), untimed
    best = float("inf")
    for _ in range(TRIALS):
        tp.all_reduce(torch.zeros(1, device=x.device))  # line the ranks up
        if cuda:
            torch.cuda.synchronize(x.device)
            # hold the stream while the host queues every call, so that the events time the
            # device's collectives back to back, not the host's launches (whole-step graphs
            # issue them without launch gaps)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)
            start.record()
            for _ in range(CALLS):
                tp.all_reduce(x)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / CALLS)
        else:
            t0 = time.perf_counter()
            for _ in range(CALLS):
                tp.all_reduce(x)
            best = min(best, (time.perf_counter() - t0) / CALLS)
    return best

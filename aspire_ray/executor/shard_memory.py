"""The shard actors' resident memory (RSS), sampled without holding up a step.

The engine asks for it after every step (``Executor.resident_memory``), and a shard's RSS is an
actor call: so it is asked at most once per ``SAMPLE_INTERVAL_S`` (one small call a rank), and
a step never waits for the answer: the calls' refs are kept, and a later ask takes the answers
once every rank has given one. Until then the last complete answer stands. A rank that died
is left out of the answer (the next step reports its death).
"""

from __future__ import annotations

import math
import time

from aspire_ray.process_memory import SAMPLE_INTERVAL_S


class ShardMemory:
    def __init__(self, actors: list, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.actors = actors  # ShardWorker actors (or anything with resident_memory.remote())
        self.interval_s = interval_s
        self._pending: list | None = None  # refs of the calls in flight, rank order
        self._asked_at = -math.inf
        self._latest: dict[str, int] = {}  # "shard<rank>" -> bytes, the last complete answer

    def sample(self, wait_s: float = 0.0) -> dict[str, int]:
        """"shard<rank>" -> resident bytes, as last answered; asks again when the last ask is
        ``interval_s`` old and answered. ``wait_s``: how long to wait for calls in flight (0
        in a step; start-up waits for the first answer)."""
        import ray

        now = time.monotonic()
        if self._pending is None and now - self._asked_at >= self.interval_s:
            self._pending = [a.resident_memory.remote() for a in self.actors]
            self._asked_at = now
        if self._pending is not None:
            ready, _ = ray.wait(self._pending, num_returns=len(self._pending), timeout=wait_s)
            if len(ready) == len(self._pending):
                self._latest, self._pending = _answers(self._pending), None
        return dict(self._latest)


def _answers(refs: list) -> dict[str, int]:
    """The answered calls' bytes by role; a rank whose call failed (its actor died) left out."""
    import ray

    out = {}
    for rank, ref in enumerate(refs):
        try:
            out[f"shard{rank}"] = ray.get(ref)
        except ray.exceptions.RayError:
            continue
    return out

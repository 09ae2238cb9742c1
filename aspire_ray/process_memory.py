"""Resident memory (RSS) of the processes that serve an engine, for leak watching.

``stats()["rss_bytes"]`` of an engine maps a process's role to its resident bytes: ``"driver"``
(the engine driver actor, ``serving.engine_core._Driver``), ``"shard0"``, ``"shard1"``, ...
(tensor-parallel shard actors, ``executor.ray_executor``); the Serve replica adds its own,
``"replica"``, at scrape time (``serving.metrics``). Only processes of their own get a role: the
engine stepped in the replica's thread is the replica's memory, a tp = 1 worker in the driver's
process the driver's, so no byte is counted twice.

The engine's stats are built after every step, so the figures there are sampled at most once
per ``SAMPLE_INTERVAL_S``: reading /proc is cheap, but a shard's figure is an actor call.
"""

from __future__ import annotations

import math
import time

import psutil

RSS_KEY = "rss_bytes"  # the engine stats' key: role -> resident bytes
SAMPLE_INTERVAL_S = 1.0


def resident_bytes() -> int:
    """This process's resident set size now."""
    return psutil.Process().memory_info().rss


class ResidentMemory:
    """This process's RSS, read again only once ``interval_s`` has passed since the last read
    (the engine asks on every step)."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._process = psutil.Process()
        self._read_at = -math.inf
        self._bytes = 0

    def bytes(self) -> int:
        now = time.monotonic()
        if now - self._read_at >= self.interval_s:
            self._bytes, self._read_at = self._process.memory_info().rss, now
        return self._bytes

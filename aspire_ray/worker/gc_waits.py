"""Python's garbage collections moved into the host's waits for the device
(``EngineConfig.gc_at_waits``).

A plan's GPU work is queued before the host waits for its tokens, and the next plan's first
steps are queued behind it (runs, rounds and decode chains started early): the host then has
tens of milliseconds with nothing to do. Between that wait's end and the next plan's launch,
the host is on the critical path: commit, schedule, launch. An automatic collection of the
older generations that falls there stalls the GPU. On the H200 (docs/benchmarks.md §8.36, D1:
Qwen2.5-Coder-0.5B, 64 x 32k) each window held one or two generation-1 collections of 10-20
ms, and each mode's longest GPU gap matched them (aspire/q4: 21 ms of collections, a 15.8 ms
gap; aspire_fixed/g8, whose one collection took 0.7 ms: no gap). What they visit is young:
the requests' prompt token lists (64 x 32,000 ints a collection, ~12 ms on a CPU) until a
collection promotes them.

So while the worker executes a plan, automatic collections are off (``deferred``), and at each
wait for the device (``collect``) the generations that are due are collected, generation 1 at
least: the work that would have fallen between two plans falls where the device is busy.
Outside a plan (commit, schedule, an idle engine) the collector runs as it always does; the
young generation a plan leaves is small, so what runs there is a generation-0 collection.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_deferring = False  # inside ``deferred``: collections wait for ``collect``


@contextmanager
def deferred(enabled: bool = True) -> Iterator[None]:
    """Automatic collections off for the block (and back as they were after it); ``collect``
    runs the due ones. Not re-entrant by design: a plan's execution is one block."""
    global _deferring
    if not enabled or _deferring:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        if was_enabled:
            gc.enable()


def collect() -> int | None:
    """Inside ``deferred``, where the host is about to wait for queued device work: collect
    generation 1 (generation 2 where as many generation-1 collections as its threshold have
    run since the last one, as the automatic collector would) unless nothing was allocated
    since the last collection. -> the generation collected, or None."""
    if not _deferring:
        return None
    young, middle, old = gc.get_count()
    if young == 0 and middle == 0:
        return None
    generation = 2 if old >= gc.get_threshold()[2] else 1
    gc.collect(generation)
    return generation

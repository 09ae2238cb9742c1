"""Python's cyclic garbage collector kept off the step loop (``EngineConfig.gc_freeze``).

A collection of the oldest generation visits every tracked object: after start-up ~200k of
them (torch, transformers, the model's modules, the graphs), ~100 ms of host time that falls
between a plan's tokens and the next plan's launch, when it falls in a step. Measured on the
simulator's engine (64 requests x 32k tokens, steady decode, a CPU; scripts/bench_engine_host.py):
2.3 ms of collections a plan on average, the longest 101 ms; with the start-up heap frozen,
0.7 ms, the longest 10 ms.

``freeze``: once the engine is built, what is alive moves to the permanent generation
(``gc.freeze``), which no collection visits (vLLM freezes its start-up heap too). Reference
counting still frees what is not in a cycle; ``release`` (the engine's shutdown) moves it back
so that what the engine held in reference cycles (a captured graph's closure over its owner,
and with it the KV pool) is collected again.
"""

from __future__ import annotations

import atexit
import gc
import sys

_at_exit = False  # the exit hook is registered


def freeze() -> None:
    """Freeze what is alive (O(1): no collection first; garbage in cycles frozen with it waits
    for ``release``, the engine's lifetime at most, or the interpreter's exit)."""
    global _at_exit
    if not _at_exit:  # an engine never shut down: its objects finalized at exit as before
        atexit.register(gc.unfreeze)  # (else nanobind reports Triton's objects as leaked)
        _at_exit = True
    gc.freeze()


def release() -> None:
    """Unfreeze (every engine's frozen heap: the next engine built freezes again)."""
    gc.unfreeze()


def return_device_memory() -> None:
    """After an engine's shutdown: collect what it held in reference cycles (the model, the KV
    pool, the graphs), then hand torch's cached CUDA blocks back to the driver. The caching
    allocator keeps a freed tensor's memory for this process, and the next engine or a Serve
    replica on the same GPU sizes its KV pool by what the driver reports free (a Serve
    replica started after an offline LLM in one process: docs/benchmarks.md §9). No-op for
    CUDA in a process that never initialized it."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()

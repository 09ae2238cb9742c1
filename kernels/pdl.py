"""Programmatic dependent launch (PDL) of the decode step's Triton kernels (Hopper and later).

In a CUDA graph a kernel starts only after the one before it has drained: its launch and the
dispatch of its first programs (~0.4-1 us) sit between every two kernels, ~250 times a forward
of Qwen2.5-0.5B (docs/benchmarks.md §8.35: 0.11 ms of gaps under 2 us a forward). Launched
with PDL, a kernel may be dispatched while its predecessor's last programs still run; it
waits in ``prologue`` (griddepcontrol.wait: the predecessor complete, its writes visible)
before it reads or writes anything, then lets its own successor be dispatched
(griddepcontrol.launch_dependents). Waiting first keeps every ordering of the unlaunched
stream: a kernel's wait covers its predecessor, whose wait covered the one before.

Off by default (``EngineConfig.pdl``; ``set_enabled``): a switch for the whole process, read
at each launch, so that kernels launched from many modules follow one setting. Never under
Triton's interpreter (the CPU tests), which has no grid dependency control.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_enabled = False


def set_enabled(on: bool) -> None:
    """Launch the kernels that take part with PDL (on) or as plain launches (off)."""
    global _enabled
    _enabled = bool(on) and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def enabled() -> bool:
    return _enabled


def launch_options() -> dict:
    """Keyword arguments of a taking-part kernel's launch: its GDC constexpr (the prologue
    compiled in) and Triton's launch_pdl."""
    return {"GDC": True, "launch_pdl": True} if _enabled else {"GDC": False}


@triton.jit
def prologue(GDC: tl.constexpr):
    """First thing in a taking-part kernel: wait for the predecessor, then let the successor
    be dispatched (module docstring)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

"""Programmatic dependent launch (PDL) of the decoder layer's Triton kernels: the one switch.

Why: a CUDA-graph decode step runs ~8 small latency-bound kernels a layer, and a plain launch
starts only after its predecessor has drained and flushed its writes, then pays its own
dispatch and ramp-up. Launched with PDL (compute capability >= 9), a kernel may be dispatched
while its predecessor still runs; it does what needs nothing of the step first (index math,
asking L2 for its weight slice) and then waits on the device, ``gdc_wait``
(griddepcontrol.wait: every grid it depends on complete, their writes visible).

The switch, ``enabled(device)``, is read at each launch: on by default on a CUDA device of
compute capability >= 9 (ASPIRE_PDL=0 turns it off), never under Triton's interpreter; on by
default since its GPU token tests passed in every mode (ar, aspire_fixed, aspire and the
deterministic ar, bf16 tokens bit for bit: tests/test_gpu_engine.py, H100, docs/benchmarks.md
§8.54). Off, a launch passes USE_GDC=False and no ``launch_pdl``: the constexpr branches
vanish and the kernels compile as they did before. On, USE_GDC=True (a variant of its own:
constexprs are in Triton's cache key) and ``launch_pdl=True``. A CUDA graph keeps the launches
of its capture, so an engine's graphs keep the setting they were captured under: the
benchmarks set it per mode (scripts/bench_decode.py ``ENV_VARIANTS``, the ``nopdl`` and
``pdl`` mode suffixes).

The rules every kernel keeps with USE_GDC, and why they keep the step ordered:
1. ``gdc_wait`` before the first load of anything a kernel of the step may write (the
   activations, the residual, the KV cache, positions, slots, page and work lists and their
   counts) and before the first store. Loads, since the predecessor may not have written it
   yet; stores, since the predecessor may still be reading what they overwrite (also memory
   the caching allocator hands out again once a tensor that the predecessor reads is freed:
   the allocator counts on stream order).
2. Before the wait, only what no kernel of a step writes: the model's weights (parameters
   loaded once) as loads, and L2 prefetches (``prefetch_rows``; a hint that reads nothing
   into registers, so it would be safe at any address). The cos / sin tables are constant
   too, but a row's entries are found through its position, which the step writes.
3. ``gdc_wait`` in every program, before any early return. A wait covers only the grids this
   one depends on directly; ordering reaches further back because each of those could only
   complete after its own wait returned. A program that returned without waiting would let
   its grid complete before its predecessor, and the next kernel's wait would no longer imply
   that the one before had finished. (The attention's and the merge's early returns read the
   step's item count, which a plan kernel of the same step writes: they follow the wait
   anyway.)
4. ``gdc_launch_dependents`` only lets the next grid be dispatched into its own pre-wait part;
   that grid's wait still waits for this one to complete and flush, so any placement is
   correct and the place is a matter of speed: right after the wait in the one-pass kernels
   (the norms, SiLU, RoPE: the projection after a norm prefetches its weights while the norm
   runs), after the main loop in the GEMMs and the attention (earlier, the next grid's
   programs would hold SM slots, waiting, through the whole loop).
A kernel launched without PDL after one with it starts once that one completed, which by
rule 3 implies its predecessors completed: cuBLAS, torch's and the plan kernels need nothing.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .interpreter import interpreting

ENV = "ASPIRE_PDL"  # "0": off; unset or anything else: on (where the device allows)


def enabled(device: torch.device) -> bool:
    """Whether a kernel launched now on ``device`` takes part (module docstring): read at
    each launch, so that a benchmark can switch it between engines of one process."""
    if os.environ.get(ENV, "1") == "0":
        return False
    return _capable(device)


@functools.cache
def _capable(device: torch.device) -> bool:
    return (device.type == "cuda" and not interpreting()
            and torch.cuda.get_device_capability(device)[0] >= 9)  # fmt: skip


def launch_options(device: torch.device) -> dict:
    """A taking-part kernel's launch keywords: its USE_GDC constexpr, and ``launch_pdl`` only
    when on (the interpreter's launches never see it)."""
    return {"USE_GDC": True, "launch_pdl": True} if enabled(device) else {"USE_GDC": False}


@triton.jit
def prefetch_rows(rows, K):
    """Ask L2 for the first K elements of each row at ``rows`` (a program's weight rows,
    pointers [R]), one ``prefetch.global.L2`` per 128-byte line: issued before the wait, so
    that the weight bytes stream in while the predecessor runs and the K loop after the wait
    reads them from L2. Nothing is loaded into registers (the loop and its arithmetic are
    untouched); lines past K repeat the row's last one."""
    LINE: tl.constexpr = 1024 // rows.dtype.element_ty.primitive_bitwidth  # elements a line
    LINES: tl.constexpr = 8  # a row's lines per step: [R, 8] spreads over a program's threads
    c = tl.arange(0, LINES) * LINE
    for k0 in range(0, K, LINES * LINE):
        ptrs = rows[:, None] + tl.minimum(k0 + c, K - 1)[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip

"""The Triton attention kernel's settings and input checks, in a module without triton.

``paged_attention.py`` (and so ``triton``) is imported only where the Triton backend runs;
code that only names its config (the CUDA-graph plans, the worker) or validates inputs
imports this module instead, so that a CPU install without triton never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .metadata import PagedKVMeta


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch parameters (defaults chosen on an H200: scripts/bench_kernels.py)."""

    block_m_min: int = 16  # smallest query-row tile (decode rows)
    block_m_max: int = 64  # largest query-row tile (prefill chunks)
    block_n: int = 128  # KV tokens per tile (capped for prefill tiles, fp32 and head_dim > 128)
    num_warps: int = 4
    num_stages: int = 3
    waves: float = 8.0  # at most ~this many programs per SM; rows are split to reach it
    min_chunk_pages: int = 32  # never split a row into chunks smaller than this
    # The split-KV chunk (``wave_fit_cost``): attention programs an SM holds at once (the
    # register caps below give 3 on an H200 for every tile) and a program's fixed cost in pages
    # (first loads, partial write). The chunk is chosen so that the programs fill whole waves
    # of resident_programs x SMs: a step of a few long rows (a mixed step's verify rows) in
    # one wave of long chunks, not 2.6 waves of short ones (docs/benchmarks.md §8.26). None:
    # the older rule, chunks of total pages / (waves x SMs).
    resident_programs: int | None = 3
    ramp_pages: int = 16
    split_max_q: int = 64  # rows with more queries are never split (they have parallelism)
    kv_chunk_pages: int | None = None  # fixed chunk size in pages (tests); None: automatic
    # A split row's chunks of equal length (its pages over its split count), or (False) cut at
    # every chunk's multiple from KV token 0, so that a query's chunks depend on its position
    # only, not on how many keys its row holds past it (the deterministic mode).
    balanced_chunks: bool = True
    # the split-KV merge: heads per program (None: 256 // head_dim) and splits loaded at once
    merge_head_block: int | None = None
    merge_split_block: int = 16
    # The split-KV merge folded into the attention launch (issue 14): the last of a query
    # tile's split programs to finish (a per-tile arrival counter, ``paged_attention``'s
    # ``_merge_tile``) merges the tile's partials, so a layer makes one launch fewer. A small
    # model's decode step spends ~4 us a layer of ~115 on the merge launch (SmolLM2-135M).
    # On: in one H100 run (random weights at the real shapes, graph replays, docs/benchmarks.md
    # §8.53) it took SmolLM2's `ar` step at 6.2k x 64 from 4.516 to 4.446 ms, and with PDL
    # magicdec's draft from 1.276 to 1.162 ms; the GPU tests give `ar`'s tokens in every mode
    # (tests/test_gpu_engine.py, ``test_the_merge_inside_the_attention_launch_...``).
    # Its bits are not the separate merge's (~3e-8 apart in fp32 there): False for that launch.
    fused_merge: bool = True
    # a plan's launches of different query tiles (a mixed step's draft rows and verify rows)
    # run on their own CUDA streams, side by side: one after another, the draft rows' short
    # launch leaves most SMs idle while it drains (docs/benchmarks.md §8.23)
    concurrent_launches: bool = True
    # A mixed step's plan with wide tiles (``FixedPlan.for_rows``): where any row holds
    # several queries, every row, draft rows too, takes the widest tile, so the step's
    # attention is one launch. Two launches (the draft rows' 16-row tile beside the verify
    # rows' 64-row one), side by side or not, took 1.2-1.4x as long on an H200 (10 verify
    # rows of 9 queries at 32k + 40 draft rows of 140 pages: 112 against 79 us;
    # docs/benchmarks.md §8.27). False: draft rows keep their own tile and launch.
    mixed_one_launch: bool = True
    # Register caps of the attention programs (ptxas's maxnreg; None: the compiler's choice)
    # for 16-row query tiles (decode and draft rows), 32-row ones (below) and wider ones
    # (verify rows, prefill chunks). Registers bound the programs resident on an SM: on an
    # H200 a 16-row tile takes 143 of them (3 programs an SM) and fits in 96 without spills
    # (5), a 64-row tile 235 (2) and fits in 168 (3) (ptxas -v on the sm_90a build;
    # docs/benchmarks.md §8.23).
    # Timed there, the wide cap makes a 6-query verify row's attention 11% faster and the 16-row
    # cap gains nothing (docs/benchmarks.md §8.24), so only the wide one is on by default.
    max_registers: int | None = None
    wide_max_registers: int | None = 168
    # The cap of 32-row tiles (verify rows of 6-9 queries of 3-head groups: SmolLM2's; None:
    # max_registers'): uncapped, a 6-query row's attention took 1.32x a 1-query row's, capped
    # 1.09x (H100, SmolLM2's shape at 7,300 tokens; Qwen2.5's 32-row tiles unchanged;
    # docs/benchmarks.md §8.36).
    mid_max_registers: int | None = 168
    # Rows of at least sdpa_min_queries queries (prefill chunks: compute-bound, where the paged
    # kernel's decode-shaped tiles lose to a flash kernel) through torch's SDPA over their
    # gathered K/V (``kernels/sdpa_rows.py``): "auto" on CUDA, "on" (tests on the CPU), "off".
    # Never in a call that returns the log-sum-exp (the refresh layer's scoring) nor in the
    # deterministic mode (a flash kernel's tiling follows its row's shape). Off by default
    # until timed on a GPU (``scripts/bench_prefill.py``).
    prefill_sdpa: str = "off"
    sdpa_min_queries: int = 512
    # Internal (set per call by ``paged_attention``): rows of at least this many queries get no
    # work item, their output written elsewhere (``prefill_sdpa``); 0: every row.
    skip_queries: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m_min", "block_m_max", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.block_m_min > self.block_m_max:
            raise ValueError(f"block_m_min {self.block_m_min} > block_m_max {self.block_m_max}")
        for name in ("merge_head_block", "merge_split_block"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two >= 1, got {value}")
        for name in ("max_registers", "wide_max_registers", "mid_max_registers"):
            value = getattr(self, name)
            if value is not None and not 24 <= value <= 255:
                raise ValueError(f"{name} must be in [24, 255] registers, got {value}")
        if self.resident_programs is not None and self.resident_programs < 1:
            raise ValueError(f"resident_programs must be >= 1, got {self.resident_programs}")
        if self.ramp_pages < 0:
            raise ValueError(f"ramp_pages must be >= 0, got {self.ramp_pages}")
        if self.kv_chunk_pages is not None and self.kv_chunk_pages < 1:
            raise ValueError(f"kv_chunk_pages must be >= 1, got {self.kv_chunk_pages}")
        if not isinstance(self.fused_merge, bool):
            raise ValueError(f"fused_merge must be a bool, got {self.fused_merge!r}")
        if self.prefill_sdpa not in ("auto", "on", "off"):
            raise ValueError(f"prefill_sdpa must be 'auto', 'on' or 'off', got "
                             f"{self.prefill_sdpa!r}")
        if self.sdpa_min_queries < 2 or self.skip_queries < 0:
            raise ValueError(f"sdpa_min_queries must be >= 2 and skip_queries >= 0, got "
                             f"{self.sdpa_min_queries}, {self.skip_queries}")


DEFAULT_CONFIG = AttentionConfig()

# The deterministic mode's attention (EngineConfig.deterministic, issue 18): every row in the
# widest query tile (a query's products then do not depend on the tile it shares or its place
# there) and every row's KV cut into chunks of one page count from KV token 0, whatever its
# query count and length (so a query's chunks, each one online-softmax pass and then the merge
# in chunk order, depend on its position only; chunks past a query's causal limit add exact
# zeros). Balanced chunks would move a query's chunk boundaries whenever its row holds one more
# page than it sees: a verify row across a page boundary, a prompt prefilled in other pieces.
DETERMINISTIC = dict(block_m_min=64, block_m_max=64, kv_chunk_pages=64, split_max_q=1 << 30,
                     balanced_chunks=False, mixed_one_launch=True,
                     prefill_sdpa="off")  # fmt: skip

# splits of a step's longest row tried by the wave-fitted chunk rule (1..FIT_SPLITS)
FIT_SPLITS = 64


def wave_fit_cost(chunk: int, items: int, hkv: int, slots: int, ramp_pages: int) -> int:
    """The wave-fitted split rule's price of a chunk (in pages of one program's KV): the
    waves its ``items`` x ``hkv`` programs take on ``slots`` resident programs, times a
    program's time, its chunk plus its fixed cost. The planners try the chunks that cut the
    step's longest row into 1..FIT_SPLITS balanced parts (none under ``min_chunk_pages``, and
    at most ``spread`` items more than one chunk a row gives, the capacities' bound) and take
    the cheapest, the longest on a tie: ``paged_attention._fit_chunk`` (numpy),
    ``device_plan._fit_chunk`` (torch) and ``plan_kernel._plan_kernel`` (Triton) agree."""
    return -(-items * hkv // slots) * (chunk + ramp_pages)


def query_tile_tokens(config: AttentionConfig, group: int) -> int:
    """Query tokens of one row that share a K/V tile load: the widest query tile holds
    block_m_max // group tokens of a GQA group (one, where a group is wider than the tile). A
    row of q queries reads its KV once per tile, ceil(q / this) times: a 10-query verify row of
    Qwen2.5's 7-head groups reads its KV twice (docs/benchmarks.md §8.20)."""
    return max(1, config.block_m_max // group)


def check_meta(meta: PagedKVMeta, device: torch.device, planned: bool = False) -> None:
    """Host copies must exist (planning must not sync; a fixed plan or a work list planned on
    the device, ``planned``, needs none) and index tensors be int32 on device."""
    if not planned and meta.fixed_plan is None and (
            meta.qo_indptr_host is None or meta.kv_indptr_host is None
            or meta.kv_last_page_len_host is None):  # fmt: skip
        raise ValueError("PagedKVMeta needs its *_host copies (build it with PagedKVMeta.build)")
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or t.device != device or not t.is_contiguous():
            raise ValueError(
                f"meta.{name} must be a contiguous int32 tensor on {device}, "
                f"got {t.dtype} on {t.device} (contiguous={t.is_contiguous()})"
            )


def check_cache(kv_cache: torch.Tensor, page_size: int, head_dim: int, dtype: torch.dtype) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [P, 2, ps, Hkv, D], got {tuple(kv_cache.shape)}")
    if kv_cache.shape[2] != page_size or kv_cache.shape[4] != head_dim:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} does not match page_size {page_size} "
            f"and head_dim {head_dim}"
        )
    if kv_cache.dtype != dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from q dtype {dtype}")
    if kv_cache.stride(4) != 1:
        raise ValueError(f"kv_cache last dim must be contiguous, strides {kv_cache.stride()}")


def check_q(q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q dtype must be bf16, fp16 or fp32, got {q.dtype}")
    d = q.shape[2]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {d}")
    if q.stride(2) != 1:
        raise ValueError(f"q last dim must be contiguous, strides {q.stride()}")
    if q.device != kv_cache.device:
        raise ValueError(f"q on {q.device} but kv_cache on {kv_cache.device}")
    if q.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"{q.shape[1]} q heads are not a multiple of {kv_cache.shape[3]} kv heads")

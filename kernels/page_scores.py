"""Triton refresh-layer scoring: per listed KV token (or summed per page) the attention
probability maximised over the query heads.

Meaning: ``reference.token_max_probs_ref`` and ``reference.page_scores_ref`` (its sum over each
page's tokens). Shapes (R rows, Hq/Hkv heads, D head dim):
    q:        [R, Hq, D]          one query per row, same dtype as the cache
    lse:      [R, Hq] float32     natural-log log-sum-exp of that query's full attention
    kv_cache: [P, 2, ps, Hkv, D]
    token_max_probs -> [nnz_pages, ps] float32: (p, u) = max_h exp(scale * q_h . k_u - lse_h),
                       0 past kv_len (tensor parallelism takes the max over ranks, then sums)
    page_scores     -> [nnz_pages] float32: the sum over each listed page's tokens (one rank)

A work item is ``work_tokens(ps)`` consecutive listed tokens of one row, read in tiles of
whole pages; each key is read once for the GQA group's queries that share it. Programs loop
over the items (a grid of a few per SM, not one per item: a CUDA graph's capacity is sized
for the largest step and most of it is empty in most steps, and empty programs cost time).
Row r's output occupies the flat range [kv_indptr[r] (* ps), kv_indptr[r + 1] (* ps)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .host import ragged_arange, upload
from .interpreter import interpreting
from .metadata import PagedKVMeta
from .paged_attention import _num_sms, check_cache, check_meta, check_q, mma

_LOG2E = 1.4426950408889634
_MAX_STAGED_ROW_BYTES = 256  # a key row (head_dim x element size) staged in shared memory


@dataclass(frozen=True)
class ScoreConfig:
    """The scoring kernel's program shape (``scripts/bench_scoring.py`` measures variants)."""

    tile_tokens: int = 64  # keys per tile (at least one page)
    tiles_per_item: int = 4  # tiles of one work item, read one after the other
    programs_per_sm: int = 8
    num_warps: int = 4
    # 2: the next tile's keys load while this one is scored (H200, 64 x 32k rows: 138 us, 1.12x
    # the K floor, against 204 us with 1 stage and 184 us with 3: docs/bench_scoring_h200.json)
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("tile_tokens", "tiles_per_item", "programs_per_sm", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 1, got {value}")
        if self.tile_tokens < 16 or self.num_stages < 1:
            raise ValueError(f"tile_tokens must be >= 16 and num_stages >= 1, got {self}")

    def tile(self, page_size: int) -> int:
        return max(self.tile_tokens, page_size)


DEFAULT_SCORE_CONFIG = ScoreConfig()


def work_tokens(page_size: int, config: ScoreConfig = DEFAULT_SCORE_CONFIG) -> int:
    """Listed tokens per work item (a multiple of the page size)."""
    return config.tile(page_size) * config.tiles_per_item


# vary every step (or bucket): no new variants mid-serving
@triton.jit(do_not_specialize=["work_ptr", "count_ptr", "capacity"])
def _token_max_probs_kernel(
    q_ptr, lse_ptr, kv_ptr, out_ptr, work_ptr, count_ptr, capacity, kv_indptr_ptr, kv_indices_ptr,
    last_len_ptr, stride_qr, stride_qh, stride_lr, stride_kp, stride_ks, stride_kh, scale_log2,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
    PAGE_SUM: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    count = tl.load(count_ptr)  # the work lists cover a capacity (CUDA graphs)
    d = tl.arange(0, HEAD_DIM)
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    for wid in range(tl.program_id(0), count, tl.num_programs(0)):
        row = tl.load(work_ptr + wid)
        first = tl.load(work_ptr + capacity + wid)
        page_lo = tl.load(kv_indptr_ptr + row)
        n_pages = tl.load(kv_indptr_ptr + row + 1) - page_lo
        kv_len = (n_pages - 1) * PAGE_SIZE + tl.load(last_len_ptr + row)
        for t in range(TILES):  # not unrolled: one tile's loads in flight per program
            n = first + t * TILE + tl.arange(0, TILE)
            n_ok = n < kv_len
            page = tl.load(kv_indices_ptr + page_lo + n // PAGE_SIZE, mask=n_ok, other=0)
            k_off = page.to(tl.int64) * stride_kp + (n % PAGE_SIZE) * stride_ks
            best = tl.zeros([TILE], tl.float32)
            for h in tl.static_range(NUM_KV_HEADS):
                k = tl.load(kv_ptr + k_off[:, None] + h * stride_kh + d[None, :],
                            mask=n_ok[:, None], other=0.0)  # fmt: skip
                heads = h * GROUP + g
                q = tl.load(q_ptr + row * stride_qr + heads[:, None] * stride_qh + d[None, :],
                            mask=g_ok[:, None], other=0.0)  # fmt: skip
                lse = tl.load(lse_ptr + row * stride_lr + heads, mask=g_ok, other=float("inf"))
                s = mma(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale_log2
                s -= lse[:, None] * 1.4426950408889634
                best = tl.maximum(best, tl.max(tl.exp2(s), 0))  # padding heads: exp2(-inf) = 0
            best = tl.where(n_ok, best, 0.0)
            if PAGE_SUM:
                P: tl.constexpr = TILE // PAGE_SIZE
                sums = tl.sum(tl.reshape(best, [P, PAGE_SIZE]), 1)
                p = (first + t * TILE) // PAGE_SIZE + tl.arange(0, P)
                tl.store(out_ptr + page_lo + p, sums, mask=p < n_pages)
            else:
                tl.store(out_ptr + page_lo.to(tl.int64) * PAGE_SIZE + n, best,
                         mask=n < n_pages * PAGE_SIZE)  # fmt: skip


def _host_work(meta: PagedKVMeta, config: ScoreConfig = DEFAULT_SCORE_CONFIG) -> np.ndarray:
    """int64 [2, W]: (row, first token) of each work item."""
    per_item = work_tokens(meta.page_size, config)
    slots = np.diff(np.asarray(meta.kv_indptr_host, dtype=np.int64)) * meta.page_size
    per_row = -(-slots // per_item)
    rows = np.repeat(np.arange(len(per_row)), per_row)
    return np.stack([rows, ragged_arange(per_row) * per_item])


def _work(meta: PagedKVMeta, config: ScoreConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(work int32 [2, W], count int32 [1], W) on the device; cached on the metadata object."""
    cache = meta.__dict__.setdefault("_triton_score_work", {})
    key = work_tokens(meta.page_size, config)
    if key not in cache:
        work = _host_work(meta, config)
        w = work.shape[1]
        dev = upload(np.concatenate([[w, 0, 0, 0], work.reshape(-1)]).astype(np.int32),
                     meta.kv_indptr.device)  # fmt: skip
        cache[key] = (dev[4:].view(2, w), dev[:1], w)
    return cache[key]


def _score(q: torch.Tensor, lse: torch.Tensor, kv_cache: torch.Tensor, meta: PagedKVMeta,
           scale: float, work: tuple[torch.Tensor, torch.Tensor] | None,
           page_sum: bool, config: ScoreConfig) -> torch.Tensor:  # fmt: skip
    check_q(q, kv_cache)
    check_cache(kv_cache, meta.page_size, q.shape[2], q.dtype)
    check_meta(meta, q.device, planned=work is not None)
    r, hq, d = q.shape
    if r != meta.num_rows:
        raise ValueError(f"q has {r} rows (one query per row) but meta has {meta.num_rows} rows")
    if lse.shape != (r, hq) or lse.dtype != torch.float32 or lse.stride(1) != 1:
        raise ValueError(
            f"lse must be float32 [{r}, {hq}] with contiguous heads, got {lse.dtype} "
            f"{tuple(lse.shape)} strides {lse.stride()}"
        )
    hkv = kv_cache.shape[3]
    group = hq // hkv
    ps = meta.page_size
    nnz = meta.kv_indices.shape[0]
    out = torch.empty((nnz,) if page_sum else (nnz, ps), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if work is not None:
        (work, count), capacity = work, work[0].shape[1]
    else:
        work, count, capacity = _work(meta, config)
    if capacity == 0:
        return out.zero_()
    programs = min(capacity, config.programs_per_sm * _num_sms(q.device))
    # staged keys take stages x tile x row bytes of shared memory: fp32 rows of 128 (512 B)
    # in 2 stages asked an H200 for 329 KB of its 227 KB; wider rows go unstaged
    stages = config.num_stages if q.element_size() * d <= _MAX_STAGED_ROW_BYTES else 1
    _token_max_probs_kernel[(programs,)](
        q, lse, kv_cache, out, work, count, capacity, meta.kv_indptr, meta.kv_indices,
        meta.kv_last_page_len, q.stride(0), q.stride(1), lse.stride(0), kv_cache.stride(0),
        kv_cache.stride(2), kv_cache.stride(3), scale * _LOG2E,
        NUM_KV_HEADS=hkv, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d, PAGE_SIZE=ps, TILE=config.tile(ps), TILES=config.tiles_per_item,
        PAGE_SUM=page_sum, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreting(), num_warps=config.num_warps, num_stages=stages,
    )  # fmt: skip
    return out


def token_max_probs(
    q: torch.Tensor, lse: torch.Tensor, kv_cache: torch.Tensor, meta: PagedKVMeta, scale: float,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: ScoreConfig = DEFAULT_SCORE_CONFIG,
) -> torch.Tensor:
    """q [R, Hq, D], lse [R, Hq] float32 -> float32 [nnz_pages, page_size] (0 past kv_len).

    work: (int32 [2, capacity], int32 [1] count), a work list planned on the device
    (``device_plan.score_items`` with ``work_tokens(page_size, config)``, CUDA graphs). None:
    planned from the metadata's host copies. Pages past the listed ones (a fixed capacity) are
    not written."""
    return _score(q, lse, kv_cache, meta, scale, work, False, config)


def page_scores(
    q: torch.Tensor, lse: torch.Tensor, kv_cache: torch.Tensor, meta: PagedKVMeta, scale: float,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: ScoreConfig = DEFAULT_SCORE_CONFIG,
) -> torch.Tensor:
    """``token_max_probs`` summed over each page's tokens, in the kernel: float32 [nnz_pages]
    (no [nnz, page_size] buffer and no second pass over it)."""
    return _score(q, lse, kv_cache, meta, scale, work, True, config)

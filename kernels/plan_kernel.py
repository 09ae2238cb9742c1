"""The attention work of a CUDA-graph step planned by one Triton launch on the device.

``device_plan.attention_items`` computes a fixed plan's work lists with ~40 small tensor ops a
plan (cumsums, searchsorted, wheres, stacks, copies into the plan buffer), and a graph step
plans two or three such lists: in a replay they are kernels of a few microseconds each, most
of their time launch and drain. This kernel writes the same lists straight into the plan's
int32 buffer (``paged_attention.FixedPlan``) from one launch of one program per row.

Meaning: item for item ``device_plan.attention_items`` (and so ``_host_plan``), tested in
``tests/kernels/test_device_plan.py``. Every program reads every row's page count and query
count (rows are at most a bucket, a few hundred), computes the step-wide split chunk and the
rows' offsets itself, and writes its own row's items and merge entries; program 0 writes the
counts. Entries past a count are left as they were (the kernels never read them).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention_config import FIT_SPLITS, AttentionConfig
from .device_plan import _block_m

_MAX_LAUNCHES = 4  # query tiles 16..128: at most four launches a plan
_ITEMS_BLOCK = 32


@triton.jit
def _next_pow2(x):
    v = tl.maximum(x - 1, 0)
    v = v | (v >> 1)
    v = v | (v >> 2)
    v = v | (v >> 4)
    v = v | (v >> 8)
    v = v | (v >> 16)
    return v + 1


@triton.jit
def _excl_cumsum(x):
    return tl.cumsum(x, 0) - x


@triton.jit
def _pick(vec, r, me):
    """vec[me] as a scalar (vec is [BLOCK_R])."""
    return tl.sum(tl.where(r == me, vec, 0), 0)


@triton.jit
def _fit_chunk(n_pages, blocks, splittable, r_ok, spread, HKV: tl.constexpr,
               SLOTS: tl.constexpr, RAMP: tl.constexpr, MIN_CHUNK: tl.constexpr,
               FIT_SPLITS: tl.constexpr, FIT_GROUP: tl.constexpr):  # fmt: skip
    """``paged_attention._fit_chunk``: the chunk of the cheapest of k = 1..FIT_SPLITS parts of
    the longest splittable row, the first (longest chunk) on a tie. n_pages, blocks int32
    [BLOCK_R]. The k are tried FIT_GROUP at a time as [FIT_GROUP, BLOCK_R] tiles (int32: a
    loop of one k a step in int64 made the launch 32 us at 64 rows on an H100, now 10 us;
    docs/benchmarks.md §8.35)."""
    n_max = tl.max(tl.where(splittable & r_ok, n_pages, 0), 0)
    live = n_pages > 0
    items_1 = tl.sum(tl.where(live, blocks, 0), 0)  # one chunk a row
    best = tl.full([], 2147483647, tl.int32)
    chunk = tl.maximum(n_max, MIN_CHUNK)
    for g in tl.static_range(0, FIT_SPLITS, FIT_GROUP):
        k = g + 1 + tl.arange(0, FIT_GROUP)  # [G]
        c = tl.maximum((n_max + k - 1) // k, MIN_CHUNK)  # [G]
        splits = tl.where(splittable[None, :], (n_pages[None, :] + c[:, None] - 1) // c[:, None],
                          1)  # [G, R]  # fmt: skip
        items = tl.sum(tl.where(live[None, :], splits * blocks[None, :], 0), 1)  # [G]
        cost = (items * HKV + SLOTS - 1) // SLOTS * (c + RAMP)
        # capacities hold spread items beyond one chunk a row (FixedPlan.for_rows)
        cost = tl.where((k <= FIT_SPLITS) & (items <= spread + items_1), cost, 2147483647)
        g_best = tl.min(cost, 0)
        g_chunk = tl.sum(tl.where(k == tl.min(tl.where(cost == g_best, k, 2147483647), 0), c, 0),
                         0)  # the group's first k at its least cost  # fmt: skip
        better = g_best < best  # strict: an earlier group keeps a tie
        chunk = tl.where(better, g_chunk, chunk)
        best = tl.where(better, g_best, best)
    return chunk


@triton.jit
def _write_items(buf_ptr, start, capacity, off, n_items, row, tokens, splits, per, kv_len,
                 part_base, PAGE_SIZE: tl.constexpr, BLOCK_I: tl.constexpr):  # fmt: skip
    """Row ``row``'s n_items items (query tile b major, chunk s minor) at offset ``off``."""
    n_split = tl.maximum(splits, 1)
    is_split = splits > 1
    work = buf_ptr + start + 4
    for j0 in range(0, n_items, BLOCK_I):
        j = j0 + tl.arange(0, BLOCK_I)
        e = off + j
        ok = (j < n_items) & (e < capacity)
        s = j % n_split
        lo = tl.where(is_split, s * per * PAGE_SIZE, 0)
        hi = tl.where(is_split, tl.minimum((s + 1) * per * PAGE_SIZE, kv_len), kv_len)
        tl.store(work + e, tl.zeros_like(j) + row, mask=ok)
        tl.store(work + capacity + e, (j // n_split * tokens).to(tl.int32), mask=ok)
        tl.store(work + 2 * capacity + e, lo.to(tl.int32), mask=ok)
        tl.store(work + 3 * capacity + e, hi.to(tl.int32), mask=ok)
        tl.store(work + 4 * capacity + e, tl.where(is_split, s, -1).to(tl.int32), mask=ok)
        tl.store(work + 5 * capacity + e, (tl.zeros_like(j) + part_base).to(tl.int32), mask=ok)


@triton.jit
def _plan_kernel(
    buf_ptr, kv_indptr_ptr, last_len_ptr, n_q_ptr, num_rows, capacity, merge_capacity,
    start0, start1, start2, start3, merge_start, target, spread,
    NUM_LAUNCHES: tl.constexpr, BM0: tl.constexpr, BM1: tl.constexpr, BM2: tl.constexpr,
    BM3: tl.constexpr, GROUP: tl.constexpr, HKV: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BM_MIN: tl.constexpr, BM_MAX: tl.constexpr, BM_WIDE: tl.constexpr, BM_ONE: tl.constexpr,
    MIN_CHUNK: tl.constexpr, FIXED_CHUNK: tl.constexpr, SPLIT_MAX_Q: tl.constexpr,
    BALANCED: tl.constexpr,
    WIDE: tl.constexpr, ONE_LAUNCH: tl.constexpr, UNIFORM_Q: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
    SLOTS: tl.constexpr, RAMP: tl.constexpr, FIT_SPLITS: tl.constexpr, FIT_GROUP: tl.constexpr,
):  # fmt: skip
    me = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    lo_ptr = tl.load(kv_indptr_ptr + r, mask=r_ok, other=0).to(tl.int64)
    hi_ptr = tl.load(kv_indptr_ptr + r + 1, mask=r_ok, other=0).to(tl.int64)
    n_pages = hi_ptr - lo_ptr
    last = tl.load(last_len_ptr + r, mask=r_ok, other=0).to(tl.int64)
    kv_len = (n_pages - 1) * PAGE_SIZE + last
    if UNIFORM_Q > 0:
        n_q = tl.where(r_ok, UNIFORM_Q, 0).to(tl.int64)
        row_bm = tl.zeros_like(n_q) + BM0
    else:
        n_q = tl.load(n_q_ptr + r, mask=r_ok, other=0).to(tl.int64)
        if WIDE:
            wide = n_q > 1
            if ONE_LAUNCH:  # a row of several queries takes every row into the widest tile
                wide = wide | (tl.max(wide.to(tl.int32), 0) > 0)
            row_bm = tl.where(wide, BM_WIDE, BM_ONE).to(tl.int64)
        else:
            row_bm = tl.minimum(tl.maximum(_next_pow2(n_q * GROUP), BM_MIN), BM_MAX)
    qo_start = _excl_cumsum(n_q)
    tokens = row_bm // GROUP
    blocks = (n_q + tokens - 1) // tokens
    if FIXED_CHUNK > 0:
        chunk = FIXED_CHUNK
    elif SLOTS > 0:  # the wave-fitted chunk: paged_attention._fit_chunk, item for item
        chunk = _fit_chunk(n_pages.to(tl.int32), blocks.to(tl.int32), n_q <= SPLIT_MAX_Q, r_ok,
                           spread, HKV, SLOTS, RAMP, MIN_CHUNK, FIT_SPLITS, FIT_GROUP)  # fmt: skip
    else:  # the host's math.ceil(total * hkv / target), target an integer here
        total = tl.sum(n_pages * blocks, 0)
        chunk = tl.maximum((total * HKV + target - 1) // target, MIN_CHUNK)
    live = n_pages > 0
    splits = tl.where(n_q <= SPLIT_MAX_Q, (n_pages + chunk - 1) // chunk, live.to(tl.int64))
    splits = tl.where(live, tl.maximum(splits, 1), 0)
    per = (n_pages + splits - 1) // tl.maximum(splits, 1)  # pages per chunk, balanced
    if not BALANCED:  # cut at multiples of the chunk
        per = tl.where(splits > 1, chunk, per)
    splits = tl.where(live, (n_pages + per - 1) // tl.maximum(per, 1), 0)
    split_rows = splits > 1
    part_base = tl.where(split_rows, _excl_cumsum(tl.where(split_rows, splits * n_q, 0)), 0)

    my_splits, my_per = _pick(splits, r, me), _pick(per, r, me)
    my_len, my_tokens, my_bm = _pick(kv_len, r, me), _pick(tokens, r, me), _pick(row_bm, r, me)
    my_base, my_blocks = _pick(part_base, r, me), _pick(blocks, r, me)
    for i in tl.static_range(NUM_LAUNCHES):
        bm = BM0 if i == 0 else (BM1 if i == 1 else (BM2 if i == 2 else BM3))
        start = start0 if i == 0 else (start1 if i == 1 else (start2 if i == 2 else start3))
        if NUM_LAUNCHES == 1:
            per_row = splits * blocks
        else:
            per_row = tl.where(row_bm == bm, splits * blocks, 0)
        if me == 0:
            tl.store(buf_ptr + start, tl.sum(per_row, 0).to(tl.int32))
        if me < num_rows:
            if (NUM_LAUNCHES == 1) or (my_bm == bm):
                _write_items(buf_ptr, start, capacity, _pick(_excl_cumsum(per_row), r, me),
                             my_splits * my_blocks, me, my_tokens, my_splits, my_per, my_len,
                             my_base, PAGE_SIZE, BLOCK_I)  # fmt: skip
    # merge entries: each split row's queries, split rows in row order
    merge_n = tl.where(split_rows, n_q, 0)
    if me == 0:
        tl.store(buf_ptr + merge_start, tl.sum(merge_n, 0).to(tl.int32))
    if me < num_rows:
        if my_splits > 1:
            my_q, my_qo = _pick(n_q, r, me), _pick(qo_start, r, me)
            off = _pick(_excl_cumsum(merge_n), r, me)
            work = buf_ptr + merge_start + 4
            for t0 in range(0, my_q, BLOCK_I):
                t = t0 + tl.arange(0, BLOCK_I)
                e = off + t
                ok = (t < my_q) & (e < merge_capacity)
                tl.store(work + e, (my_qo + t).to(tl.int32), mask=ok)
                tl.store(work + merge_capacity + e, (tl.zeros_like(t) + my_splits).to(tl.int32),
                         mask=ok)  # fmt: skip
                tl.store(work + 2 * merge_capacity + e, (my_base + t).to(tl.int32), mask=ok)
                tl.store(work + 3 * merge_capacity + e, (tl.zeros_like(t) + my_q).to(tl.int32),
                         mask=ok)  # fmt: skip


def _fit_group(rows: int) -> int:
    """How many k the wave fit tries at once: [group, BLOCK_R] int32 tiles of ~4k entries
    (32 registers a thread for each at 4 warps), the whole 1..FIT_SPLITS for <= 64 rows."""
    block_r = max(16, triton.next_power_of_2(rows + 1))
    return max(1, min(triton.next_power_of_2(FIT_SPLITS), 4096 // block_r))


def fused_planning_fits(cfg: AttentionConfig, num_sms: int, block_ms: list[int]) -> bool:
    """Whether ``plan_into`` computes this plan exactly: the host's older float chunk rule is
    an integer ceiling only for an integral target (waves x SMs)."""
    target = cfg.waves * num_sms
    return len(block_ms) <= _MAX_LAUNCHES and (
        cfg.kv_chunk_pages is not None or cfg.resident_programs is not None
        or float(target).is_integer())  # fmt: skip


def plan_into(buffer: torch.Tensor, starts: list[int], capacity: int, merge_start: int,
              merge_capacity: int, kv_indptr: torch.Tensor, last_len: torch.Tensor,
              n_q: torch.Tensor | None, page_size: int, group: int, hkv: int,
              cfg: AttentionConfig, num_sms: int, block_ms: list[int], wide_tiles: bool = False,
              uniform_q: int | None = None) -> None:  # fmt: skip
    """Write ``attention_items``' lists into a fixed plan's int32 ``buffer``: the launches'
    segments at ``starts`` (count, then [6, capacity]), the merge's at ``merge_start`` (count,
    then [4, merge_capacity]). kv_indptr int [R + 1], last_len int [R], n_q int64 [R] (None
    with ``uniform_q``). One launch, no sync: capturable."""
    rows = kv_indptr.shape[0] - 1
    padded = list(starts) + [0] * (_MAX_LAUNCHES - len(starts))
    bms = list(block_ms) + [0] * (_MAX_LAUNCHES - len(block_ms))  # uniform_q: its tile first
    _plan_kernel[(max(rows, 1),)](
        buffer, kv_indptr, last_len, n_q if n_q is not None else last_len, rows, capacity,
        merge_capacity, *padded, merge_start, int(cfg.waves * num_sms),
        math.ceil(cfg.waves * num_sms / hkv),
        NUM_LAUNCHES=len(starts), BM0=bms[0], BM1=bms[1], BM2=bms[2], BM3=bms[3], GROUP=group,
        HKV=hkv, PAGE_SIZE=page_size, BM_MIN=cfg.block_m_min, BM_MAX=cfg.block_m_max,
        BM_WIDE=max(block_ms),
        BM_ONE=_block_m(1, group, cfg), MIN_CHUNK=cfg.min_chunk_pages,
        FIXED_CHUNK=cfg.kv_chunk_pages or 0, SPLIT_MAX_Q=cfg.split_max_q,
        BALANCED=cfg.balanced_chunks, WIDE=wide_tiles,
        ONE_LAUNCH=cfg.mixed_one_launch,
        UNIFORM_Q=uniform_q or 0, BLOCK_R=max(16, triton.next_power_of_2(rows + 1)),
        BLOCK_I=_ITEMS_BLOCK, SLOTS=(cfg.resident_programs or 0) * num_sms, RAMP=cfg.ramp_pages,
        FIT_SPLITS=FIT_SPLITS, FIT_GROUP=_fit_group(rows), num_warps=4,
    )  # fmt: skip

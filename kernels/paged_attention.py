"""Triton paged attention over ragged mixed batches (decode, verify and prefill rows in one call).

Meaning: ``reference.paged_attention_ref``. Shapes (T query tokens, Hq/Hkv heads, D head dim):
    q:        [T, Hq, D]             bf16 / fp16 / fp32, last dim contiguous
    kv_cache: [P, 2, ps, Hkv, D]     same dtype as q, last dim contiguous
    out:      [T, Hq, D]             q's dtype;  lse: [T, Hq] float32 (natural log)

Work decomposition, planned once per ``PagedKVMeta`` from its host copies (no device sync) and
cached on it, so every layer of a step reuses it:
- A program owns one kv head and a block of BLOCK_M "query rows", a row being one (query token,
  q head of that kv head's group): the GQA group shares every K/V tile it loads.
- BLOCK_M is the next power of two of a row's query rows, clamped to [block_m_min, block_m_max]:
  decode rows use a small tile, verify rows a medium one, prefill chunks the largest; rows of
  equal BLOCK_M share one launch.
- Split-KV (flash-decoding): a row's page list is cut into chunks of about equal size, one
  chunk length a step, chosen so that the step's programs fill whole waves of the programs the
  GPU holds at once (``AttentionConfig.resident_programs``, ``_fit_chunk``) even when few long
  rows are present. Each chunk writes a normalised partial output and its log-sum-exp; a merge
  kernel combines them (with ``AttentionConfig.fused_merge``, the last of a query tile's
  chunk programs to finish does, in the attention launch).
- Launch grids cover a plan's capacity and programs read the item count on the device, so a
  ``FixedPlan`` (fixed capacities, reloaded each step) lets a CUDA graph capture attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import triton
import triton.language as tl

# defined without triton (importers that only need the config or checks use that module)
from .attention_config import (
    DEFAULT_CONFIG,
    FIT_SPLITS,
    AttentionConfig,
    check_cache,
    check_meta,
    check_q,
    wave_fit_cost,
)
from .device_plan import attention_items, decode_attention_items
from .host import next_power_of_2, offsets, ragged_arange, upload
from .interpreter import interpreting
from .metadata import PagedKVMeta
from .pdl import launch_options
from .plan_kernel import fused_planning_fits, plan_into
from .sdpa_rows import sdpa_row_ids, sdpa_rows

_LOG2E = 1.4426950408889634
# Partial elements a fused merge loads at once (split block x query tile x head dim), 16 fp32
# registers a thread at 4 warps: the merge code sets the whole attention kernel's register
# count (ptxas -v, sm_90a, SmolLM2's 16-row decode tile: 74 registers without it, 86 with 2
# splits a load, 89 with 4, 128 with 8).
_MERGE_TILE = 2048
_CPU_SMS = 4  # stand-in SM count off the GPU (interpreter runs), small so that tests split


@triton.jit
def mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot; UPCAST computes in fp32 instead (exact for 16-bit inputs): Triton's interpreter
    multiplies bf16 operands as their raw uint16 bits."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


# Runtime counts, capacities and plan-buffer pointers vary from step to step (or bucket to
# bucket): specialising on them (== 1, % 16, 16-byte alignment) would compile new variants
# mid-serving, so they are not specialised.
@triton.jit(do_not_specialize=["work_ptr", "count_ptr", "capacity"])
def _attn_kernel(
    q_ptr, kv_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, counter_ptr, work_ptr, count_ptr,
    capacity, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, last_len_ptr,
    stride_qt, stride_qh, stride_kp, stride_kkv, stride_ks, stride_kh, stride_ot, stride_oh,
    num_q_heads, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RETURN_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_GDC: tl.constexpr,
    FUSED_MERGE: tl.constexpr, MERGE_SPLITS: tl.constexpr,
):  # fmt: skip
    # FUSED_MERGE (AttentionConfig.fused_merge): the last split program of a query tile merges
    # it (``_merge_tile``; counter_ptr: int32 [part_rows * hkv], zero between calls). Off,
    # counter_ptr is None and the branch compiles away: the kernel as it was without it.
    if USE_GDC:  # kernels/pdl.py: everything read here, the item count too, is the step's data
        tl.extra.cuda.gdc_wait()
    # The grid covers the plan's capacity x kv heads, kv head minor: the step's item count is
    # read on the device (a CUDA graph replays the same launch for any step that fits), and
    # the programs past it come last, so that the hardware dispatches every real program
    # before them (kv head major, the items of the first head and that head's empty tail
    # would hold the SMs while the second head's items waited: a one-wave plan in two).
    hkv = num_q_heads // GROUP
    wid = tl.program_id(0) // hkv
    kvh = tl.program_id(0) % hkv
    if wid >= tl.load(count_ptr):
        return
    # work item (columns of [6, capacity]): row, first query token, KV token range
    # [kv_lo, kv_hi), split index (-1: unsplit), the row's first partial row
    row = tl.load(work_ptr + wid)
    q_first = tl.load(work_ptr + capacity + wid)
    kv_lo = tl.load(work_ptr + 2 * capacity + wid)
    kv_hi = tl.load(work_ptr + 3 * capacity + wid)
    split = tl.load(work_ptr + 4 * capacity + wid)
    part_base = tl.load(work_ptr + 5 * capacity + wid)

    qo_start = tl.load(qo_indptr_ptr + row)
    n_q = tl.load(qo_indptr_ptr + row + 1) - qo_start
    page_lo = tl.load(kv_indptr_ptr + row)
    n_pages = tl.load(kv_indptr_ptr + row + 1) - page_lo
    kv_len = (n_pages - 1) * PAGE_SIZE + tl.load(last_len_ptr + row)

    TOKENS: tl.constexpr = BLOCK_M // GROUP
    m = tl.arange(0, BLOCK_M)
    tok = q_first + m // GROUP
    head = kvh * GROUP + m % GROUP
    row_ok = (m // GROUP < TOKENS) & (tok < n_q)
    q_pos = kv_len - n_q + tok  # causal: query tok sees KV tokens <= q_pos
    d = tl.arange(0, HEAD_DIM)
    q_off = (qo_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)

    last_tok = tl.minimum(q_first + TOKENS, n_q) - 1
    hi = tl.minimum(kv_hi, kv_len - n_q + last_tok + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    head_off = kvh * stride_kh
    # Wide tiles (verify rows, prefill chunks) below every query's causal limit (the tile's
    # first query sees up to kv_len - n_q + q_first) skip the [BLOCK_M, BLOCK_N] mask's
    # compares and selects, ~6% of a 6-token verify row's time; decode tiles always mask (the
    # branch slows their loop by ~12%; H200, scripts/bench_verify_rows.py).
    visible = tl.minimum(hi, kv_len - n_q + q_first + 1)
    for start in range(kv_lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(kv_indices_ptr + page_lo + n // PAGE_SIZE, mask=n_ok, other=0)
        k_off = page.to(tl.int64) * stride_kp + (n % PAGE_SIZE) * stride_ks + head_off
        k = tl.load(kv_ptr + k_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        v_ptrs = kv_ptr + stride_kkv + k_off[:, None] + d[None, :]
        v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        s = mma(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale_log2
        if BLOCK_M < 64:
            s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        elif start + BLOCK_N > visible:
            s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new

    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    # log2 units; -inf where this chunk is fully masked (and for padding rows)
    lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    if split < 0:
        o_off = (qo_start + tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])  # fmt: skip
        if RETURN_LSE:
            l_off = (qo_start + tok).to(tl.int64) * num_q_heads + head
            tl.store(lse_ptr + l_off, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        # a split row's partial rows: split-major, n_q per split
        p_off = (part_base + split * n_q + tok).to(tl.int64) * num_q_heads + head
        tl.store(opart_ptr + p_off[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None])
        tl.store(lpart_ptr + p_off, lse2, mask=row_ok)
        if FUSED_MERGE:
            # Every planner (_host_plan, device_plan.attention_items, plan_kernel) cuts a split
            # row's KV at multiples of per * PAGE_SIZE tokens into cdiv(n_pages, per) >= 2
            # chunks, so n_pages > per and split 0's chunk is whole: the split count needs no
            # work-list column (n_pages, not kv_len: the planners' own rule, whatever last_len).
            chunk = tl.where(split == 0, kv_hi, kv_lo // tl.maximum(split, 1))
            n_splits = tl.cdiv(n_pages * PAGE_SIZE, chunk)
            # one counter per (split row, query tile, kv head): a split row owns n_q * splits
            # >= n_q partial rows from part_base, and q_first < n_q
            counter = counter_ptr + (part_base + q_first) * hkv + kvh
            # GPU ordering (CUTLASS's split-K semaphore pattern): the barrier puts every
            # thread's partial stores before the atomic, which one thread issues; its release
            # (gpu scope, cumulative) orders them before the increment, and the last arriver's
            # acquire, passed on to its threads by the barrier that broadcasts its result,
            # makes every program's partials visible to its loads, which read L2 (.cg: L1 is
            # not coherent across SMs, a line cached there could be stale). The interpreter
            # runs programs one after another: there the tile's last item merges.
            tl.debug_barrier()
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == n_splits - 1:
                _merge_tile(out_ptr, lse_ptr, opart_ptr, lpart_ptr, part_base, n_splits, n_q,
                            qo_start, tok, head, row_ok, stride_ot, stride_oh, num_q_heads,
                            BLOCK_M, HEAD_DIM, MERGE_SPLITS, RETURN_LSE)  # fmt: skip
                # back to zero for the next call (a CUDA graph's replay too): every split of
                # the tile has arrived, none touches it again in this launch
                tl.store(counter, 0)


@triton.jit
def _merged(opart_ptr, lpart_ptr, first, stride, head, ok_rows, n_splits, num_q_heads,
            ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
            CACHE: tl.constexpr):  # fmt: skip
    """Online log-sum-exp merge of n_splits partials for ROWS (partial row, head) lanes:
    lane i's split s lies at partial row first[i] + s * stride, head head[i] (ok_rows [ROWS]:
    real lanes). SPLIT_BLOCK splits are loaded at once ([SPLIT_BLOCK, ROWS, HEAD_DIM] float32),
    in split order, so the result does not depend on which program merges. CACHE: the loads'
    cache modifier (".cg": L2, for partials other programs of this launch wrote) -> (acc
    [ROWS, HEAD_DIM], m_i, l_i [ROWS]) in log2 units, l_i 1 on padding lanes."""
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for s0 in range(0, n_splits, SPLIT_BLOCK):
        s = s0 + tl.arange(0, SPLIT_BLOCK)
        ok = (s < n_splits)[:, None] & ok_rows[None, :]  # [SPLIT_BLOCK, ROWS]
        p_off = (first[None, :] + s[:, None] * stride).to(tl.int64) * num_q_heads + head[None, :]
        lse_s = tl.load(lpart_ptr + p_off, mask=ok, other=float("-inf"), cache_modifier=CACHE)
        o_s = tl.load(opart_ptr + p_off[:, :, None] * HEAD_DIM + d[None, None, :],
                      mask=ok[:, :, None], other=0.0, cache_modifier=CACHE)  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(lse_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse_s - m_safe[None, :])
        acc = acc * alpha[:, None] + tl.sum(o_s * w[:, :, None], 0)
        l_i = l_i * alpha + tl.sum(w, 0)
        m_i = m_new
    # split 0 starts at KV token 0, which every query sees, so l_i > 0 for every real lane
    return acc, m_i, tl.where(ok_rows, l_i, 1.0)


@triton.jit
def _store_merged(out_ptr, lse_ptr, token, head, ok_rows, acc, m_i, l_i, stride_ot, stride_oh,
                  num_q_heads, HEAD_DIM: tl.constexpr, RETURN_LSE: tl.constexpr):  # fmt: skip
    """``_merged``'s result into out (and lse, natural log) at token, head: int64 / int [ROWS]."""
    d = tl.arange(0, HEAD_DIM)
    o_off = token * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off[:, None] + d[None, :],
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=ok_rows[:, None])
    if RETURN_LSE:
        tl.store(lse_ptr + token * num_q_heads + head,
                 (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=ok_rows)  # fmt: skip


@triton.jit
def _merge_tile(out_ptr, lse_ptr, opart_ptr, lpart_ptr, part_base, n_splits, n_q, qo_start,
                tok, head, row_ok, stride_ot, stride_oh, num_q_heads, BLOCK_M: tl.constexpr,
                HEAD_DIM: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                RETURN_LSE: tl.constexpr):  # fmt: skip
    """``_merge_kernel``'s math over one query tile's rows (tok, head, row_ok: [BLOCK_M]) of a
    split row: its partials split-major from part_base, n_q rows a split, read from L2."""
    acc, m_i, l_i = _merged(opart_ptr, lpart_ptr, part_base + tok, n_q, head, row_ok, n_splits,
                            num_q_heads, BLOCK_M, HEAD_DIM, SPLIT_BLOCK, ".cg")  # fmt: skip
    _store_merged(out_ptr, lse_ptr, (qo_start + tok).to(tl.int64), head, row_ok, acc, m_i, l_i,
                  stride_ot, stride_oh, num_q_heads, HEAD_DIM, RETURN_LSE)  # fmt: skip


@triton.jit(do_not_specialize=["merge_ptr", "count_ptr", "capacity"])
def _merge_kernel(
    out_ptr, lse_ptr, opart_ptr, lpart_ptr, merge_ptr, count_ptr, capacity, stride_ot, stride_oh,
    num_q_heads, HEAD_DIM: tl.constexpr, HEAD_BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
    RETURN_LSE: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    if USE_GDC:  # kernels/pdl.py: the partials and the merge list are the step's data
        tl.extra.cuda.gdc_wait()
    # One program per (split query token, HEAD_BLOCK heads); SPLIT_BLOCK splits are loaded at
    # once, so a row split 100 ways merges in a few dependent steps rather than 100.
    pt = tl.program_id(0)
    if pt >= tl.load(count_ptr):
        return
    # merge entry (columns of [4, capacity]): output token, splits, first partial row, stride
    tok = tl.load(merge_ptr + pt).to(tl.int64)
    n_splits = tl.load(merge_ptr + capacity + pt)
    p_first = tl.load(merge_ptr + 2 * capacity + pt)
    p_stride = tl.load(merge_ptr + 3 * capacity + pt)
    h = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    h_ok = h < num_q_heads
    acc, m_i, l_i = _merged(opart_ptr, lpart_ptr, p_first + h * 0, p_stride, h, h_ok, n_splits,
                            num_q_heads, HEAD_BLOCK, HEAD_DIM, SPLIT_BLOCK, "")  # fmt: skip
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    _store_merged(out_ptr, lse_ptr, tok + h * 0, h, h_ok, acc, m_i, l_i, stride_ot, stride_oh,
                  num_q_heads, HEAD_DIM, RETURN_LSE)  # fmt: skip


@dataclass
class _Launch:
    """One kernel launch over a work list: int32 columns [rows, capacity] and the item count,
    both on the device (views of the plan's buffer)."""

    work: torch.Tensor
    count: torch.Tensor  # int32 [1]
    capacity: int  # grid size and column stride
    block_m: int = 0  # attention launches: the query tile


@dataclass
class _Plan:
    """Device work lists of one step's metadata (or a FixedPlan's fixed-capacity slots)."""

    launches: list[_Launch]  # attention, one per BLOCK_M; work [6, capacity]
    merge: _Launch | None  # split-KV merge; work [4, capacity]
    part_rows: int  # rows of the partial buffers
    opart: torch.Tensor | None = None  # FixedPlans own their partial buffers
    lpart: torch.Tensor | None = None
    # fused merge (AttentionConfig.fused_merge): int32 [part_rows * hkv], arrivals per (split
    # row, query tile, kv head); zeroed once here, each call leaves it zero again provided
    # every split item of a tile runs (a work list cut at its capacity would leave one short)
    counters: torch.Tensor | None = None


@dataclass
class _HostPlan:
    items: dict[int, np.ndarray]  # BLOCK_M -> int64 [6, W] work items
    merge: np.ndarray  # int64 [4, M]: output token, splits, first partial row, partial stride
    part_rows: int


def _block_n(cfg: AttentionConfig, block_m: int, head_dim: int, elem_size: int) -> int:
    """KV tile length: a K or V tile stays within 32 KiB (16 KiB beside a prefill q tile), which
    keeps the pipelined stages inside shared memory and the accumulators in registers."""
    cap = (32768 if block_m <= 32 else 16384) // (head_dim * elem_size)
    return max(16, min(cfg.block_n, cap))


def side_by_side(launches: list[_Launch], run, device: torch.device, concurrent: bool) -> None:
    """run(launch) for each launch; on a GPU with ``concurrent``, the first on the current
    stream and each other on a side stream forked from it and joined back before returning.

    The launches write disjoint outputs (their own rows' tokens, their own partial rows) and
    read only what the current stream wrote before the fork, so their order does not change a
    bit. Fork and join are stream-event waits: a CUDA graph captures them as parallel
    branches. Tensors are allocated on the current stream and the join precedes any later use
    or free, so the caching allocator needs no ``record_stream``."""
    if not concurrent or len(launches) < 2 or device.type != "cuda":
        for launch in launches:
            run(launch)
        return
    main = torch.cuda.current_stream(device)
    sides = _side_streams(device, len(launches) - 1)
    for side in sides:
        side.wait_stream(main)
    run(launches[0])
    for launch, side in zip(launches[1:], sides, strict=True):
        with torch.cuda.stream(side):
            run(launch)
    for side in sides:
        main.wait_stream(side)


_SIDE_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}


def _side_streams(device: torch.device, n: int) -> list[torch.cuda.Stream]:
    """n side streams of ``device``, created once (the first call comes from an eager warm-up
    run: plans are built before any capture)."""
    streams = _SIDE_STREAMS.setdefault(torch.device(device.type, device.index
                                                    if device.index is not None
                                                    else torch.cuda.current_device()), [])
    while len(streams) < n:
        streams.append(torch.cuda.Stream(device))
    return streams[:n]


def register_cap(config: AttentionConfig, block_m: int) -> dict:
    """The launch option capping an attention program's registers for its query tile (none
    under the interpreter, which compiles nothing)."""
    if block_m >= 64:
        cap = config.wide_max_registers
    elif block_m >= 32 and config.mid_max_registers is not None:
        cap = config.mid_max_registers
    else:
        cap = config.max_registers
    return {} if cap is None or interpreting() else {"maxnreg": cap}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _config_for(config: AttentionConfig, group: int) -> AttentionConfig:
    """A tile holds at least one token's whole GQA group."""
    if config.block_m_max >= group:
        return config
    big = triton.next_power_of_2(group)
    return replace(config, block_m_min=big, block_m_max=big)


def _block_m(n_q: np.ndarray, group: int, cfg: AttentionConfig) -> np.ndarray:
    return np.clip(next_power_of_2(n_q * group), cfg.block_m_min, cfg.block_m_max)


def _fit_chunk(n_pages: np.ndarray, blocks: np.ndarray, splittable: np.ndarray, hkv: int,
               cfg: AttentionConfig, num_sms: int) -> int:  # fmt: skip
    """The wave-fitted chunk (``attention_config.wave_fit_cost``) of rows of n_pages pages and
    blocks query tiles each (int64 [R]); splittable: bool [R], rows that may be split."""
    live = n_pages > 0
    n_max = int(np.where(splittable, n_pages, 0).max(initial=0))  # the longest splittable row
    slots = cfg.resident_programs * num_sms
    spread = math.ceil(cfg.waves * num_sms / hkv)
    k = np.arange(1, FIT_SPLITS + 1)
    chunks = np.maximum(-(-n_max // k), cfg.min_chunk_pages)  # [K]
    splits = np.where(splittable[None], -(-n_pages[None] // chunks[:, None]), 1)  # [K, R]
    items = (np.where(live[None], splits, 0) * blocks[None]).sum(1)
    cost = wave_fit_cost(chunks, items, hkv, slots, cfg.ramp_pages)
    # capacities hold spread items beyond one a query tile of each row (FixedPlan.for_rows)
    cost = np.where(items <= spread + items[0], cost, np.iinfo(np.int64).max)
    return int(chunks[int(np.argmin(cost))])  # argmin: the first, the longest chunk, on a tie


def _host_plan(meta: PagedKVMeta, group: int, hkv: int, cfg: AttentionConfig,
               device: torch.device) -> _HostPlan:  # fmt: skip
    """Work items of every row (numpy, no per-row Python loop): a row of n_q queries is cut
    into ``blocks`` query tiles of BLOCK_M rows, times ``splits`` KV chunks when split. A split
    row owns n_q * splits partial rows (split-major) from its ``part_base``."""
    ps = meta.page_size
    qo = np.asarray(meta.qo_indptr_host, dtype=np.int64)
    n_q = np.diff(qo)
    n_pages = np.diff(np.asarray(meta.kv_indptr_host, dtype=np.int64))
    kv_len = (n_pages - 1) * ps + np.asarray(meta.kv_last_page_len_host, dtype=np.int64)
    block_m = _block_m(n_q, group, cfg)
    tokens = block_m // group  # query tokens per tile
    blocks = -(-n_q // tokens)
    if cfg.skip_queries:  # rows attended elsewhere (``sdpa_rows``): no item, never split
        blocks = np.where(n_q >= cfg.skip_queries, 0, blocks)
    if cfg.kv_chunk_pages is not None:
        chunk = cfg.kv_chunk_pages
    elif cfg.resident_programs is not None:
        chunk = _fit_chunk(n_pages, blocks, n_q <= cfg.split_max_q, hkv, cfg, _num_sms(device))
    else:
        target = cfg.waves * _num_sms(device)
        chunk = max(cfg.min_chunk_pages, math.ceil(int((n_pages * blocks).sum()) * hkv / target))
    splits = np.where((n_q <= cfg.split_max_q) & (blocks > 0), -(-n_pages // chunk), 1)
    per = -(-n_pages // splits)  # pages per chunk, balanced
    if not cfg.balanced_chunks:  # cut at multiples of the chunk
        per = np.where(splits > 1, chunk, per)
    splits = -(-n_pages // per)
    sr = np.nonzero(splits > 1)[0]  # split rows
    part_base = np.zeros_like(n_q)
    part_base[sr] = offsets(n_q[sr] * splits[sr])[:-1]

    # items: for each row, for each query tile b, for each chunk s (b-major)
    per_row = blocks * splits
    row = np.repeat(np.arange(len(n_q)), per_row)
    local = ragged_arange(per_row)
    s = local % splits[row]
    is_split = splits[row] > 1
    lo = np.where(is_split, s * per[row] * ps, 0)
    hi = np.where(is_split, np.minimum((s + 1) * per[row] * ps, kv_len[row]), kv_len[row])
    items = np.stack([row, local // splits[row] * tokens[row], lo, hi,
                      np.where(is_split, s, -1), part_base[row]])  # fmt: skip
    item_bm = block_m[row]
    order = np.argsort(item_bm, kind="stable")  # one launch per BLOCK_M, rows in order
    by_bm = {bm: items[:, order[item_bm[order] == bm]] for bm in np.unique(item_bm).tolist()}
    tok = ragged_arange(n_q[sr])
    merge = np.stack([np.repeat(qo[sr], n_q[sr]) + tok, np.repeat(splits[sr], n_q[sr]),
                      np.repeat(part_base[sr], n_q[sr]) + tok, np.repeat(n_q[sr], n_q[sr])])
    return _HostPlan(by_bm, merge, int((n_q[sr] * splits[sr]).sum()))


def _layout(capacities: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Offsets of [count (padded to 4 ints), columns x capacity] segments; 16-byte aligned."""
    starts, at = [], 0
    for cols, cap in capacities:
        starts.append(at)
        at += 4 + -(-cols * cap // 4) * 4
    return starts, at


def _fill(buf: np.ndarray, start: int, cap: int, work: np.ndarray) -> None:
    buf[start] = work.shape[1]
    body = buf[start + 4 : start + 4 + work.shape[0] * cap].reshape(work.shape[0], cap)
    body[:, : work.shape[1]] = work


def _pack(starts: list[int], segments: list[tuple[int, int]], works: list[np.ndarray],
          total: int) -> np.ndarray:
    """The int32 buffer of ``_layout``'s segments holding ``works`` (and their counts)."""
    buf = np.zeros(max(total, 4), dtype=np.int32)
    for start, (_, cap), work in zip(starts, segments, works, strict=True):
        _fill(buf, start, cap, work)
    return buf


def _views(dev: torch.Tensor, start: int, cols: int, cap: int, block_m: int = 0) -> _Launch:
    return _Launch(dev[start + 4 : start + 4 + cols * cap].view(cols, cap),
                   dev[start : start + 1], cap, block_m)  # fmt: skip


def _build_plan(meta: PagedKVMeta, group: int, hkv: int, cfg: AttentionConfig) -> _Plan:
    """The exact-size plan of one step: one upload (counts and work lists)."""
    device = meta.qo_indptr.device
    host = _host_plan(meta, group, hkv, cfg, device)
    segments = [(6, w.shape[1]) for w in host.items.values()] + [(4, host.merge.shape[1])]
    starts, total = _layout(segments)
    dev = upload(_pack(starts, segments, [*host.items.values(), host.merge], total), device)
    launches = [_views(dev, start, 6, cap, bm)
                for start, (_, cap), bm in zip(starts, segments, host.items, strict=False)]
    merge = _views(dev, starts[-1], 4, segments[-1][1]) if host.merge.shape[1] else None
    # once a step, not per call: every layer's call reuses the plan and leaves them zero
    counters = (torch.zeros(host.part_rows * hkv, dtype=torch.int32, device=device)
                if cfg.fused_merge and merge is not None else None)  # fmt: skip
    return _Plan(launches, merge, host.part_rows, counters=counters)


def _plan(meta: PagedKVMeta, group: int, hkv: int, cfg: AttentionConfig) -> _Plan:
    if meta.fixed_plan is not None:
        return meta.fixed_plan.plan
    # Cached on the metadata object: it is built once per step and never mutated.
    cache = meta.__dict__.setdefault("_triton_attention_plans", {})
    key = (group, hkv, cfg)
    if key not in cache:
        cache[key] = _build_plan(meta, group, hkv, cfg)
    return cache[key]


class FixedPlan:
    """A plan with fixed capacities, for CUDA graphs: its launches have fixed grids over fixed
    buffers, and ``load`` writes each step's work lists and counts into them (one upload), so
    a captured graph replays the attention of any step that fits.

    block_ms: the query tiles of the rows it will hold (rows needing another tile do not fit);
    item_capacity / merge_capacity / part_rows: most work items per tile, split query tokens,
    partial rows. A meta using it carries it as ``PagedKVMeta.fixed_plan``.
    """

    def __init__(self, group: int, hkv: int, num_q_heads: int, head_dim: int, block_ms: list[int],
                 item_capacity: int, merge_capacity: int, part_rows: int, device: torch.device,
                 config: AttentionConfig = DEFAULT_CONFIG,
                 share: FixedPlan | None = None) -> None:  # fmt: skip
        """share: a plan (of the same heads) whose partial buffers are used if large enough:
        plans replayed one after another never use them at once."""
        self.group, self.hkv, self.device = group, hkv, device
        self.wide_tiles = False  # rows of several queries share the widest tile (for_rows)
        self.config = _config_for(config, group)
        self.segments = [(6, item_capacity)] * len(block_ms) + [(4, merge_capacity)]
        self.starts, total = _layout(self.segments)
        self.block_ms = sorted(block_ms)
        self.buffer = torch.zeros(total, dtype=torch.int32, device=device)
        launches = [_views(self.buffer, st, 6, item_capacity, bm)
                    for st, bm in zip(self.starts, self.block_ms, strict=False)]
        merge = _views(self.buffer, self.starts[-1], 4, merge_capacity)
        if share is not None and share.plan.part_rows >= part_rows:
            opart, lpart = share.plan.opart, share.plan.lpart
            counters = share.plan.counters
        else:
            opart = torch.empty(part_rows, num_q_heads, head_dim, dtype=torch.float32,
                                device=device)  # fmt: skip
            lpart = torch.empty(part_rows, num_q_heads, dtype=torch.float32, device=device)
            # whatever config a call passes may fuse the merge (a few KiB, allocated before
            # any capture)
            counters = torch.zeros(part_rows * hkv, dtype=torch.int32, device=device)
        self.plan = _Plan(launches, merge, opart.shape[0], opart, lpart, counters)
        # the work lists of load_rows / load_decode in one launch (plan_kernel.py) where it
        # computes them exactly; else device_plan's tensor ops
        self.fused_planning = fused_planning_fits(self.config, _num_sms(device), self.block_ms)

    @classmethod
    def for_tokens(cls, tokens: int, max_q: int, num_q_heads: int, hkv: int, head_dim: int,
                   device: torch.device, config: AttentionConfig = DEFAULT_CONFIG,
                   share: FixedPlan | None = None) -> FixedPlan:  # fmt: skip
        """Capacities that hold any step of up to ``tokens`` query tokens in rows of at most
        ``max_q`` queries under the automatic split. The split chooses chunks so that the
        items' pages are at most ``spread`` = waves * SMs / hkv chunks: items <= spread + rows,
        partial rows <= max_q * spread + tokens, merged tokens <= tokens."""
        group = num_q_heads // hkv
        cfg = _config_for(config, group)
        spread = math.ceil(cfg.waves * _num_sms(device) / hkv)
        return cls(group, hkv, num_q_heads, head_dim, block_ms_for(max_q, group, cfg),
                   spread + tokens, tokens, tokens + max_q * spread, device, config, share)

    def clear(self) -> None:
        """No work items (the counts zeroed): launches do nothing."""
        self.buffer.zero_()

    def load(self, meta: PagedKVMeta) -> bool:
        """Write the plan of ``meta`` (host copies needed) into the buffers; False if it does
        not fit (then nothing is written)."""
        host = _host_plan(meta, self.group, self.hkv, self.config, self.device)
        if not set(host.items) <= set(self.block_ms) or host.part_rows > self.plan.part_rows:
            return False
        works = [host.items.get(bm, np.zeros((6, 0), np.int64)) for bm in self.block_ms]
        works.append(host.merge)
        if any(w.shape[1] > cap for w, (_, cap) in zip(works, self.segments, strict=True)):
            return False
        upload(_pack(self.starts, self.segments, works, self.buffer.shape[0]), self.device,
               self.buffer)
        return True

    def load_decode(self, kv_indptr: torch.Tensor, last_len: torch.Tensor, page_size: int,
                    q: int = 1) -> None:
        """Write the plan of rows of q queries each (kv_indptr int [R + 1], last_len int [R];
        rows of no page get no work) from the device metadata: no host copy, no sync,
        capturable. The caller sizes the plan (``for_decode``): work past a capacity would be
        dropped."""
        bm = int(_block_m(np.full(1, q, np.int64), self.group, self.config)[0])
        for launch, start in zip(self.plan.launches, self.starts, strict=False):
            if launch.block_m != bm:
                launch.count.zero_()
                continue
            if self.fused_planning:
                plan_into(self.buffer, [start], launch.capacity, self.starts[-1],
                          self.plan.merge.capacity, kv_indptr, last_len, None, page_size,
                          self.group, self.hkv, self.config, _num_sms(self.device), [bm],
                          uniform_q=q)  # fmt: skip
                continue
            items, count, merge, n_merge = decode_attention_items(
                kv_indptr, last_len, page_size, self.group, self.hkv, self.config,
                _num_sms(self.device), launch.capacity, q)
            launch.work.copy_(items)
            launch.count.copy_(count)
            self.plan.merge.work[:, : merge.shape[1]].copy_(merge)
            self.plan.merge.count.copy_(n_merge)

    @classmethod
    def for_decode(cls, rows: int, max_pages: int, num_q_heads: int, hkv: int, head_dim: int,
                   device: torch.device, config: AttentionConfig = DEFAULT_CONFIG,
                   share: FixedPlan | None = None, q: int = 1) -> FixedPlan:  # fmt: skip
        """A plan for ``load_decode``: rows of q queries listing at most ``max_pages`` pages
        in all, cut into ``blocks`` query tiles each. Items: at most spread + rows * blocks
        (automatic chunks), or (max_pages / chunk + rows) * blocks (fixed chunks); each split
        item holds q partial rows at most."""
        group = num_q_heads // hkv
        cfg = _config_for(config, group)
        bm = int(_block_m(np.full(1, q, np.int64), group, cfg)[0])
        blocks = -(-q // (bm // group))
        if cfg.kv_chunk_pages is not None:
            items = (-(-max_pages // cfg.kv_chunk_pages) + rows) * blocks
        else:
            items = math.ceil(cfg.waves * _num_sms(device) / hkv) + rows * blocks
        return cls(group, hkv, num_q_heads, head_dim, [bm], items, rows * q, items * q,
                   device, config, share)


    @classmethod
    def for_rows(cls, rows: int, tokens: int, max_q: int, max_pages: int, num_q_heads: int,
                 hkv: int, head_dim: int, device: torch.device,
                 config: AttentionConfig = DEFAULT_CONFIG, share: FixedPlan | None = None,
                 wide_tiles: bool = False, wide_only: bool = False) -> FixedPlan:  # fmt: skip
        """A plan for ``load_rows``: up to ``rows`` rows of 1..max_q queries each, ``tokens``
        queries and ``max_pages`` listed pages in all (one launch per query tile; the item
        bounds of ``for_decode`` with the most query tiles a row may need). wide_tiles: rows
        of several queries all take max_q's tile (two launches: ``attention_items``).
        wide_only: the one launch of max_q's tile, for steps that hold a row of several
        queries under ``mixed_one_launch`` (every row takes that tile there; a row of one
        query planned in its own tile runs alike in the wide one, a tile of one block)."""
        group = num_q_heads // hkv
        cfg = _config_for(config, group)
        n_q = np.arange(1, max_q + 1)
        tiles = _block_m(n_q, group, cfg)
        if wide_only:
            wide_tiles = True
            tiles = np.full_like(tiles, tiles[-1])
        elif wide_tiles:
            tiles = np.where(n_q > 1, tiles[-1], tiles)
        blocks = int((-(-n_q // (tiles // group))).max())
        if cfg.kv_chunk_pages is not None:
            items = (-(-max_pages // cfg.kv_chunk_pages) + rows) * blocks
        else:
            items = math.ceil(cfg.waves * _num_sms(device) / hkv) + rows * blocks
        plan = cls(group, hkv, num_q_heads, head_dim, sorted(set(tiles.tolist())), items,
                   tokens, items * max_q, device, config, share)
        plan.wide_tiles = wide_tiles
        return plan

    def load_rows(self, kv_indptr: torch.Tensor, last_len: torch.Tensor, n_q: torch.Tensor,
                  page_size: int) -> None:
        """Write the plan of rows of n_q (int64 [R]) queries each, their queries in row order
        (a mixed step: draft rows of one, verify rows of d + 1), from the device metadata, as
        ``load_decode`` does (no host copy, capturable; sized by ``for_rows``)."""
        if self.fused_planning:
            plan_into(self.buffer, self.starts[:-1], self.segments[0][1], self.starts[-1],
                      self.segments[-1][1], kv_indptr, last_len, n_q, page_size, self.group,
                      self.hkv, self.config, _num_sms(self.device), self.block_ms,
                      self.wide_tiles)  # fmt: skip
            return
        *launches, (merge, n_merge) = attention_items(
            kv_indptr, last_len, n_q, page_size, self.group, self.hkv, self.config,
            _num_sms(self.device), self.block_ms, self.segments[0][1], self.segments[-1][1],
            self.wide_tiles)
        for launch, (items, count) in zip(self.plan.launches, launches, strict=True):
            launch.work.copy_(items)
            launch.count.copy_(count)
        self.plan.merge.work.copy_(merge)
        self.plan.merge.count.copy_(n_merge)


def block_ms_for(max_q: int, group: int, config: AttentionConfig = DEFAULT_CONFIG) -> list[int]:
    """The query tiles of rows of 1..max_q queries."""
    cfg = _config_for(config, group)
    return sorted(set(_block_m(np.arange(1, max_q + 1), group, cfg).tolist()))


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedKVMeta,
    scale: float,
    return_lse: bool = False,
    config: AttentionConfig = DEFAULT_CONFIG,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] over kv_cache [P, 2, ps, Hkv, D] -> out [T, Hq, D] (, lse [T, Hq] float32).

    With ``meta.fixed_plan`` (CUDA graphs) q may have more rows than the plan's tokens: rows no
    work item covers are left unwritten."""
    check_q(q, kv_cache)
    check_cache(kv_cache, meta.page_size, q.shape[2], q.dtype)
    check_meta(meta, q.device)
    t, hq, d = q.shape
    hkv = kv_cache.shape[3]
    if meta.fixed_plan is None and t != meta.qo_indptr_host[-1]:
        raise ValueError(f"q has {t} tokens but meta.qo_indptr ends at {meta.qo_indptr_host[-1]}")
    group = hq // hkv
    config = _config_for(config, group)
    out = torch.empty_like(q)
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device) if return_lse else out
    if t == 0:
        return (out, lse) if return_lse else out
    long_rows = sdpa_row_ids(q, meta, config, return_lse)  # prefill chunks: a flash kernel
    if long_rows:
        sdpa_rows(q, kv_cache, meta, scale, long_rows, out)
        if len(long_rows) == meta.num_rows:
            return out
        config = replace(config, skip_queries=config.sdpa_min_queries)
    plan = _plan(meta, group, hkv, config)
    opart, lpart = plan.opart, plan.lpart
    if opart is None and plan.part_rows:
        opart = torch.empty(plan.part_rows, hq, d, dtype=torch.float32, device=q.device)
        lpart = torch.empty(plan.part_rows, hq, dtype=torch.float32, device=q.device)
    elif opart is None:
        opart = lpart = out  # never written
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    gdc = launch_options(q.device)
    fused = config.fused_merge and plan.merge is not None  # else the kernel as without it

    def launch_attention(launch: _Launch) -> None:
        block_m = launch.block_m
        merge_splits = max(1, min(config.merge_split_block, _MERGE_TILE // (block_m * d)))
        _attn_kernel[(launch.capacity * hkv,)](
            q, kv_cache, out, lse, opart, lpart, plan.counters if fused else None, launch.work,
            launch.count, launch.capacity,
            meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            kv_cache.stride(3), out.stride(0), out.stride(1), hq, scale * _LOG2E,
            GROUP=group, HEAD_DIM=d, PAGE_SIZE=meta.page_size, BLOCK_M=block_m,
            BLOCK_N=_block_n(config, block_m, d, q.element_size()), RETURN_LSE=return_lse,
            DOT_PRECISION=precision, UPCAST=interpreting(), FUSED_MERGE=fused,
            MERGE_SPLITS=merge_splits if fused else 1,
            num_warps=config.num_warps, num_stages=config.num_stages,
            **register_cap(config, block_m), **gdc,
        )  # fmt: skip

    side_by_side(plan.launches, launch_attention, q.device, config.concurrent_launches)
    if plan.merge is not None and not fused:
        # few heads per program: with one long row the merge must still spread over the SMs
        head_block = min(triton.next_power_of_2(hq), config.merge_head_block or max(1, 256 // d))
        merge = plan.merge
        _merge_kernel[(merge.capacity, triton.cdiv(hq, head_block))](
            out, lse, opart, lpart, merge.work, merge.count, merge.capacity, out.stride(0),
            out.stride(1), hq, HEAD_DIM=d, HEAD_BLOCK=head_block,
            SPLIT_BLOCK=config.merge_split_block,
            RETURN_LSE=return_lse, num_warps=4, **gdc,
        )  # fmt: skip
    return (out, lse) if return_lse else out

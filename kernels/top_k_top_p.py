"""Triton top-k / top-p filter: the distribution a sampled request draws from, without a sort
(``sampler.probs_from_logits_ref``, a sort of each row, is its reference).

filter_probs: softmax(x / T) restricted to the tokens kept by top-k, then by top-p (thresholds,
    ties kept: ``sampler.probs_from_logits_ref``): the row's max, then
    e = exp(x / T - max) written to ``out`` and re-read by two searches over float32 bit
    patterns (e >= 0, so bit order is value order): the k-th largest e (the largest t with
    #{e >= t} >= k) and the top-p floor (the smallest t with sum{e > t, e kept by top-k} below
    top_p times the top-k mass). A search's first FULL_PASSES passes read whole rows, each
    trying SEARCH_WAYS thresholds at once over chunks on every SM; then the e left inside
    the bracket are compacted (CAP a chunk) and one program a row finishes by bisection over
    them in registers (over the whole row where a chunk had more: a nearly flat row). Rows
    without top-k / top-p skip their reads (the launches: the comment below).
    Shapes: x [N, V] float32 / bf16, last dim contiguous; temperature, top_p float32 [N];
    top_k int64 [N] (0: off); out float32 [N, V].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .race import check_rows

ONE = 0x3F800000  # float32 1.0's bits: e = exp(x - max) <= 1
ONE_BITS = tl.constexpr(ONE)
SEARCH_WAYS = 4  # thresholds a pass tries at once: the bracket shrinks 5x a pass
FULL_PASSES = 2  # full passes before the candidates are compacted: 2^30 / 5^2 patterns left,
# ~5 binades around the threshold. On an H100 (vocab 152k, logits 3 x randn at T = 0.7) 4 x 2
# was the fastest of {4, 8} ways x {2, 3, 4, 6} passes at 64, 384 and 576 rows, 1.4-1.5x the
# former 8 x 4 (docs/benchmarks.md §8.46); a chunk over CAP candidates in the wider bracket
# falls back to the whole row, which real logits may do more often than these
CAP = 64  # candidates a chunk keeps; a row with a chunk over it finishes over the whole row
FILTER_CHUNK = 4096  # e values a filter program reads (SUB at a time in a pass)
FILTER_SUB = 512


# A row is cut into CHUNK-wide chunks, one program each (N x V / CHUNK programs over every SM).
# A search keeps a bracket (lo, hi) of float32 bit patterns per row; each full pass is one
# launch whose programs count (or sum) their chunk's e against WAYS thresholds inside the
# bracket and write them as partials; the next launch's programs each narrow the bracket from
# those partials alone (all of a row's programs compute the same bracket; its chunk 0 stores
# it for the launch after). After FULL_PASSES of them the compaction launch keeps each chunk's
# e inside the bracket and what the e above it add, and the finishing launch bisects over
# those. A fixed sequence of launches, whatever the data, keeps it capturable in a CUDA graph;
# a row whose bracket has closed skips its reads.
COUNT, MASS = tl.constexpr(0), tl.constexpr(1)


@triton.jit
def _mids(lo, hi, WAYS: tl.constexpr):
    """WAYS bit patterns spread evenly inside the bracket (lo, hi), hi - lo >= 2: the largest
    is above lo, so every pass narrows it; none at or below lo (lo may be -1, a NaN)."""
    i = tl.arange(0, WAYS).to(tl.int64) + 1
    mids = (lo.to(tl.int64) + (hi - lo).to(tl.int64) * i // (WAYS + 1)).to(tl.int32)
    return tl.maximum(mids, lo + 1)


@triton.jit
def _bracket(state_ptr, part_ptr, goal, r, n_rows, n_chunks, s, MODE: tl.constexpr,
             WAYS: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
    """Row r's bracket before pass s: the bracket before pass s - 1 (state [passes + 1, N, 2]
    int32) narrowed by that pass's partials (part [passes, N, n_chunks, WAYS]). COUNT keeps
    #{e >= f(lo)} >= goal > #{e >= f(hi)}; MASS keeps mass(f(lo)) >= goal > mass(f(hi))."""
    at = state_ptr + ((s - 1) * n_rows + r) * 2
    lo, hi = tl.load(at), tl.load(at + 1)
    if hi - lo > 1:
        c = tl.arange(0, CHUNKS)
        rows = ((s - 1) * n_rows + r) * n_chunks + c
        got = tl.load(part_ptr + rows[:, None] * WAYS + tl.arange(0, WAYS)[None, :],
                      mask=(c < n_chunks)[:, None], other=0)  # fmt: skip
        got = tl.sum(got, 0)  # [WAYS], in chunk order: the same sum in every program
        mids = _mids(lo, hi, WAYS)
        below = got >= goal  # COUNT: lo may rise there; MASS: mass >= goal, lo may rise
        lo = tl.max(tl.where(below, mids, lo), 0)
        hi = tl.min(tl.where(below, hi, mids), 0)
    return lo, hi


@triton.jit
def _kept_goal(kept_ptr, top_p, r, n_chunks, CHUNKS: tl.constexpr):
    """top_p times row r's mass kept by top-k (kept [N, n_chunks] partials)."""
    c = tl.arange(0, CHUNKS)
    return top_p * tl.sum(tl.load(kept_ptr + r * n_chunks + c, mask=c < n_chunks, other=0.0), 0)


@triton.jit
def _exp_kernel(x_ptr, temp_ptr, part_ptr, out_ptr, kept_ptr, V, stride_x, n_chunks,
                CHUNK: tl.constexpr, CHUNKS: tl.constexpr, KEPT: tl.constexpr):  # fmt: skip
    """e = exp(x / T - max) into out, the row's max from its chunks' (part [N, n_chunks],
    ``_max_kernel``'s); with KEPT, each chunk's sum of e into kept [N, n_chunks]: its mass
    at or above a floor of 0, what ``_kept_kernel`` sums there (one pass over the rows
    fewer where no row cuts by top-k)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    k = tl.arange(0, CHUNKS)
    top = tl.max(tl.load(part_ptr + r * n_chunks + k, mask=k < n_chunks, other=float("-inf")),
                 0)  # fmt: skip
    x = tl.load(x_ptr + r * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    scaled = tl.math.div_rn(x, tl.load(temp_ptr + r))
    e = tl.exp(scaled - top)  # 0 past V, as _kept_kernel reads it
    tl.store(out_ptr + r * V + cols, e, mask=ok)
    if KEPT:
        tl.store(kept_ptr + r * n_chunks + c, tl.sum(tl.where(e >= 0.0, e, 0.0), 0))


@triton.jit
def _max_kernel(x_ptr, temp_ptr, part_ptr, V, stride_x, n_chunks, CHUNK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + r * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    tl.store(part_ptr + r * n_chunks + c, tl.max(tl.math.div_rn(x, tl.load(temp_ptr + r)), 0))


@triton.jit
def _pass_kernel(e_ptr, state_ptr, part_ptr, goal_ptr, kept_ptr, floor_ptr, V, n_rows, n_chunks,
                 s, MODE: tl.constexpr, WAYS: tl.constexpr, CHUNK: tl.constexpr,
                 SUB: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
    """Pass s of a search: this chunk's #{e >= t} (COUNT) or sum{e > t, e >= floor} (MASS)
    for the WAYS thresholds t inside row r's bracket. goal: COUNT's k [N] int64; MASS's top_p
    [N] (times the kept mass, from kept [N, n_chunks]), floor [N] the top-k floor."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    goal = _goal_of(goal_ptr, kept_ptr, r, n_chunks, MODE, CHUNKS)
    if MODE == MASS:
        floor = tl.load(floor_ptr + r)
    if s == 0:
        at = state_ptr + r * 2
        lo, hi = tl.load(at), tl.load(at + 1)
    else:
        lo, hi = _bracket(state_ptr, part_ptr, goal, r, n_rows, n_chunks, s, MODE, WAYS,
                          CHUNKS)  # fmt: skip
        if c == 0:
            at = state_ptr + (s * n_rows + r) * 2
            tl.store(at, lo)
            tl.store(at + 1, hi)
    if hi - lo > 1:
        thr = _mids(lo, hi, WAYS).to(tl.float32, bitcast=True)[None, :]
        acc = tl.zeros((SUB, WAYS), tl.int32 if MODE == COUNT else tl.float32)
        for u in tl.static_range(CHUNK // SUB):
            cols = c * CHUNK + u * SUB + tl.arange(0, SUB)
            e = tl.load(e_ptr + r * V + cols, mask=cols < V, other=0.0)[:, None]
            if MODE == COUNT:  # thr > 0: the masked zeros never count
                acc += (e >= thr).to(tl.int32)
            else:
                e = tl.where(e >= floor, e, 0.0)
                acc += tl.where(e > thr, e, 0.0)
        out = part_ptr + ((s * n_rows + r) * n_chunks + c) * WAYS + tl.arange(0, WAYS)
        tl.store(out, tl.sum(acc, 0))


@triton.jit
def _kept_kernel(e_ptr, floor_ptr, kept_ptr, V, n_chunks, CHUNK: tl.constexpr):
    """This chunk's mass at or above its row's floor [N], into kept [N, n_chunks]."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(e_ptr + r * V + cols, mask=cols < V, other=0.0)
    kept = tl.sum(tl.where(e >= tl.load(floor_ptr + r), e, 0.0), 0)
    tl.store(kept_ptr + r * n_chunks + c, kept)


@triton.jit
def _goal_of(goal_ptr, kept_ptr, r, n_chunks, MODE: tl.constexpr, CHUNKS: tl.constexpr):
    """COUNT: row r's k; MASS: top_p times its top-k mass."""
    if MODE == COUNT:
        return tl.load(goal_ptr + r).to(tl.int32)
    else:
        return _kept_goal(kept_ptr, tl.load(goal_ptr + r), r, n_chunks, CHUNKS)


@triton.jit
def _compact_kernel(e_ptr, state_ptr, part_ptr, goal_ptr, kept_ptr, cand_ptr, count_ptr,
                    above_ptr, V, n_rows, n_chunks, s, MODE: tl.constexpr, WAYS: tl.constexpr,
                    CHUNK: tl.constexpr, CAP: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
    """After pass s - 1 of a search: row r's bracket (lo, hi) (by chunk 0 into state[s]), and
    this chunk's candidates, the e with lo < bits(e) < hi, the first CAP of them into
    cand [N, n_chunks, CAP] in column order, how many there are into count [N, n_chunks], and
    what the e at or above f(hi) add to every threshold inside the bracket into above
    [N, n_chunks] (COUNT: how many; MASS: their sum)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    goal = _goal_of(goal_ptr, kept_ptr, r, n_chunks, MODE, CHUNKS)
    lo, hi = _bracket(state_ptr, part_ptr, goal, r, n_rows, n_chunks, s, MODE, WAYS, CHUNKS)
    if c == 0:
        at = state_ptr + (s * n_rows + r) * 2
        tl.store(at, lo)
        tl.store(at + 1, hi)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(e_ptr + r * V + cols, mask=cols < V, other=0.0)
    bits = e.to(tl.int32, bitcast=True)
    inside = (bits > lo) & (bits < hi) & (cols < V)  # (a MASS bracket's lo may be -1)
    slot = tl.cumsum(inside.to(tl.int32), 0) - 1
    at = (r * n_chunks + c) * CAP
    tl.store(cand_ptr + at + slot, e, mask=inside & (slot < CAP))
    tl.store(count_ptr + r * n_chunks + c, tl.sum(inside.to(tl.int32), 0))
    top = (bits >= hi) & (cols < V)
    if MODE == COUNT:
        tl.store(above_ptr + r * n_chunks + c, tl.sum(top.to(tl.float32), 0))
    else:
        tl.store(above_ptr + r * n_chunks + c, tl.sum(tl.where(top, e, 0.0), 0))


@triton.jit
def _finish_kernel(e_ptr, state_ptr, goal_ptr, kept_ptr, cand_ptr, count_ptr, above_ptr,
                   floor_in_ptr, floor_ptr, V, n_rows, n_chunks, s, MODE: tl.constexpr,
                   CAP: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Row r's search from its bracket in state[s] to the end, by bisection: over its
    candidates held in registers (cand, with above's constant part), or over the whole row
    where a chunk had more than CAP of them. Its floor (COUNT: f(lo), the k-th largest e;
    MASS: f(hi), never below floor_in) into floor [N]."""
    r = tl.program_id(0).to(tl.int64)
    goal = _goal_of(goal_ptr, kept_ptr, r, n_chunks, MODE, CHUNKS)
    at = state_ptr + (s * n_rows + r) * 2
    lo, hi = tl.load(at), tl.load(at + 1)
    c = tl.arange(0, CHUNKS)
    counts = tl.load(count_ptr + r * n_chunks + c, mask=c < n_chunks, other=0)
    base = tl.sum(tl.load(above_ptr + r * n_chunks + c, mask=c < n_chunks, other=0.0), 0)
    if MODE == MASS:
        floor_in = tl.load(floor_in_ptr + r)
    else:
        floor_in = 0.0
    if tl.max(counts, 0) <= CAP:  # every candidate held: [CHUNKS, CAP] in registers
        slots = tl.arange(0, CAP)
        cand = tl.load(cand_ptr + (r * n_chunks + c[:, None]) * CAP + slots[None, :],
                       mask=slots[None, :] < counts[:, None], other=0.0)  # fmt: skip
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            thr = mid.to(tl.float32, bitcast=True)
            if MODE == COUNT:  # thr > 0: the empty slots never count
                got = base + tl.sum(tl.sum((cand >= thr).to(tl.float32), 1), 0)
            else:
                got = base + tl.sum(tl.sum(tl.where(cand > thr, cand, 0.0), 1), 0)
            if got >= goal:
                lo = mid
            else:
                hi = mid
    else:  # too many in some chunk (a nearly flat row): the whole row, a pass a step
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            thr = mid.to(tl.float32, bitcast=True)
            acc = tl.zeros((BLOCK,), tl.float32)
            for s0 in range(0, V, BLOCK):
                cols = s0 + tl.arange(0, BLOCK)
                e = tl.load(e_ptr + r * V + cols, mask=cols < V, other=0.0)
                if MODE == COUNT:
                    acc += (e >= thr).to(tl.float32)
                else:
                    acc += tl.where((e > thr) & (e >= floor_in), e, 0.0)
            if tl.sum(acc, 0) >= goal:
                lo = mid
            else:
                hi = mid
    if MODE == COUNT:
        floor = lo.to(tl.float32, bitcast=True)
    else:
        floor = tl.maximum(hi.to(tl.float32, bitcast=True), floor_in)
    tl.store(floor_ptr + r, floor)


@triton.jit
def _write_kernel(e_ptr, kept_ptr, floor_ptr, V, n_chunks, CHUNK: tl.constexpr,
                  CHUNKS: tl.constexpr):  # fmt: skip
    """e / (the kept mass) where e >= the row's floor, else 0, in place."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    z = tl.sum(tl.load(kept_ptr + r * n_chunks + c, mask=c < n_chunks, other=0.0), 0)
    floor = tl.load(floor_ptr + r)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    e = tl.load(e_ptr + r * V + cols, mask=ok, other=0.0)
    tl.store(e_ptr + r * V + cols, tl.where(e >= floor, tl.math.div_rn(e, z), 0.0), mask=ok)



def filter_probs(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, need_k: bool, need_p: bool, ways: int = SEARCH_WAYS,
                 full_passes: int = FULL_PASSES) -> torch.Tensor:  # fmt: skip
    """x [N, V] logits -> float32 [N, V]: softmax(x / T) over the tokens kept by top-k, then
    top-p (ties kept); need_k / need_p: whether any row has top_k > 0 / top_p < 1 (without,
    that search's launches are left out; a row without either skips its reads). ways, full
    passes: a search's shape (scripts/bench_sampling.py sweeps them)."""
    check_rows("x", x)
    n, v = x.shape
    expected = (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                ("top_p", top_p, torch.float32))  # fmt: skip
    for name, t, dt in expected:
        if t.shape != (n,) or t.dtype != dt:
            raise ValueError(f"{name} must be {dt} [{n}], got {t.dtype} {tuple(t.shape)}")
    if full_passes < 1 or ways < 1 or ways & (ways - 1):
        raise ValueError(f"need full_passes >= 1 and ways a power of 2, got {full_passes}, "
                         f"{ways}")  # fmt: skip
    dev = x.device
    out = torch.empty(n, v, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    chunks = triton.cdiv(v, FILTER_CHUNK)
    grid, ch = (n, chunks), triton.next_power_of_2(chunks)
    maxes = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    _max_kernel[grid](x, temperature, maxes, v, x.stride(0), chunks, CHUNK=FILTER_CHUNK,
                      num_warps=8)  # fmt: skip
    # without top-k the floor is 0 and the exp launch sums the chunks' mass (_kept_kernel's)
    kept_k = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    _exp_kernel[grid](x, temperature, maxes, out, kept_k, v, x.stride(0), chunks,
                      CHUNK=FILTER_CHUNK, CHUNKS=ch, KEPT=not need_k, num_warps=8)  # fmt: skip

    def search(mode, goal, kept_in, floor_in, lo, hi) -> torch.Tensor:
        """The floor [N] of one search from the brackets (lo, hi) [N]: full_passes launches
        over every chunk, the candidates compacted, then one program a row to the end."""
        state = torch.empty(full_passes + 1, n, 2, dtype=torch.int32, device=dev)
        state[0, :, 0], state[0, :, 1] = lo, hi
        part = torch.empty(full_passes, n, chunks, ways, device=dev,
                           dtype=torch.int32 if mode == COUNT else torch.float32)  # fmt: skip
        for s in range(full_passes):
            _pass_kernel[grid](out, state, part, goal, kept_in, floor_in, v, n, chunks, s,
                               MODE=mode, WAYS=ways, CHUNK=FILTER_CHUNK, SUB=FILTER_SUB,
                               CHUNKS=ch, num_warps=8)  # fmt: skip
        cand = torch.empty(n, chunks, CAP, dtype=torch.float32, device=dev)
        count = torch.empty(n, chunks, dtype=torch.int32, device=dev)
        above = torch.empty(n, chunks, dtype=torch.float32, device=dev)
        _compact_kernel[grid](out, state, part, goal, kept_in, cand, count, above, v, n,
                              chunks, full_passes, MODE=mode, WAYS=ways, CHUNK=FILTER_CHUNK,
                              CAP=CAP, CHUNKS=ch, num_warps=8)  # fmt: skip
        floor = torch.empty(n, dtype=torch.float32, device=dev)
        _finish_kernel[(n,)](out, state, goal, kept_in, cand, count, above, floor_in, floor, v,
                             n, chunks, full_passes, MODE=mode, CAP=CAP, CHUNKS=ch,
                             BLOCK=1024, num_warps=8)  # fmt: skip
        return floor

    zero = torch.zeros(n, dtype=torch.float32, device=dev)
    floor = zero
    if need_k:  # bracket [0, 1.0 + 1 ulp) where the row cuts, else closed at 0
        cut = (top_k > 0) & (top_k < v)
        floor = search(COUNT, top_k, kept_k, zero, 0, torch.where(cut, ONE + 1, 1))
        _kept_kernel[grid](out, floor, kept_k, v, chunks, CHUNK=FILTER_CHUNK, num_warps=8)
    kept = kept_k
    if need_p:  # bracket (top-k's floor - 1 ulp, 1.0] where top_p < 1, else closed at it
        bits = floor.view(torch.int32)
        floor = search(MASS, top_p, kept_k, floor, bits - 1, torch.where(top_p < 1.0, ONE, bits))
        kept = torch.empty_like(kept_k)
        _kept_kernel[grid](out, floor, kept, v, chunks, CHUNK=FILTER_CHUNK, num_warps=8)
    _write_kernel[grid](out, kept, floor, v, chunks, CHUNK=FILTER_CHUNK, CHUNKS=ch,
                        num_warps=8)  # fmt: skip
    return out

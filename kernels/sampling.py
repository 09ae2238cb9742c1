"""Triton sampling kernels: the exponential race and the top-k / top-p filter, one row of the
vocabulary at a time, without the [rows, vocab] int64 and float64 temporaries of the torch
references in ``aspire_ray/worker/sampler.py`` (whose meaning they keep).

race_rows: token = argmax_v w_v / E_v, E_v = -log(u_v), u_v the counter-based uniform of
    ``sampler.uniform`` (the same 32-bit hash, in uint32 where the reference masks int64;
    float64 for u, E and the ratio as there), so a row's draw is the reference's draw. With
    ``minus`` the weights are the residual max(w - minus, 0) of a rejected draft (rows where
    ``use_minus`` is set), falling back to w where the residual is all zero
    (``verify_sampled_batch``'s meaning).
    Shapes: w, minus [N, V] float32 / float64, last dim contiguous; seeds, positions int64
    [N] and the stream (an int or int64 [N]), hashed to a row key in the kernel as
    ``sampler.row_keys`` hashes them; use_minus bool [N]; out int64 [N].
    Stage 1 cuts every row into BLOCK-wide chunks (N x V / BLOCK programs over every SM), each
    writing its chunk's largest ratio and the first index of it; stage 2 keeps, per row, the
    largest (the first chunk on a tie): the first index of the row's largest ratio, as
    ``torch.argmax``.

filter_probs: softmax(x / T) restricted to the tokens kept by top-k, then by top-p (thresholds,
    ties kept: ``sampler.probs_from_logits_ref``): the row's max, then
    e = exp(x / T - max) written to ``out`` and re-read by two searches over float32 bit
    patterns (e >= 0, so bit order is value order): the k-th largest e (the largest t with
    #{e >= t} >= k) and the top-p floor (the smallest t with sum{e > t, e kept by top-k} below
    top_p times the top-k mass). A search's first FULL_PASSES passes read whole rows, each
    trying SEARCH_WAYS thresholds at once over chunks on every SM; then the e left inside
    the bracket are compacted (CAP a chunk) and one program a row finishes by bisection over
    them in registers (over the whole row where a chunk had more: a nearly flat row). Rows
    without top-k / top-p skip their reads (see "the filter" below).
    Shapes: x [N, V] float32 / bf16, last dim contiguous; temperature, top_p float32 [N];
    top_k int64 [N] (0: off); out float32 [N, V].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RACE_BLOCK = 2048  # ratios a stage-1 program compares: 75 chunks a row of Qwen2.5's 151,936
ONE = 0x3F800000  # float32 1.0's bits: e = exp(x - max) <= 1
ONE_BITS = tl.constexpr(ONE)


@triton.jit
def _mix32(x):
    """``sampler._mix32`` on uint32 values (its int64 products taken mod 2^32 are the uint32
    products, which wrap natively)."""
    x = x ^ (x >> 16)
    x = x * 0x45D9F3B
    x = x ^ (x >> 16)
    x = x * 0x45D9F3B
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed_ptr, pos_ptr, stream_ptr, stream, t, STREAM_PER_ROW: tl.constexpr):
    """``sampler.row_keys`` of row t: seed and position int64 [N] (seed >= 0), the stream one
    for all rows or int64 [N]."""
    seed = tl.load(seed_ptr + t)
    if STREAM_PER_ROW:
        stream = tl.load(stream_ptr + t)
    k = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x2545F491)
    k = _mix32(k ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    k = _mix32(k ^ (tl.load(pos_ptr + t) & 0xFFFFFFFF).to(tl.uint32))
    return _mix32(k ^ ((stream.to(tl.int64) * 0x9E3779B1) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit(do_not_specialize=["stream"])  # Stream.DRAFT is 1: a runtime int, not constexpr 1
def _race_chunk_kernel(w_ptr, m_ptr, use_ptr, seed_ptr, pos_ptr, stream_ptr, stream, val_ptr,
                       idx_ptr, V, stride_w, stride_m, n_chunks, STREAM_PER_ROW: tl.constexpr,
                       HAS_MINUS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    w = tl.load(w_ptr + t * stride_w + cols, mask=ok, other=0.0)
    # the noise of sampler.uniform for (row key, column)
    key = _row_key(seed_ptr, pos_ptr, stream_ptr, stream, t, STREAM_PER_ROW)
    a = _mix32(key ^ _mix32(cols.to(tl.uint32) * 2 + 1))
    b = _mix32(a ^ 0x68E31DA4)
    bits = (a >> 5).to(tl.int64) * 67108864 + (b >> 6).to(tl.int64)  # 53 random bits
    u = (bits.to(tl.float64) + 0.5) / 9007199254740992.0
    expo = -tl.log(u)
    ratio = tl.where(ok, w.to(tl.float64) / expo, -1.0)
    best = tl.max(ratio, 0)
    at = t * (2 if HAS_MINUS else 1) * n_chunks + c  # [N, lanes, n_chunks]: lane 0 races w
    tl.store(val_ptr + at, best)
    tl.store(idx_ptr + at, tl.min(tl.where(ratio == best, cols, 2147483647), 0))
    if HAS_MINUS:  # the residual's race, beside w's (the fallback), on the same noise
        m = tl.load(m_ptr + t * stride_m + cols, mask=ok, other=0.0)
        # in the inputs' dtype, as the reference subtracts; rows without use_minus race w
        res = tl.where(tl.load(use_ptr + t) != 0, tl.maximum(w - m, 0.0), w)
        ratio = tl.where(ok, res.to(tl.float64) / expo, -1.0)
        best = tl.max(ratio, 0)
        at += n_chunks  # lane 1: the residual's
        tl.store(val_ptr + at, best)
        tl.store(idx_ptr + at, tl.min(tl.where(ratio == best, cols, 2147483647), 0))


@triton.jit
def _race_row_kernel(val_ptr, idx_ptr, out_ptr, n_chunks, HAS_MINUS: tl.constexpr,
                     CHUNKS: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    ok = c < n_chunks
    base = t * (2 if HAS_MINUS else 1) * n_chunks
    val = tl.load(val_ptr + base + c, mask=ok, other=-2.0)
    idx = tl.load(idx_ptr + base + c, mask=ok, other=2147483647)
    best = tl.max(val, 0)
    # chunks are in column order: the smallest index among the largest is the row's first
    token = tl.min(tl.where((val == best) & ok, idx, 2147483647), 0)
    if HAS_MINUS:
        rval = tl.load(val_ptr + base + n_chunks + c, mask=ok, other=-2.0)
        ridx = tl.load(idx_ptr + base + n_chunks + c, mask=ok, other=2147483647)
        rbest = tl.max(rval, 0)
        rtoken = tl.min(tl.where((rval == rbest) & ok, ridx, 2147483647), 0)
        token = tl.where(rbest > 0.0, rtoken, token)  # an all-zero residual: w's draw
    tl.store(out_ptr + t, token.to(tl.int64))


def _check_rows(name: str, x: torch.Tensor, rows: int | None = None) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or (rows is not None and x.shape[0] != rows):
        raise ValueError(f"{name} must be [N, V] with a contiguous last dim, got "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    if not 0 < x.shape[1] < 2**31:
        raise ValueError(f"need 0 < V < 2**31 columns, got {x.shape[1]}")


def race_rows(w: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
              stream: int | torch.Tensor, minus: torch.Tensor | None = None,
              use_minus: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """w [N, V] (float32 / float64, rows of non-negative weights) -> int64 [N]: each row's
    exponential-race draw on the noise of (seeds, positions int64 [N], stream: one for all
    rows or int64 [N]), ``sampler.uniform``'s; with minus [N, V] and use_minus bool [N], rows
    where use_minus holds race the residual max(w - minus, 0) (w where it is all zero)."""
    _check_rows("w", w)
    n, v = w.shape
    per_row = isinstance(stream, torch.Tensor)
    for name, t in (("seeds", seeds), ("positions", positions)) + (("stream", stream),) * per_row:
        if t.shape != (n,) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [{n}], got {t.dtype} {tuple(t.shape)}")
    has_minus = minus is not None
    if has_minus:
        _check_rows("minus", minus, n)
        if minus.shape != w.shape or minus.dtype != w.dtype:
            raise ValueError(f"minus must match w ({w.dtype} {tuple(w.shape)}), got "
                             f"{minus.dtype} {tuple(minus.shape)}")  # fmt: skip
        if use_minus is None or use_minus.shape != (n,):
            raise ValueError(f"use_minus must be bool [{n}] with minus")
    out = torch.empty(n, dtype=torch.int64, device=w.device)
    if n == 0:
        return out
    n_chunks = triton.cdiv(v, RACE_BLOCK)
    lanes = 2 if has_minus else 1
    val = torch.empty(n, lanes, n_chunks, dtype=torch.float64, device=w.device)
    idx = torch.empty(n, lanes, n_chunks, dtype=torch.int32, device=w.device)
    m, use = (minus, use_minus.to(torch.int8)) if has_minus else (w, seeds)  # unread without
    streams, stream_value = (stream, 0) if per_row else (seeds, int(stream))
    _race_chunk_kernel[(n, n_chunks)](w, m, use, seeds, positions, streams, stream_value, val,
                                      idx, v, w.stride(0), m.stride(0), n_chunks,
                                      STREAM_PER_ROW=per_row, HAS_MINUS=has_minus,
                                      BLOCK=RACE_BLOCK, num_warps=8)  # fmt: skip
    _race_row_kernel[(n,)](val, idx, out, n_chunks, HAS_MINUS=has_minus,
                           CHUNKS=triton.next_power_of_2(n_chunks), num_warps=1)  # fmt: skip
    return out


# ---- the filter ----------------------------------------------------------------------------
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
def _exp_kernel(x_ptr, temp_ptr, top_ptr, out_ptr, V, stride_x, CHUNK: tl.constexpr):
    """e = exp(x / T - max) into out (top: each row's max of x / T)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    x = tl.load(x_ptr + r * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    scaled = tl.math.div_rn(x, tl.load(temp_ptr + r))
    tl.store(out_ptr + r * V + cols, tl.exp(scaled - tl.load(top_ptr + r)), mask=ok)


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
    if MODE == COUNT:
        goal = tl.load(goal_ptr + r).to(tl.int32)
        floor = 0.0
    else:
        goal = _kept_goal(kept_ptr, tl.load(goal_ptr + r), r, n_chunks, CHUNKS)
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


SEARCH_WAYS = 8  # thresholds a pass tries at once: the bracket shrinks 9x a pass
# (on an H100: 4 and 8 fastest, 8 at a draft step's 64 rows; docs/benchmarks.md §8.44)
FULL_PASSES = 4  # full passes before the candidates are compacted: 2^30 / 9^4 patterns left,
# ~2% of a binade around the threshold
CAP = 64  # candidates a chunk keeps; a row with a chunk over it finishes over the whole row
FILTER_CHUNK = 4096  # e values a filter program reads (SUB at a time in a pass)
FILTER_SUB = 512


def filter_probs(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, need_k: bool, need_p: bool, ways: int = SEARCH_WAYS,
                 full_passes: int = FULL_PASSES) -> torch.Tensor:  # fmt: skip
    """x [N, V] logits -> float32 [N, V]: softmax(x / T) over the tokens kept by top-k, then
    top-p (ties kept); need_k / need_p: whether any row has top_k > 0 / top_p < 1 (without,
    that search's launches are left out; a row without either skips its reads). ways, full
    passes: a search's shape (scripts/bench_sampling.py sweeps them)."""
    _check_rows("x", x)
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
    _exp_kernel[grid](x, temperature, maxes.amax(dim=1), out, v, x.stride(0),
                      CHUNK=FILTER_CHUNK, num_warps=8)  # fmt: skip

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
    kept_k = torch.empty(n, chunks, dtype=torch.float32, device=dev)
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

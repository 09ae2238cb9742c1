"""Triton exponential race: a token drawn from each row of weights on the counter-based noise of
``aspire_ray/worker/sampler.py`` (whose torch code is its reference), without the [rows, vocab]
int64 and float64 temporaries of that code.

race_rows: token = argmax_v w_v / E_v, E_v = -log(u_v), u_v the counter-based uniform of
    ``sampler.uniform`` (the same 32-bit hash, in uint32 where the reference masks int64;
    float64 for u, E and the ratio as there), so a row's draw is the reference's draw. With
    ``minus`` the weights are the residual max(w - minus, 0) of a rejected draft (rows where
    ``use_minus`` is set), falling back to w where the residual is all zero
    (``verify_sampled_batch``'s meaning).
    Shapes: w, minus [N, V] float32 / float64, last dim contiguous; seeds, positions int64
    [N] and the stream (an int or int64 [N]), hashed to a row key in the kernel as
    ``sampler.row_keys`` hashes them; use_minus bool [N]; out int64 [N].
    ``race_gathered`` races rows gathered in the kernel (a step's rows where its logits lie, a
    rejected draft excluded, the draft's q kept in its store as it is read).
    Stage 1 cuts every row into BLOCK-wide chunks (N x V / BLOCK programs over every SM), each
    writing its chunk's largest ratio and the first index of it (the residual's too, only in
    rows with use_minus: the race is arithmetic-bound, float64); stage 2 keeps, per row, the
    largest (the first chunk on a tie): the first index of the row's largest ratio, as
    ``torch.argmax``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RACE_BLOCK = 2048  # ratios a stage-1 program compares: 75 chunks a row of Qwen2.5's 151,936
# The sampler's random streams, aspire_ray.plan.Stream's numbers (kernels/ imports no package
# module; tests/kernels/test_choice_rows.py checks they agree): one home for every kernel
STREAM_TARGET, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3


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
def key_of(seed, pos, stream):
    """``sampler.row_keys`` of int64 values (seed >= 0): uint32."""
    k = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x2545F491)
    k = _mix32(k ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    k = _mix32(k ^ (pos & 0xFFFFFFFF).to(tl.uint32))
    return _mix32(k ^ ((stream.to(tl.int64) * 0x9E3779B1) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def uniform_of(key, cols):
    """``sampler.uniform``'s float64 for (row key uint32, vocab ids int32)."""
    a = _mix32(key ^ _mix32(cols.to(tl.uint32) * 2 + 1))
    b = _mix32(a ^ 0x68E31DA4)
    bits = (a >> 5).to(tl.int64) * 67108864 + (b >> 6).to(tl.int64)  # 53 random bits
    return (bits.to(tl.float64) + 0.5) / 9007199254740992.0


# A chunk's float64 ratios are settled from float32 ones (``_chunk_best``): every ratio
# within a relative 1e-3 of its float64 value (the bound in ``_expo32``; 0.99 leaves margin),
# so the float64 maximum is among those at least CANDIDATE of the float32 maximum; and where
# that maximum is under TINY (weights so small that float32 quotients may be subnormal) the
# chunk takes the float64 race whole.
CANDIDATE = tl.constexpr(0.99)
TINY = tl.constexpr(1e-30)


@triton.jit
def _expo32(key, cols):
    """``-log(uniform_of(key, cols))`` in float32, within a relative 5e-4 of the float64
    value: u = (hi * 2^26 + lo + 0.5) / 2^53 rounds to float32 with a relative 1.2e-7, so
    -log(u) is off by 1.2e-7 at most, relative 5e-4 where it is >= 2^-12; below that (u near
    1, where u itself would round to 1) the series of -log(1 - m) in m = 1 - u, taken from
    the integers."""
    a = _mix32(key ^ _mix32(cols.to(tl.uint32) * 2 + 1))
    b = _mix32(a ^ 0x68E31DA4)
    hi = (a >> 5).to(tl.int32)  # 27 bits
    lo = (b >> 6).to(tl.int32)  # 26 bits
    u = hi.to(tl.float32) * 7.450580596923828e-09 + \
        (lo.to(tl.float32) + 0.5) * 1.1102230246251565e-16  # fmt: skip
    m = (134217727 - hi).to(tl.float32) * 7.450580596923828e-09 + \
        ((67108864 - lo).to(tl.float32) - 0.5) * 1.1102230246251565e-16  # fmt: skip
    series = m * (1.0 + m * (0.5 + m * 0.3333333432674408))
    return tl.where(m < 0.000244140625, series, -tl.log(u))


@triton.jit
def _race64(wv, key, cols, ok):
    """A chunk's largest float64 ratio wv / -log(u) and the first column holding it."""
    ratio = tl.where(ok, wv.to(tl.float64) / -tl.log(uniform_of(key, cols)), -1.0)
    best = tl.max(ratio, 0)
    return best, tl.min(tl.where(ratio == best, cols, 2147483647), 0)


@triton.jit
def _chunk_best(wv, w_row, m_row, key, cols, ok, e32, FAST: tl.constexpr,
                RESIDUAL: tl.constexpr):  # fmt: skip
    """``_race64`` of the chunk's weights wv (w, or the residual max(w - m, 0) with
    RESIDUAL; w_row, m_row: the row's pointers), the same bits (a column that wv holds as 0
    is never a candidate, whatever w_row holds there). FAST (float32 weights): the
    float32 ratios over e32 (``_expo32`` of the chunk, shared by both lanes) find the
    candidates and only they are settled in float64, in column order; a chunk of zero
    weights is (0, its first column) as in float64."""
    if FAST:
        wmax = tl.max(tl.where(ok, wv, 0.0), 0)
        r32 = tl.where(ok, wv / e32, -1.0)
        top = tl.max(r32, 0)
        best = top.to(tl.float64) * 0.0
        at = tl.min(cols, 0)  # a chunk of zero weights: every ratio 0, its first column
        if wmax > 0.0:
            if top >= TINY:
                cand = ok & (r32 >= top * CANDIDATE)
                best = best - 1.0
                at = at * 0 + 2147483647
                for _ in range(tl.sum(cand.to(tl.int32), 0)):
                    col = tl.min(tl.where(cand, cols, 2147483647), 0)
                    cand = cand & (cols != col)
                    wc = tl.load(w_row + col)
                    if RESIDUAL:
                        wc = tl.maximum(wc - tl.load(m_row + col), 0.0)
                    rc = wc.to(tl.float64) / -tl.log(uniform_of(key, col))
                    better = rc > best  # columns in order: the first of equal ratios stays
                    best = tl.where(better, rc, best)
                    at = tl.where(better, col, at)
            else:
                best, at = _race64(wv, key, cols, ok)
    else:
        best, at = _race64(wv, key, cols, ok)
    return best, at


@triton.jit
def _row_key(seed_ptr, pos_ptr, stream_ptr, stream, t, STREAM_PER_ROW: tl.constexpr):
    """``sampler.row_keys`` of row t: seed and position int64 [N] (seed >= 0), the stream one
    for all rows or int64 [N]."""
    if STREAM_PER_ROW:
        stream = tl.load(stream_ptr + t)
    return key_of(tl.load(seed_ptr + t), tl.load(pos_ptr + t), stream)


@triton.jit(do_not_specialize=["stream"])  # Stream.DRAFT is 1: a runtime int, not constexpr 1
def _race_chunk_kernel(w_ptr, m_ptr, use_ptr, seed_ptr, pos_ptr, stream_ptr, stream, val_ptr,
                       idx_ptr, rows_ptr, planes_ptr, keep_ptr, ex_ptr, V, stride_w, stride_m,
                       stride_plane, n_chunks, STREAM_PER_ROW: tl.constexpr,
                       HAS_MINUS: tl.constexpr, FAST: tl.constexpr, GATHER: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    if GATHER:  # ``race_gathered``: w's row rows[t], minus and the kept row planes of m
        w_row = w_ptr + tl.load(rows_ptr + t) * stride_w
        m_row = m_ptr + tl.load(planes_ptr + t) * stride_plane + t * stride_m
    else:
        w_row, m_row = w_ptr + t * stride_w, m_ptr + t * stride_m
    w = tl.load(w_row + cols, mask=ok, other=0.0)
    if GATHER:
        w = tl.where(cols == tl.load(ex_ptr + t), 0.0, w)
        keep = tl.load(keep_ptr + t)
        if keep >= 0:  # before the residual's reads: never the plane they read (the caller)
            tl.store(m_ptr + keep * stride_plane + t * stride_m + cols, w, mask=ok)
    # the noise of sampler.uniform for (row key, column)
    key = _row_key(seed_ptr, pos_ptr, stream_ptr, stream, t, STREAM_PER_ROW)
    e32 = w.to(tl.float32)  # unread without FAST
    if FAST:  # the float32 noise both lanes read
        e32 = _expo32(key, cols)
    best, col = _chunk_best(w, w_row, m_row, key, cols, ok, e32, FAST, False)
    at = t * (2 if HAS_MINUS else 1) * n_chunks + c  # [N, lanes, n_chunks]: lane 0 races w
    tl.store(val_ptr + at, best)
    tl.store(idx_ptr + at, col)
    if HAS_MINUS:  # the residual's race, beside w's (the fallback), on the same noise
        at += n_chunks  # lane 1: the residual's
        if tl.load(use_ptr + t) != 0:  # one row a program: the branch is the program's
            m = tl.load(m_row + cols, mask=ok, other=0.0)
            # in the inputs' dtype, as the reference subtracts
            best, col = _chunk_best(tl.maximum(w - m, 0.0), w_row, m_row, key, cols, ok, e32,
                                    FAST, True)  # fmt: skip
            tl.store(val_ptr + at, best)
            tl.store(idx_ptr + at, col)
        else:  # a row without use_minus races w alone: its lane 1 loses to lane 0
            tl.store(val_ptr + at, -1.0)
            tl.store(idx_ptr + at, 0)


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


def check_rows(name: str, x: torch.Tensor, rows: int | None = None) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or (rows is not None and x.shape[0] != rows):
        raise ValueError(f"{name} must be [N, V] with a contiguous last dim, got "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    if not 0 < x.shape[1] < 2**31:
        raise ValueError(f"need 0 < V < 2**31 columns, got {x.shape[1]}")


def _check_keys(n: int, seeds: torch.Tensor, positions: torch.Tensor,
                stream: int | torch.Tensor) -> None:  # fmt: skip
    per_row = isinstance(stream, torch.Tensor)
    for name, t in (("seeds", seeds), ("positions", positions)) + (("stream", stream),) * per_row:
        if t.shape != (n,) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [{n}], got {t.dtype} {tuple(t.shape)}")


def race_rows(w: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
              stream: int | torch.Tensor, minus: torch.Tensor | None = None,
              use_minus: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """w [N, V] (float32 / float64, rows of non-negative weights) -> int64 [N]: each row's
    exponential-race draw on the noise of (seeds, positions int64 [N], stream: one for all
    rows or int64 [N]), ``sampler.uniform``'s; with minus [N, V] and use_minus bool [N], rows
    where use_minus holds race the residual max(w - minus, 0) (w where it is all zero)."""
    check_rows("w", w)
    n = w.shape[0]
    _check_keys(n, seeds, positions, stream)
    has_minus = minus is not None
    if has_minus:
        check_rows("minus", minus, n)
        if minus.shape != w.shape or minus.dtype != w.dtype:
            raise ValueError(f"minus must match w ({w.dtype} {tuple(w.shape)}), got "
                             f"{minus.dtype} {tuple(minus.shape)}")  # fmt: skip
        if use_minus is None or use_minus.shape != (n,):
            raise ValueError(f"use_minus must be bool [{n}] with minus")
    m, use = (minus, use_minus) if has_minus else (w, seeds)  # use unread without minus
    return _race(w, m, use, n, seeds, positions, stream, has_minus, None, (m.stride(0), 0))


def race_gathered(w: torch.Tensor, rows: torch.Tensor, store: torch.Tensor,
                  planes: torch.Tensor, keep_planes: torch.Tensor, exclude: torch.Tensor,
                  use_minus: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  stream: int | torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``race_rows`` over rows gathered in the kernel (``sampled_rows.draw_rows_ref``, its
    reference): draw i races w[rows[i]] with its column exclude[i] taken as 0 (-1: none),
    or, where use_minus[i], the residual of that less store[planes[i], i]; and where
    keep_planes[i] >= 0 the weights it raced are written to store[keep_planes[i], i], which
    must not be the plane it reads (planes[i] where use_minus[i]).
    Shapes: w float32 [T, V]; store float32 [D, N', V] (N' >= N; a RowStore's view), last
    dims contiguous; rows, planes, keep_planes, exclude, seeds, positions int64 [N];
    use_minus bool [N]. Without the [N, V] copies of the gathers, the exclusion and the
    store's write (the torch code's four launches over them)."""
    check_rows("w", w)
    n = rows.shape[0]
    _check_keys(n, seeds, positions, stream)
    if store.dim() != 3 or store.stride(2) != 1 or store.shape[1] < n or \
            store.shape[2] != w.shape[1] or store.dtype != w.dtype:  # fmt: skip
        raise ValueError(f"store must be {w.dtype} [D, >= {n}, {w.shape[1]}] with a contiguous "
                         f"last dim, got {store.dtype} {tuple(store.shape)} {store.stride()}")
    for name, x in (("rows", rows), ("planes", planes), ("keep_planes", keep_planes),
                    ("exclude", exclude)):  # fmt: skip
        if x.shape != (n,) or x.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [{n}], got {x.dtype} {tuple(x.shape)}")
    if use_minus.shape != (n,):
        raise ValueError(f"use_minus must be bool [{n}]")
    return _race(w, store, use_minus, n, seeds, positions, stream, True,
                 (rows, planes, keep_planes, exclude), (store.stride(1), store.stride(0)))


def _race(w, m, use, n, seeds, positions, stream, has_minus, gather, m_strides) -> torch.Tensor:
    """Both stages of a race (``race_rows`` / ``race_gathered``), inputs checked."""
    out = torch.empty(n, dtype=torch.int64, device=w.device)
    if n == 0:
        return out
    v = w.shape[1]
    n_chunks = triton.cdiv(v, RACE_BLOCK)
    lanes = 2 if has_minus else 1
    val = torch.empty(n, lanes, n_chunks, dtype=torch.float64, device=w.device)
    idx = torch.empty(n, lanes, n_chunks, dtype=torch.int32, device=w.device)
    per_row = isinstance(stream, torch.Tensor)
    streams, stream_value = (stream, 0) if per_row else (seeds, int(stream))
    rows, planes, keep, ex = gather if gather is not None else (seeds,) * 4  # unread without
    _race_chunk_kernel[(n, n_chunks)](w, m, use, seeds, positions, streams, stream_value, val,
                                      idx, rows, planes, keep, ex, v, w.stride(0), *m_strides,
                                      n_chunks, STREAM_PER_ROW=per_row, HAS_MINUS=has_minus,
                                      FAST=w.dtype == torch.float32,
                                      GATHER=gather is not None, BLOCK=RACE_BLOCK,
                                      num_warps=8)  # fmt: skip
    _race_row_kernel[(n,)](val, idx, out, n_chunks, HAS_MINUS=has_minus,
                           CHUNKS=triton.next_power_of_2(n_chunks), num_warps=1)  # fmt: skip
    return out

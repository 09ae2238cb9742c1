"""Triton launches for the small per-query and per-row tensors of a sampled step's choices
(``worker/sampled_rows.py``, whose torch functions ``query_layout_ref``, ``row_draws_ref`` and
``choose_ref`` are their references): three launches where the torch code takes ~50 launches
of a few elements each, each a few microseconds of a CUDA graph's replay.

query_layout: each query's row and index in it, whether it is a live sampled query, its row's
    sampling parameters (1.0 / 0 / 1.0 elsewhere, so the filter skips it) and whether it
    tests a draft; each row's drafts under test d (held where it verifies, else 0).
row_draws: each row's first rejected draft a (the least of its queries' ``rejected_at``, d
    where none rejects) and what its one draw reads (``kernels/race.py`` ``race_gathered``).
choose: each query's choice from the argmax, the tested drafts and the rows' draws.

Shapes: qo int32 / int64 [n + 1] (queries past qo[n]: padding, counted in the last row as
``torch.searchsorted`` counts them); per row [n] int64 (verify, held, x_pos, top_k, seed),
bool (sampled), float32 (temperature, top_p); per query [t].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .race import STREAM_DRAFT, STREAM_RESIDUAL, STREAM_TARGET

BLOCK = 128
TARGET, DRAFT, RESIDUAL = (tl.constexpr(s) for s in (STREAM_TARGET, STREAM_DRAFT,
                                                      STREAM_RESIDUAL))  # fmt: skip


@triton.jit
def _query_layout_kernel(qo_ptr, sampled_ptr, verify_ptr, held_ptr, temp_ptr, topk_ptr,
                         topp_ptr, row_ptr, j_ptr, live_ptr, qtemp_ptr, qtopk_ptr, qtopp_ptr,
                         check_ptr, d_ptr, n, t, LOG_N: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # searchsorted(qo[1:], i, right=True): how many rows end at or before query i
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + n
    for _ in range(LOG_N):
        mid = (lo + hi) // 2
        go = lo < hi
        end = tl.load(qo_ptr + 1 + mid, mask=go & (mid < n), other=0).to(tl.int32)
        right = go & (end <= i)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(go & ~right, mid, hi)
    ok = i < t
    row = tl.minimum(lo, n - 1)
    start = tl.load(qo_ptr + row, mask=ok, other=0).to(tl.int32)
    j = i - start
    last = tl.load(qo_ptr + n).to(tl.int32)
    live = ok & (i < last) & (tl.load(sampled_ptr + row, mask=ok, other=0) != 0)
    verifying = tl.load(verify_ptr + row, mask=ok, other=0) > 0
    d = tl.where(verifying, tl.load(held_ptr + row, mask=ok, other=0), 0)
    tl.store(row_ptr + i, row.to(tl.int64), mask=ok)
    tl.store(j_ptr + i, j.to(tl.int64), mask=ok)
    tl.store(live_ptr + i, live, mask=ok)
    tl.store(qtemp_ptr + i, tl.where(live, tl.load(temp_ptr + row, mask=ok, other=1.0), 1.0),
             mask=ok)  # fmt: skip
    tl.store(qtopk_ptr + i, tl.where(live, tl.load(topk_ptr + row, mask=ok, other=0), 0),
             mask=ok)  # fmt: skip
    tl.store(qtopp_ptr + i, tl.where(live, tl.load(topp_ptr + row, mask=ok, other=1.0), 1.0),
             mask=ok)  # fmt: skip
    tl.store(check_ptr + i, live & verifying & (j < d), mask=ok)
    # each row's d, by the programs covering its index
    r = i
    rok = r < n
    rv = tl.load(verify_ptr + r, mask=rok, other=0) > 0
    tl.store(d_ptr + r, tl.where(rv, tl.load(held_ptr + r, mask=rok, other=0), 0), mask=rok)


def query_layout(qo: torch.Tensor, sampled: torch.Tensor, verify: torch.Tensor,
                 held: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, t: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """-> (row, j int64 [t], live bool [t], temperature float32 [t], top_k int64 [t], top_p
    float32 [t], checks bool [t], d int64 [n]); one launch, capturable."""
    n, dev = held.shape[0], held.device
    row, j, qtopk = (torch.empty(t, dtype=torch.int64, device=dev) for _ in range(3))
    live, checks = (torch.empty(t, dtype=torch.bool, device=dev) for _ in range(2))
    qtemp, qtopp = (torch.empty(t, dtype=torch.float32, device=dev) for _ in range(2))
    d = torch.empty(n, dtype=torch.int64, device=dev)
    if max(t, n):
        _query_layout_kernel[(triton.cdiv(max(t, n), BLOCK),)](
            qo, sampled, verify, held, temperature, top_k, top_p, row, j, live, qtemp, qtopk,
            qtopp, checks, d, n, t, LOG_N=max(n, 1).bit_length(), BLOCK=BLOCK)  # fmt: skip
    return row, j, live, qtemp, qtopk, qtopp, checks, d


@triton.jit
def _row_draws_kernel(qo_ptr, rej_ptr, d_ptr, verify_ptr, sampled_ptr, held_ptr, xpos_ptr,
                      chain_ptr, a_ptr, rows_ptr, plane_ptr, keep_ptr, ex_ptr, res_ptr,
                      pos_ptr, stream_ptr, n, t, depth, stride_c, MAXQ: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n
    start = tl.load(qo_ptr + r, mask=ok, other=0).to(tl.int64)
    # the last row also holds the padding queries (row clamped to n - 1)
    end = tl.where(r == n - 1, t, tl.load(qo_ptr + r + 1, mask=ok, other=0).to(tl.int64))
    d = tl.load(d_ptr + r, mask=ok, other=0)
    a = d
    for k in range(MAXQ):
        q = start + k
        a = tl.minimum(a, tl.load(rej_ptr + q, mask=ok & (q < end) & (q < t), other=d))
    verifying = tl.load(verify_ptr + r, mask=ok, other=0) > 0
    sampled = tl.load(sampled_ptr + r, mask=ok, other=0) != 0
    held = tl.load(held_ptr + r, mask=ok, other=0)
    x_pos = tl.load(xpos_ptr + r, mask=ok, other=0)
    residual = sampled & verifying & (a < d)
    ac = tl.minimum(a, depth - 1)
    first = tl.minimum(start, t - 1)
    tl.store(a_ptr + r, a, mask=ok)
    tl.store(rows_ptr + r, tl.minimum(first + a, t - 1), mask=ok)
    tl.store(plane_ptr + r, ac, mask=ok)
    keep = tl.where(sampled & ~verifying, tl.minimum(held, depth - 1), -1)
    tl.store(keep_ptr + r, keep, mask=ok)
    rejected = tl.load(chain_ptr + ac * stride_c + r, mask=ok, other=0)
    tl.store(ex_ptr + r, tl.where(residual, rejected, -1), mask=ok)
    tl.store(res_ptr + r, residual, mask=ok)
    tl.store(pos_ptr + r, tl.where(verifying, x_pos + 1 + a, x_pos + held + 1), mask=ok)
    stream = tl.where(verifying, tl.where(residual, RESIDUAL, TARGET), DRAFT)
    tl.store(stream_ptr + r, stream.to(tl.int64), mask=ok)


def row_draws(qo: torch.Tensor, rejected_at: torch.Tensor, d: torch.Tensor,
              verify: torch.Tensor, sampled: torch.Tensor, held: torch.Tensor,
              x_pos: torch.Tensor, chain: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """rejected_at int64 [t]; chain int64 [D, n] -> (a, rows, planes, keep_planes, exclude
    int64 [n], residual bool [n], positions, streams int64 [n]): ``race_gathered``'s
    arguments and a; one launch, capturable."""
    n, t, dev = d.shape[0], rejected_at.shape[0], d.device
    a, rows, planes, keep, exclude, position, stream = (
        torch.empty(n, dtype=torch.int64, device=dev) for _ in range(7))
    residual = torch.empty(n, dtype=torch.bool, device=dev)
    chain = chain.contiguous()
    if n:
        # a row's queries that test a draft are its first d <= D - 1; the one after rejects none
        _row_draws_kernel[(triton.cdiv(n, BLOCK),)](
            qo, rejected_at, d, verify, sampled, held, x_pos, chain, a, rows, planes, keep,
            exclude, residual, position, stream, n, t, chain.shape[0], chain.stride(0),
            MAXQ=chain.shape[0], BLOCK=BLOCK)  # fmt: skip
    return a, rows, planes, keep, exclude, residual, position, stream


@triton.jit
def _choose_kernel(argmax_ptr, token_ptr, drawn_ptr, a_ptr, row_ptr, j_ptr, live_ptr,
                   verify_ptr, out_ptr, t, BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < t
    row = tl.load(row_ptr + i, mask=ok, other=0)
    j = tl.load(j_ptr + i, mask=ok, other=0)
    live = ok & (tl.load(live_ptr + i, mask=ok, other=0) != 0)
    verifying = tl.load(verify_ptr + row, mask=ok, other=0) > 0
    a = tl.load(a_ptr + row, mask=ok, other=0)
    drawn = tl.load(drawn_ptr + row, mask=ok, other=0)
    choice = tl.load(argmax_ptr + i, mask=ok, other=0)
    choice = tl.where(live & ~verifying & (j == 0), drawn, choice)
    in_verify = live & verifying
    choice = tl.where(in_verify & (j < a), tl.load(token_ptr + i, mask=ok, other=0), choice)
    choice = tl.where(in_verify & (j == a), drawn, choice)
    tl.store(out_ptr + i, choice, mask=ok)


def choose(argmax: torch.Tensor, token: torch.Tensor, drawn: torch.Tensor, a: torch.Tensor,
           row: torch.Tensor, j: torch.Tensor, live: torch.Tensor,
           verify: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """-> each query's choice, int64 [t]; one launch, capturable."""
    t = argmax.shape[0]
    out = torch.empty(t, dtype=torch.int64, device=argmax.device)
    if t:
        _choose_kernel[(triton.cdiv(t, BLOCK),)](argmax, token, drawn, a, row, j, live,
                                                 verify, out, t, BLOCK=BLOCK)  # fmt: skip
    return out

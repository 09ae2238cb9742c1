"""Triton top-k page choice of every draft row in one launch (one program per row).

Meaning: ``reference.choose_top_pages_ref`` (a stable descending sort of each row's candidate
scores, the first n_top kept, written in ascending page order). Shapes (R rows, C candidates):
    template:   int32 [nnz]          the step's sparse kv_indices, every other page in place
    pages:      int32 [slots, W]     the device page table (physical page ids by slot)
    scores:     float32 [slots + 1, S]  the page-score table (``PageScoreTable.scores``)
    rows:       int32 [4, R]         slot, candidate count, n_top, offset of the middle
    has_scores: bool [R]             rows never scored rank candidates by index instead
    -> int32 [nnz]: template with each row's n_top chosen pages in its middle

Instead of sorting C candidates (a radix sort of [R, C] and ~15 tensor ops around it), a row
finds the n_top-th largest score by a 32-step bisection over order-preserving integer keys,
takes every candidate above it and the lowest-index ties at it: the set the stable sort keeps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _top_pages_kernel(
    out_ptr, pages_ptr, scores_ptr, rows_ptr, has_ptr, num_rows, stride_p, stride_s, width,
    score_width, first, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    slot = tl.load(rows_ptr + r).to(tl.int64)
    n_cand = tl.load(rows_ptr + num_rows + r)
    n_top = tl.load(rows_ptr + 2 * num_rows + r)
    dst = tl.load(rows_ptr + 3 * num_rows + r)
    if n_top > 0:
        j = tl.arange(0, BLOCK)
        valid = j < n_cand
        vals = tl.load(scores_ptr + slot * stride_s + first + j,
                       mask=valid & (first + j < score_width), other=0.0)  # fmt: skip
        vals = tl.where(tl.load(has_ptr + r) != 0, vals, j.to(tl.float32))
        vals = tl.where(vals == 0.0, 0.0, vals)  # -0.0 ties +0.0, as in the sort
        vals = tl.where(valid, vals, float("-inf"))
        # order-preserving keys in [0, 2^32): floats by their bits, negatives reversed (the
        # block's columns past max_candidates are -inf too, and n_top never reaches them)
        s = vals.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(s >= 0, s + 2147483648, 2147483647 - (s & 2147483647))
        # the n_top-th largest key: the largest t with at least n_top keys >= t
        t = tl.zeros([], tl.int64)
        for b in tl.static_range(32):
            cand = t | (1 << (31 - b))
            if tl.sum((key >= cand).to(tl.int32), axis=0) >= n_top:
                t = cand
        above = key > t
        tie = key == t
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1
        chosen = above | (tie & (tie_rank < n_top - tl.sum(above.to(tl.int32), axis=0)))
        pos = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # ascending page order
        col = tl.minimum(first + j, width - 1)
        phys = tl.load(pages_ptr + slot * stride_p + col, mask=chosen, other=0)
        tl.store(out_ptr + dst + pos, phys, mask=chosen)


def choose_top_pages(template: torch.Tensor, pages: torch.Tensor, scores: torch.Tensor,
                     rows: torch.Tensor, has_scores: torch.Tensor, first: int,
                     max_candidates: int) -> torch.Tensor:  # fmt: skip
    """``reference.choose_top_pages_ref`` in one launch; a new kv_indices (template kept)."""
    if template.dtype != torch.int32 or pages.dtype != torch.int32 or rows.dtype != torch.int32:
        raise ValueError(f"template, pages and rows must be int32, got {template.dtype}, "
                         f"{pages.dtype}, {rows.dtype}")  # fmt: skip
    if scores.dtype != torch.float32 or rows.dim() != 2 or rows.shape[0] != 4:
        raise ValueError(f"scores must be float32 and rows int32 [4, R], got {scores.dtype} "
                         f"{tuple(rows.shape)}")  # fmt: skip
    if pages.stride(1) != 1 or scores.stride(1) != 1:
        raise ValueError("pages and scores need contiguous rows")
    out = template.clone()
    r = rows.shape[1]
    if r == 0 or max_candidates <= 0:
        return out
    rows = rows.contiguous()
    has = has_scores.to(torch.int8)
    block = max(16, triton.next_power_of_2(max_candidates))
    _top_pages_kernel[(r,)](
        out, pages, scores, rows, has, r, pages.stride(0), scores.stride(0), pages.shape[1],
        scores.shape[1], first, BLOCK=block, num_warps=4 if block <= 2048 else 8,
    )  # fmt: skip
    return out

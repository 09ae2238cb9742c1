"""Triton page-list gather: every row's page list from the device page table in one launch.

Meaning: ``reference.gather_lists_ref``. Shapes (R rows, L logical columns, slots x W table):
    table:    int32 [slots, W]   physical page ids by slot, rows contiguous
    counts:   int [R]            pages row r lists
    logical:  int [R, L]         row r lists table[row_slot[r], logical[r, :counts[r]]] (any
                                 row stride, 0 included: one logical row for every row)
    row_slot: int [R]
    -> kv_indptr int32 [R + 1], kv_indices int32 [capacity] (0 past kv_indptr[R])

For the reference's cumsum, index, where, scatter and ~6 more tensor ops; each program sums
the counts of the rows before it (R is a batch: a few hundred at most) for its offset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_l"])
def _gather_lists_kernel(
    table_ptr, counts_ptr, logical_ptr, slot_ptr, indptr_ptr, indices_ptr, num_rows, stride_t,
    width, stride_l, num_cols, capacity, R_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    i = tl.arange(0, R_BLOCK)
    before = tl.load(counts_ptr + i, mask=i < r, other=0).to(tl.int64)
    start = tl.sum(before, axis=0)
    count = tl.load(counts_ptr + r).to(tl.int64)
    if r == 0:
        tl.store(indptr_ptr, 0)
    tl.store(indptr_ptr + r + 1, (start + count).to(tl.int32))
    slot = tl.load(slot_ptr + r).to(tl.int64)
    n = tl.minimum(count, num_cols)
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < n
        col = tl.load(logical_ptr + r.to(tl.int64) * stride_l + j, mask=ok, other=0)
        col = tl.minimum(tl.maximum(col.to(tl.int64), 0), width - 1)
        phys = tl.load(table_ptr + slot * stride_t + col, mask=ok, other=0)
        tl.store(indices_ptr + start + j, phys, mask=ok & (start + j < capacity))


def gather_lists(table: torch.Tensor, counts: torch.Tensor, logical: torch.Tensor,
                 row_slot: torch.Tensor, capacity: int) -> tuple[torch.Tensor,
                                                                 torch.Tensor]:  # fmt: skip
    """``reference.gather_lists_ref`` in one launch (and the indices' zero fill)."""
    if table.dtype != torch.int32 or table.stride(1) != 1:
        raise ValueError(f"table must be int32 with contiguous rows, got {table.dtype} "
                         f"strides {table.stride()}")  # fmt: skip
    r = counts.shape[0]
    if logical.dim() != 2 or logical.shape[0] != r or row_slot.shape != (r,):
        raise ValueError(f"logical must be [{r}, L] and row_slot [{r}], got "
                         f"{tuple(logical.shape)} and {tuple(row_slot.shape)}")  # fmt: skip
    if logical.shape[1] and logical.stride(1) != 1:
        logical = logical.contiguous()
    indptr = torch.zeros(r + 1, dtype=torch.int32, device=table.device)
    indices = torch.zeros(capacity, dtype=torch.int32, device=table.device)
    if r == 0:
        return indptr, indices
    block = max(16, min(1024, triton.next_power_of_2(max(1, logical.shape[1]))))
    _gather_lists_kernel[(r,)](
        table, counts, logical, row_slot, indptr, indices, r, table.stride(0), table.shape[1],
        logical.stride(0), logical.shape[1], capacity, R_BLOCK=triton.next_power_of_2(r),
        BLOCK=block, num_warps=4,
    )  # fmt: skip
    return indptr, indices

"""A self-planning graph step's rows: tokens and page lists from a few numbers per row, the
greedy acceptance after the step, and the refresh layer's scoring lists and score rows
(issue 14 items 1, 3).

The draft-step, verify and asynchronous-run graphs (``draft_graphs.py``, ``verify_graphs.py``,
``async_graphs.py``) keep each row's slot, flags, last token and position (and, in a run, its
draft length and drafts held) on the device. ``plan_rows`` turns them into the step's query
tokens, positions, KV slots and page lists; ``accept_rows`` moves each row on from the
target's argmax; ``score_lists`` and ``store_row_scores`` serve the rescoring
(``draft_pages.rescore_first_last``). On a GPU each is one Triton launch
(``kernels/row_plan.py``) for the tensor ops of its meaning (``reference.plan_rows_ref``,
``accept_rows_ref``, ``score_lists_ref``, ``store_row_scores_ref``), which the CPU runs.
"""

from __future__ import annotations

import numpy as np
import torch

from aspire_ray.kernels.host import upload
from aspire_ray.kernels.reference import (
    accept_rows_ref,
    plan_rows_ref,
    score_lists_ref,
    store_row_scores_ref,
)
from aspire_ray.model.rotary import fused_ops

from .page_policies import PageSelector


def policy_layout(selector: PageSelector, width: int, device: torch.device) -> torch.Tensor:
    """The policy's sparse list layout by page count: int32 [3, width + 1], column P the
    (head_end, n_top, tail_start) of a row of P pages (``PageSelector.layout``). A graph step
    looks its rows up here, so the policy's formula has one home. Call outside a capture."""
    head, top, tail = selector.layout(np.arange(width + 1, dtype=np.int64))
    # through pinned memory: a copy from pageable memory would sync the stream (a table that
    # widens mid-serving recomputes this while earlier steps still run)
    return upload(np.stack([head, top, tail]).astype(np.int32), device)


def plan_rows(state: dict[str, torch.Tensor], chain: torch.Tensor, table: torch.Tensor,
              layout: torch.Tensor, page_size: int, tokens: int, inputs: torch.Tensor,
              sparse_capacity: int, full_capacity: int = 0, queries: int = 0,
              verify_all: bool = False, fused: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """``reference.plan_rows_ref`` (what it writes and returns); capturable. fused: one
    Triton launch where the device runs them, else the reference's tensor ops."""
    if fused and fused_ops(table):
        from aspire_ray.kernels.row_plan import plan_rows as kernel

        fn = kernel
    else:
        fn = plan_rows_ref
    return fn(state, chain, table, layout, page_size, tokens, inputs, sparse_capacity,
              full_capacity, queries, verify_all)  # fmt: skip


def accept_rows(argmax: torch.Tensor, tokens: torch.Tensor, qo: torch.Tensor,
                rows: torch.Tensor, x_id: torch.Tensor, x_pos: torch.Tensor,
                start_pos: torch.Tensor, chain: torch.Tensor,
                held: torch.Tensor | None = None, fused: bool = True) -> None:  # fmt: skip
    """``reference.accept_rows_ref``, in place; capturable (fused: as ``plan_rows``)."""
    if fused and fused_ops(argmax):
        from aspire_ray.kernels.row_plan import accept_rows as kernel

        kernel(argmax, tokens, qo, rows, x_id, x_pos, start_pos, chain, held)
    else:
        accept_rows_ref(argmax, tokens, qo, rows, x_id, x_pos, start_pos, chain, held)


def score_lists(first: torch.Tensor | None, last: torch.Tensor | None,
                seen_first: torch.Tensor, seen_last: torch.Tensor, live: torch.Tensor,
                single: torch.Tensor | None, row_slot: torch.Tensor, table: torch.Tensor,
                page_size: int, capacity: int, per_item: int, item_capacity: int,
                fused: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """``reference.score_lists_ref`` (the refresh layer's scoring queries and their lists);
    capturable (fused: as ``plan_rows``)."""
    if fused and fused_ops(table):
        from aspire_ray.kernels.row_plan import score_lists as fn
    else:
        fn = score_lists_ref
    return fn(first, last, seen_first, seen_last, live, single, row_slot, table, page_size,
              capacity, per_item, item_capacity)  # fmt: skip


def store_row_scores(page_scores: torch.Tensor, indptr: torch.Tensor, pages: torch.Tensor,
                     live: torch.Tensor, single: torch.Tensor | bool | None, slot: torch.Tensor,
                     scores: torch.Tensor, fused: bool = True) -> None:  # fmt: skip
    """``reference.store_row_scores_ref``, in place; capturable (fused: as ``plan_rows``)."""
    if fused and fused_ops(scores):
        from aspire_ray.kernels.row_plan import store_row_scores as fn
    else:
        fn = store_row_scores_ref
    fn(page_scores, indptr, pages, live, single, slot, scores)

"""Refresh-layer page scores on the device, and every draft row's top-k pages in one batch.

The lengths of a step's sparse page lists depend only on each row's page count (the policy's
``layout``), so the worker plans them on the host; only which candidate pages fill the top-k
middle of a ``TopKPages`` list depends on scores, and that is chosen here for all draft rows at
once with a few tensor ops, without a device sync. The choice equals ``TopKPages.select`` row by
row: candidates sorted by score, descending and stable (ties to the lower page index), missing
scores 0; rows never scored take the window just before the recent pages.
"""

from __future__ import annotations

import torch

from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.kernels.reference import choose_top_pages_ref
from aspire_ray.model.rotary import fused_ops
from aspire_ray.tp import TPGroup

from .page_table import PageTable, list_capacity
from .step_attention import all_head_page_scores
from .step_rows import score_lists, store_row_scores


class PageScoreTable:
    """Page scores of the live requests: float32 [slots, width] on the worker's device.

    A request's row is its page-table slot (``page_table.py``). Row s holds the request's scores
    for the pages its scoring queries saw, averaged over those queries (DESIGN.md §1.2), and 0
    past them; it is rewritten whole each time the request is scored. One more row, the last
    (``scratch``), belongs to no request: fixed-shape writes of padding rows land there.
    """

    def __init__(self, device: torch.device, width: int = 64, slots: int = 16) -> None:
        self.device = device
        self.scores = torch.zeros(slots + 1, width, dtype=torch.float32, device=device)

    @property
    def scratch(self) -> int:
        return self.scores.shape[0] - 1

    def ensure_slots(self, slots: int) -> None:
        """Rows for slots [0, slots) (the page table's slot count; called while planning)."""
        if slots + 1 > self.scores.shape[0]:
            self._resize(slots + 1, self.scores.shape[1])

    def ensure_width(self, pages: int) -> None:
        """Make room for requests of ``pages`` pages (called while planning, before any use)."""
        if pages > self.scores.shape[1]:
            self._resize(self.scores.shape[0], max(pages, 2 * self.scores.shape[1]))

    def _resize(self, slots: int, width: int) -> None:
        grown = torch.zeros(slots, width, dtype=torch.float32, device=self.device)
        grown[: self.scratch, : self.scores.shape[1]] = self.scores[: self.scratch]
        self.scores = grown

    @property
    def width(self) -> int:
        return self.scores.shape[1]

    def store(self, page_scores: torch.Tensor, dest: torch.Tensor, slots: torch.Tensor,
              num_queries: torch.Tensor) -> None:  # fmt: skip
        """Replace the rows ``slots`` by the mean of their scoring queries' page scores.

        page_scores: float32 [nnz] (every scoring query's listed pages, flat); dest: int [nnz],
        the flat table index (slot * width + page) of each; slots: int [S] distinct owners;
        num_queries: float32 [S], each owner's scoring-query count (1 or 2).
        """
        slots = slots.long()
        self.scores.index_fill_(0, slots, 0.0)
        self.scores.view(-1).index_add_(0, dest.long(), page_scores)
        # sum, then divide: the same rounding as averaging the per-query lists on the host
        self.scores.index_copy_(0, slots, self.scores.index_select(0, slots) / num_queries[:, None])

    def row(self, slot: int, pages: int) -> torch.Tensor:
        return self.scores[slot, :pages]


def sync_tables(page_table: PageTable, scores: PageScoreTable | None) -> None:
    """Before a graph step reads them: the score table has a row per page-table slot and a
    column per page of its widest request (a resize means a recapture, so this runs before the
    capture check), and the page table's deltas reach the device."""
    if scores is not None:
        scores.ensure_slots(page_table.slots)
        scores.ensure_width(page_table.width)
    page_table.flush()


def choose_top_pages(template: torch.Tensor, pages: torch.Tensor, table: PageScoreTable,
                     rows: torch.Tensor, has_scores: torch.Tensor, first: int,
                     max_candidates: int) -> torch.Tensor:  # fmt: skip
    """Fill the top-k middle of each listed row's sparse page list; returns a new kv_indices
    (``reference.choose_top_pages_ref`` says what and with which shapes; on a GPU one Triton
    launch, ``kernels/top_pages.py``, for the sort and ~15 tensor ops of the reference)."""
    if fused_ops(template):
        from aspire_ray.kernels.top_pages import choose_top_pages as kernel

        return kernel(template, pages, table.scores, rows, has_scores, first, max_candidates)
    return choose_top_pages_ref(template, pages, table.scores, rows, has_scores, first,
                                max_candidates)  # fmt: skip


def rescore_first_last(backend, q: torch.Tensor, lse: torch.Tensor, kv_cache: torch.Tensor,
                       scale: float, table: torch.Tensor, scores: PageScoreTable,
                       first: torch.Tensor | None, last: torch.Tensor | None,
                       seen_first: torch.Tensor, seen_last: torch.Tensor, live: torch.Tensor,
                       slot: torch.Tensor, row_slot: torch.Tensor, pool_pages: int,
                       single: torch.Tensor | None = None, fused: bool = True,
                       tp: TPGroup | None = None) -> None:  # fmt: skip
    """Rows' page scores from their first and last query, averaged as
    ``PageScoreTable.store`` averages them, into the rows' slots of the score table (padding
    rows: its scratch row); planned on the device (CUDA graphs). q [T, Hq, D], lse [T, Hq]:
    the layer's queries; first, last: int64 [n] token indices (None: row r's one query is
    token r, every row single); seen_first, seen_last: int64 [n] KV tokens each one sees;
    table: int32 [slots, W] the page table; live: bool [n]; slot, row_slot: int64 [n];
    single: bool [n], rows of one query (scored from it alone, their second query listing no
    page: draft rows read the KV once). fused: the lists and the score rows in one launch each
    where the device runs Triton (``step_rows``), else the reference's tensor ops. tp: the
    shard's group (None: one rank); ranks take the max over every rank's heads."""
    from aspire_ray.kernels.page_scores import work_tokens  # imports triton

    n, ps = live.shape[0], kv_cache.shape[2]
    cap = 2 * list_capacity(n, table, pool_pages)  # a row's pages, listed by both its queries
    per_item = work_tokens(ps)
    items = -(-cap * ps // per_item) + 2 * n
    lists = score_lists(first, last, seen_first, seen_last, live, single, row_slot, table, ps,
                        cap, per_item, items, fused)  # fmt: skip
    meta = PagedKVMeta(lists["qo"], lists["indptr"], lists["indices"], lists["last"], ps)
    which = lists["which"]
    page_scores = all_head_page_scores(backend, tp, q[which], lse[which].contiguous(), kv_cache,
                                       meta, scale, (lists["work"], lists["count"]))
    store_row_scores(page_scores, lists["indptr"], lists["pages"], live,
                     True if first is None else single, slot, scores.scores, fused)  # fmt: skip

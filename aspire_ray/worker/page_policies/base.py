"""The draft page policy's interface: which of a request's pages a sparse draft row attends to.

A policy maps (page scores or None, page count P) to logical page indices, the recent pages
last (so the partly filled last page lines up with ``kv_last_page_len``). Budget
(DESIGN.md §1.1): k = max(k_min, ceil(rho * P)) pages; if P <= k the full list (exact).

``select`` is the per-row meaning; ``layout`` gives the same lists for many rows at once as
three numbers per row, so that the worker can build every draft row's list in one batch (the
top-k part on the device, ``draft_pages.py``): the list is pages [0, head_end), then the n_top
best-scoring candidates of [head_end, tail_start) in ascending order, then [tail_start, P).
``layout`` takes host (numpy) or device (torch) page counts: the self-planning graphs lay out
their lists on the device with the same formula (``step_rows.policy_layout``).
"""

from __future__ import annotations

import numpy as np
import torch

from aspire_ray.config import SpecConfig


class PageSelector:
    """Base policy. ``uses_scores``: whether refresh-layer scores feed it (the worker then
    keeps a score table and rescores at the refresh layer; when, the mode's
    ``refresh_while_drafting`` says: while drafting, or at verifications only)."""

    uses_scores = False

    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg

    def budget(self, num_pages: int) -> int:
        return self.cfg.sparse_budget(num_pages)

    def select(self, scores: torch.Tensor | None, num_pages: int) -> list[int]:
        raise NotImplementedError

    def budgets(self, num_pages: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """``budget`` of every entry of int64 [R] (the same float64 arithmetic)."""
        return self.cfg.sparse_budgets(num_pages)

    def layout(self, num_pages):
        """int64 [R] page counts (numpy or torch) -> (head_end, n_top, tail_start), each int64
        [R] of the same kind."""
        raise NotImplementedError


def namespace(x):
    """numpy or torch: both spell where / zeros_like alike."""
    return torch if isinstance(x, torch.Tensor) else np

"""Draft page-selection policies: which of a request's pages a sparse draft row attends to.

A policy maps (page scores or None, page count P) to logical page indices, the recent pages
last (so the partly filled last page lines up with ``kv_last_page_len``). Budget
(DESIGN.md §1.1): k = max(k_min, ceil(rho * P)) pages; if P <= k the full list (exact).

``select`` is the per-row meaning; ``layout`` gives the same lists for many rows at once as
three numbers per row, so that the worker can build every draft row's list in one batch (the
top-k part on the device, ``draft_pages.py``): the list is pages [0, head_end), then the n_top
best-scoring candidates of [head_end, tail_start) in ascending order, then [tail_start, P).
``layout`` takes host (numpy) or device (torch) page counts: the draft-step graphs
(``draft_graphs.py``) lay out their lists on the device with the same formula.
"""

from __future__ import annotations

import numpy as np
import torch

from aspire_ray.config import SpecConfig


class PageSelector:
    """Base policy. ``uses_scores``: whether refresh-layer scores feed it."""

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


class StreamingWindow(PageSelector):
    """StreamingLLM (MagicDec's draft): the sink page plus the most recent pages, k in all."""

    def select(self, scores: torch.Tensor | None, num_pages: int) -> list[int]:
        k = self.budget(num_pages)
        if num_pages <= k:
            return list(range(num_pages))
        return [0] + list(range(num_pages - (k - 1), num_pages))

    def layout(self, num_pages):
        xp = _namespace(num_pages)
        k = self.budgets(num_pages)
        full = num_pages <= k
        head_end = xp.where(full, num_pages, 1)
        return head_end, xp.zeros_like(num_pages), xp.where(full, num_pages, num_pages - (k - 1))


class TopKPages(PageSelector):
    """Top-scoring pages by refresh-layer attention, plus the sink and the L recent pages.

    scores: float32 [P_scored] (P_scored may lag P by the pages added since scoring; those are
    recent pages anyway). Without scores yet, falls back to the streaming window.
    """

    uses_scores = True

    def select(self, scores: torch.Tensor | None, num_pages: int) -> list[int]:
        k = self.budget(num_pages)
        if num_pages <= k:
            return list(range(num_pages))
        recent_start = num_pages - self.cfg.recent_pages
        sink = [0] if self.cfg.keep_sink_page else []
        first_candidate = len(sink)
        n_top = k - self.cfg.recent_pages - len(sink)
        if scores is None:
            middle = list(range(recent_start - n_top, recent_start))
        else:
            cand = torch.zeros(recent_start - first_candidate, dtype=torch.float32)
            have = min(scores.shape[0], recent_start) - first_candidate
            if have > 0:
                cand[:have] = scores[first_candidate : first_candidate + have].float().cpu()
            # ties broken by lower page index (stable, identical on every rank)
            top = torch.sort(cand, descending=True, stable=True).indices[:n_top]
            middle = sorted((top + first_candidate).tolist())
        return sink + middle + list(range(recent_start, num_pages))

    def layout(self, num_pages):
        # Without scores the middle is the window just before the recent pages: the device
        # selection gives such rows ascending scores, so their latest candidates win.
        k = self.budgets(num_pages)
        full = num_pages <= k
        sink = int(self.cfg.keep_sink_page)
        recent = self.cfg.recent_pages
        xp = _namespace(num_pages)
        head_end = xp.where(full, num_pages, sink)
        n_top = xp.where(full, 0, k - recent - sink)
        return head_end, n_top, xp.where(full, num_pages, num_pages - recent)


class FullPages(PageSelector):
    """Every page: plain decoding's attention, for the decode chains of ``ar`` (the draft-step
    graphs run them with this policy)."""

    def budget(self, num_pages: int) -> int:
        return num_pages

    def budgets(self, num_pages):
        return num_pages

    def layout(self, num_pages):
        xp = _namespace(num_pages)
        return num_pages, xp.zeros_like(num_pages), num_pages


def _namespace(x):
    """numpy or torch: both spell where / zeros_like alike."""
    return torch if isinstance(x, torch.Tensor) else np


# ``ModeSpec.page_policy`` -> its class: a new policy is one class registered here and the
# ``config.MODES`` row that names it.
PAGE_POLICIES: dict[str, type[PageSelector]] = {
    "window": StreamingWindow,
    "topk": TopKPages,
}


def make_selector(cfg: SpecConfig) -> PageSelector | None:
    """The draft page policy of a spec mode (``config.MODES``); None for a mode without
    drafts (plain autoregressive decoding)."""
    spec = cfg.mode_spec
    if spec.page_policy == "none":
        return None
    if spec.page_policy not in PAGE_POLICIES:
        raise ValueError(f"page_policy must be one of {tuple(PAGE_POLICIES)} or 'none', "
                         f"got {spec.page_policy!r} (spec mode {cfg.mode!r})")
    policy = PAGE_POLICIES[spec.page_policy]
    if spec.refresh_while_drafting and not policy.uses_scores:
        raise ValueError(f"spec mode {cfg.mode!r} refreshes page scores while drafting, but "
                         f"its page policy {spec.page_policy!r} reads no scores")
    return policy(cfg)

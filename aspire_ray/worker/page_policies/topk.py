"""Top-k pages by refresh-layer attention, plus the sink and the recent pages (ASPIRE's and
SpecAttn's drafts; the modes table says whether the scores refresh while drafting or at
verifications only)."""

from __future__ import annotations

import torch

from .base import PageSelector, namespace


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
        xp = namespace(num_pages)
        head_end = xp.where(full, num_pages, sink)
        n_top = xp.where(full, 0, k - recent - sink)
        return head_end, n_top, xp.where(full, num_pages, num_pages - recent)

"""StreamingLLM's window (MagicDec's draft): the sink page plus the most recent pages."""

from __future__ import annotations

import torch

from .base import PageSelector, namespace


class StreamingWindow(PageSelector):
    """The sink page plus the most recent pages, k in all; no scores."""

    def select(self, scores: torch.Tensor | None, num_pages: int) -> list[int]:
        k = self.budget(num_pages)
        if num_pages <= k:
            return list(range(num_pages))
        return [0] + list(range(num_pages - (k - 1), num_pages))

    def layout(self, num_pages):
        xp = namespace(num_pages)
        k = self.budgets(num_pages)
        full = num_pages <= k
        head_end = xp.where(full, num_pages, 1)
        return head_end, xp.zeros_like(num_pages), xp.where(full, num_pages, num_pages - (k - 1))

"""Every page: plain decoding's attention, as a policy (``ar``'s decode chains run on the
draft-step graphs with it)."""

from __future__ import annotations

from .base import PageSelector, namespace


class FullPages(PageSelector):
    """Every page of every row."""

    def budget(self, num_pages: int) -> int:
        return num_pages

    def budgets(self, num_pages):
        return num_pages

    def layout(self, num_pages):
        xp = namespace(num_pages)
        return num_pages, xp.zeros_like(num_pages), num_pages

"""The page pool: which KV pages are free, and which request owns each used page.

Invariant after every public call: len(free) + used == num_pages, and no page is owned
twice (page ids are global, shared by every TP rank).

A 32k-token request holds ~2,000 pages: its pages are checked and returned with C-level list
operations where they can be (``itemgetter``, ``count``, ``extend``), not a dict lookup and
delete per page.
"""

from __future__ import annotations

import math
from operator import itemgetter


class OutOfPagesError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        # LIFO free list: recently freed pages are reused first (warm in cache)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: list[str | None] = [None] * num_pages  # page -> owner, None: free

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: str, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        if n <= 0:
            return []
        pages = self._free[-n:][::-1]  # the order of n pops
        del self._free[-n:]
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, owner: str, pages: list[int]) -> None:
        """Return ``owner``'s pages; raises, freeing none, if one is not its own (or no page)
        or is listed twice."""
        if not pages:
            return
        if min(pages) < 0 or max(pages) >= self.num_pages:
            raise RuntimeError(f"page ids of {owner!r} outside [0, {self.num_pages})")
        held = itemgetter(*pages)(self._owner) if len(pages) > 1 else (self._owner[pages[0]],)
        if held.count(owner) != len(pages):
            bad = next(p for p, o in zip(pages, held, strict=True) if o != owner)
            raise RuntimeError(f"page {bad} is not owned by {owner!r}")
        if len(set(pages)) != len(pages):
            raise RuntimeError(f"a page is listed twice in {owner!r}'s pages to free")
        for p in pages:
            self._owner[p] = None
        self._free.extend(pages)

    def check(self) -> None:
        """Assert the invariants (used by tests and debug runs)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        owned = {p for p, o in enumerate(self._owner) if o is not None}
        assert not free & owned, "a page is both free and owned"
        assert len(free) + len(owned) == self.num_pages, "pages leaked"

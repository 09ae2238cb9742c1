"""The page pool: which KV pages are free, and which request owns each used page.

Invariant after every public call: len(free) + len(owner) == num_pages, and no page is owned
twice (page ids are global, shared by every TP rank).
"""

from __future__ import annotations

import math


class OutOfPagesError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        # LIFO free list: recently freed pages are reused first (warm in cache)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: str, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, owner: str, pages: list[int]) -> None:
        for p in pages:
            if self._owner.get(p) != owner:
                raise RuntimeError(f"page {p} is not owned by {owner!r}")
            del self._owner[p]
            self._free.append(p)

    def check(self) -> None:
        """Assert the invariants (used by tests and debug runs)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        assert not free & set(self._owner), "a page is both free and owned"
        assert len(free) + len(self._owner) == self.num_pages, "pages leaked"

"""What planning a step reads of its shard: the tables, the page policy, the attention backend.

The Worker builds one ``StepResources`` at start-up and hands it to every ``StepBatch``, so
planning depends on these names only, never on the Worker (nor on its request map).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aspire_ray.attention import AttentionBackend
from aspire_ray.tp import TPGroup

from .draft_pages import PageScoreTable
from .page_policies import PageSelector
from .page_table import PageTable


@dataclass(frozen=True)
class StepResources:
    """The shard's objects a step plans over. The tables are the Worker's own (one device
    copy each, grown in place, so a frozen holder stays valid); planning writes only page
    scores, through ``reserve_scores`` and ``store_scores``."""

    device: torch.device
    page_size: int  # tokens per KV page
    page_table: PageTable  # slot -> the request's pages (host mirror and device table)
    scores: PageScoreTable | None  # slot -> refresh-layer page scores; None: no scoring policy
    selector: PageSelector | None  # draft rows' page policy; None: the mode never drafts
    backend: AttentionBackend
    tp: TPGroup
    refresh_layer: int  # the layer whose attention scores pages
    # draft rows score pages at the refresh layer and attend to their full lists there
    refresh_while_drafting: bool

    @property
    def scoring(self) -> bool:
        """Whether the page policy reads scores: the refresh layer then scores pages."""
        return self.selector is not None and self.selector.uses_scores

    def reserve_scores(self, slots: int, pages: int) -> None:
        """Grow the score table (if any) to hold ``slots`` slots of ``pages`` pages each."""
        if self.scores is not None:
            self.scores.ensure_slots(slots)
            self.scores.ensure_width(pages)

    def store_scores(self, page_scores: torch.Tensor, dest: torch.Tensor, slots: torch.Tensor,
                     num_queries: torch.Tensor) -> None:  # fmt: skip
        """Replace the scores of ``slots`` by the mean of their queries' page scores
        (``PageScoreTable.store``: page_scores float32 [nnz] at flat indices dest [nnz])."""
        self.scores.store(page_scores, dest, slots, num_queries)

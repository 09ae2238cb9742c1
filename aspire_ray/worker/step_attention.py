"""Per-step attention plan: which page lists each layer uses, and the refresh layer.

Built once per step by the worker and handed to the model (``AttentionPlan``). Layers
before the refresh layer l_r use ``meta_pre`` (draft rows over their current sparse pages, other
rows over all pages); l_r runs ``meta_refresh`` (full attention for every row that is scored)
and returns the log-sum-exp, from which the scoring queries' page scores are computed; the
callback re-selects the sparse pages and returns ``meta_post`` for the layers after l_r.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aspire_ray.attention import AttentionBackend
from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.tp import TPGroup


@dataclass
class ScoringQueries:
    """The queries whose refresh-layer attention scores pages.

    token_index: [S] int64 indices into the step's flattened tokens.
    meta: one row per scoring query, listing the pages visible to that query.
    """

    token_index: torch.Tensor
    meta: PagedKVMeta


class StepAttention:
    def __init__(
        self,
        backend: AttentionBackend,
        tp: TPGroup,
        slot_mapping: torch.Tensor,
        meta_pre: PagedKVMeta,
        refresh_layer: int,
        meta_refresh: PagedKVMeta | None = None,
        scoring: ScoringQueries | None = None,
        on_scores: Callable[[torch.Tensor], PagedKVMeta] | None = None,
    ) -> None:
        self.backend = backend
        self.tp = tp
        self.slot_mapping = slot_mapping
        self.meta_pre = meta_pre
        self.meta_post = meta_pre
        self.refresh_layer = refresh_layer
        self.meta_refresh = meta_refresh or meta_pre
        self.scoring = scoring
        self.on_scores = on_scores
        self.refresh_seconds = 0.0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Store the step's k/v [T, Hkv, D] by slot, then attend (q [T, Hq, D])."""
        self.backend.store_kv(k, v, kv_cache, self.slot_mapping)
        return self.attend_stored(layer, q, kv_cache, scale)

    def attend_stored(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor,
                      scale: float) -> torch.Tensor:  # fmt: skip
        """Attention of q [T, Hq, D] once this layer's new K/V are in the cache (the CUDA-graph
        path stores them inside its captured pieces) -> [T, Hq, D]."""
        if layer < self.refresh_layer:
            return self.backend.attention(q, kv_cache, self.meta_pre, scale)
        if layer > self.refresh_layer:
            return self.backend.attention(q, kv_cache, self.meta_post, scale)
        if self.scoring is None:
            return self.backend.attention(q, kv_cache, self.meta_refresh, scale)
        out, lse = self.backend.attention(q, kv_cache, self.meta_refresh, scale, return_lse=True)
        idx, meta = self.scoring.token_index, self.scoring.meta
        self.meta_post = self.on_scores(
            all_head_page_scores(self.backend, self.tp, q[idx], lse[idx], kv_cache, meta, scale))
        return out


def all_head_page_scores(backend: AttentionBackend, tp: TPGroup | None, q: torch.Tensor,
                         lse: torch.Tensor, kv_cache: torch.Tensor, meta: PagedKVMeta,
                         scale: float, work: tuple[torch.Tensor, torch.Tensor] | None = None,
                         ) -> torch.Tensor:  # fmt: skip
    """Each listed page's score, the max over ALL query heads of each token's attention
    probability summed over the page (DESIGN.md §1.2): float32 [nnz_pages]. q [R, Hq_local, D],
    lse [R, Hq_local]: this rank's heads. One rank (tp None or of size 1): summed per page in
    the kernel. Several: each token's max over this rank's heads, the max over ranks (every
    rank then holds the same bits, so every rank picks the same pages), then the sum. work: a
    device-planned work list (the CUDA graphs); capturable, the all-reduce included."""
    extra = {} if work is None else {"work": work}
    if tp is None or tp.size == 1:
        return backend.page_scores(q, lse, kv_cache, meta, scale, **extra)
    token_probs = backend.token_max_probs(q, lse, kv_cache, meta, scale, **extra)  # [nnz, ps]
    return tp.all_reduce_max(token_probs).sum(dim=-1)

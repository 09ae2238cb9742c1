"""The Triton attention backend: paged attention, KV store and page scoring as Triton kernels.

Importing this module registers it as "triton"; it needs only triton (on a CPU, the kernels run
under ``TRITON_INTERPRET=1``, slowly, which is how CI tests them).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from aspire_ray.kernels.attention_config import DETERMINISTIC, query_tile_tokens
from aspire_ray.kernels.kv_store import store_kv
from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.kernels.page_scores import page_scores, token_max_probs
from aspire_ray.kernels.paged_attention import DEFAULT_CONFIG, AttentionConfig, paged_attention

from .backend import AttentionBackend, register_backend


class TritonBackend(AttentionBackend):
    """Triton kernels over the shared paged KV layout; plans are cached on each PagedKVMeta."""

    name = "triton"

    def __init__(self, config: AttentionConfig = DEFAULT_CONFIG, deterministic: bool = False,
                 **options) -> None:  # fmt: skip
        """options: AttentionConfig fields to change from ``config``; deterministic: with
        ``attention_config.DETERMINISTIC``'s, which options may not contradict."""
        known = set(AttentionConfig.__dataclass_fields__)
        if set(options) - known:
            raise ValueError(f"unknown attention_options {sorted(set(options) - known)} "
                             f"(known: {sorted(known)})")
        if deterministic:  # any fixed chunk will do; the rest is DETERMINISTIC's
            fixed = {k: v for k, v in DETERMINISTIC.items() if k != "kv_chunk_pages"}
            clash = {k for k, v in options.items() if k in fixed and fixed[k] != v}
            if options.get("kv_chunk_pages", 1) is None:
                clash.add("kv_chunk_pages")
            if clash:
                raise ValueError(f"attention_options {sorted(clash)} contradict deterministic "
                                 f"attention ({ {k: DETERMINISTIC[k] for k in sorted(clash)} })")
            options = {"kv_chunk_pages": DETERMINISTIC["kv_chunk_pages"], **options, **fixed}
        self.deterministic = deterministic
        self.config = replace(config, **options) if options else config

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        store_kv(k, v, kv_cache, slot_mapping)

    def attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedKVMeta,
        scale: float,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return paged_attention(q, kv_cache, meta, scale, return_lse, self.config)

    def token_max_probs(
        self,
        q: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedKVMeta,
        scale: float,
        work: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """work: a device-planned work list (CUDA graphs; ``page_scores.token_max_probs``)."""
        return token_max_probs(q, lse, kv_cache, meta, scale, work)

    def page_scores(
        self,
        q: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedKVMeta,
        scale: float,
        work: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return page_scores(q, lse, kv_cache, meta, scale, work)

    def query_tile_tokens(self, group: int) -> int | None:
        return query_tile_tokens(self.config, group)


register_backend("triton", TritonBackend)

"""Ragged paged-KV metadata shared by every attention backend (flashinfer's layout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PagedKVMeta:
    """Which queries attend to which KV pages, for a batch of R ragged rows.

    Row r owns query tokens ``q[qo_indptr[r]:qo_indptr[r+1]]`` and the KV pages
    ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]`` (physical page ids, in order; any subset of the
    request's pages). The last listed page holds ``kv_last_page_len[r]`` valid tokens
    (1..page_size), every other listed page is full. Attention is causal aligned to the END of
    the row's KV: query i of n_q may see listed KV tokens j <= kv_len - n_q + i.

    qo_indptr:        int32 [R+1]
    kv_indptr:        int32 [R+1]
    kv_indices:       int32 [nnz_pages]
    kv_last_page_len: int32 [R]
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int
    # Host copies (python ints) so that backends and callers never sync on the device.
    qo_indptr_host: list[int] | None = None
    kv_indptr_host: list[int] | None = None
    kv_last_page_len_host: list[int] | None = None
    # CUDA graphs: a paged_attention.FixedPlan whose buffers hold this step's work lists (the
    # tensors above are then fixed buffers too, and the host copies are not needed).
    fixed_plan: Any = None

    @property
    def num_rows(self) -> int:
        return self.kv_last_page_len.shape[0]

    def kv_len_host(self, r: int) -> int:
        """Visible KV tokens of row r (uses the host copies)."""
        n_pages = self.kv_indptr_host[r + 1] - self.kv_indptr_host[r]
        return (n_pages - 1) * self.page_size + self.kv_last_page_len_host[r]

    @staticmethod
    def build(
        q_lens: list[int],
        page_lists: list[list[int]],
        kv_lens: list[int],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedKVMeta:
        """Build from per-row query lengths, page-id lists and visible KV lengths.

        ``kv_lens[r]`` counts the tokens in the listed pages (the last page may be partial).
        """
        qo, kvp, last, indices = [0], [0], [], []
        for n_q, pages, kv_len in zip(q_lens, page_lists, kv_lens, strict=True):
            if not pages:
                raise ValueError("every row must list at least one page")
            n_full = len(pages) - 1
            last_len = kv_len - n_full * page_size
            if not 1 <= last_len <= page_size:
                raise ValueError(
                    f"kv_len {kv_len} does not fit {len(pages)} pages of {page_size} tokens"
                )
            if n_q > kv_len:
                raise ValueError(f"row has {n_q} queries but only {kv_len} KV tokens")
            qo.append(qo[-1] + n_q)
            kvp.append(kvp[-1] + len(pages))
            last.append(last_len)
            indices.extend(pages)

        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32, device=device)

        return PagedKVMeta(
            qo_indptr=t(qo),
            kv_indptr=t(kvp),
            kv_indices=t(indices),
            kv_last_page_len=t(last),
            page_size=page_size,
            qo_indptr_host=qo,
            kv_indptr_host=kvp,
            kv_last_page_len_host=last,
        )

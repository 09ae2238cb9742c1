"""Rows of many queries (prefill chunks) through torch's SDPA: a flash kernel on a GPU.

The paged kernel (``paged_attention.py``) is shaped for decoding, which is memory-bound: a few
queries a row, each key read once for its GQA group's query heads, tiles of at most 64 query
heads. A prefill chunk of thousands of queries is compute-bound, and there a flash kernel's
large tiles over contiguous K/V do the same work several times faster. So such a row's K/V
are gathered from its pages (O(its KV), small beside the attention's O(queries x KV)), its
KV heads repeated to the query heads (every SDPA backend then takes it: flash in 16 bits,
memory-efficient in fp32, and no backend has to support GQA), and the row is attended with
the causal mask aligned to its last key: query i of n sees keys <= kv_len - n + i
(``causal_lower_right``; a chunk after earlier ones sees all their keys).

Which rows: ``AttentionConfig.prefill_sdpa`` and ``sdpa_min_queries``; the paged kernel's plan
then leaves them out (``AttentionConfig.skip_queries``) and ``sdpa_rows`` writes their output.
Shapes: q [T, Hq, D]; kv_cache [P, 2, ps, Hkv, D]; out [T, Hq, D], written in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .attention_config import AttentionConfig
from .metadata import PagedKVMeta


def sdpa_row_ids(q: torch.Tensor, meta: PagedKVMeta, config: AttentionConfig,
                 return_lse: bool) -> list[int]:  # fmt: skip
    """The rows of this call that SDPA attends (none with a fixed plan: CUDA graphs hold
    decode rows only; none when the call returns the log-sum-exp, which SDPA does not)."""
    on = config.prefill_sdpa == "on" or (config.prefill_sdpa == "auto" and q.is_cuda)
    if not on or return_lse or meta.fixed_plan is not None:
        return []
    # once per step, not per layer: cached on the metadata object, as the kernel's plans are
    cache = meta.__dict__.setdefault("_sdpa_rows", {})
    if config.sdpa_min_queries not in cache:
        qo = meta.qo_indptr_host
        cache[config.sdpa_min_queries] = [r for r in range(meta.num_rows)
                                          if qo[r + 1] - qo[r] >= config.sdpa_min_queries]
    return cache[config.sdpa_min_queries]


def sdpa_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: PagedKVMeta, scale: float,
              rows: list[int], out: torch.Tensor) -> None:  # fmt: skip
    """Attention of ``rows`` (their queries q[qo[r]:qo[r + 1]]) into the same rows of out."""
    hq, hkv = q.shape[1], kv_cache.shape[3]
    group = hq // hkv
    qo, kvp = meta.qo_indptr_host, meta.kv_indptr_host
    for r in rows:
        n, kv_len = qo[r + 1] - qo[r], meta.kv_len_host(r)
        pages = meta.kv_indices[kvp[r] : kvp[r + 1]].long()
        kv = kv_cache.index_select(0, pages)  # [pages, 2, ps, Hkv, D]
        # [Hq, kv_len, D]: the row's keys and values, each KV head repeated for its group
        k, v = (kv[:, i].flatten(0, 1)[:kv_len].transpose(0, 1).repeat_interleave(group, 0)
                for i in (0, 1))  # fmt: skip
        mask = None if n == kv_len else causal_lower_right(n, kv_len)
        o = F.scaled_dot_product_attention(q[qo[r] : qo[r + 1]].transpose(0, 1)[None],
                                           k[None], v[None], attn_mask=mask,
                                           is_causal=mask is None, scale=scale)  # fmt: skip
        out[qo[r] : qo[r + 1]] = o[0].transpose(0, 1)

"""Pure-torch references: the meaning of every kernel, and the CPU attention backend.

Shapes (T query tokens, Hq query heads, Hkv kv heads, D head dim, P pages, ps page size):
    q:        [T, Hq, D]
    kv_cache: [P, 2, ps, Hkv, D]   (index 0 = keys after RoPE, 1 = values; flashinfer NHD)
"""

from __future__ import annotations

import torch

from .metadata import PagedKVMeta

# Queries per block in the reference: bounds the [Hq, block, kv_len] score matrix on the CPU.
_Q_BLOCK = 256


def gather_row_kv(
    kv_cache: torch.Tensor, pages: torch.Tensor, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one row's listed pages, truncated to kv_len: each [kv_len, Hkv, D]."""
    kv = kv_cache[pages.long()]  # [n_pages, 2, ps, Hkv, D]
    k = kv[:, 0].flatten(0, 1)[:kv_len]
    v = kv[:, 1].flatten(0, 1)[:kv_len]
    return k, v


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention aligned to the end of k: q [n, Hq, D], k/v [L, Hkv, D] -> out, lse [n, Hq].

    Computed in float32; query i sees keys j <= L - n + i.
    """
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, hq, dtype=torch.float32, device=q.device)
    kf, vf = k.float(), v.float()
    for start in range(0, n, _Q_BLOCK):
        end = min(start + _Q_BLOCK, n)
        visible = length - n + end  # keys past this are masked for every query of the block
        qb = q[start:end].float().view(end - start, hkv, group, d)
        scores = torch.einsum("nhgd,lhd->hgnl", qb, kf[:visible]) * scale  # [Hkv, g, nb, Lb]
        q_idx = torch.arange(start, end, device=q.device)[:, None]
        k_idx = torch.arange(visible, device=q.device)[None, :]
        scores = scores.masked_fill(k_idx > length - n + q_idx, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, g, nb]
        probs = torch.exp(scores - block_lse[..., None])
        ob = torch.einsum("hgnl,lhd->nhgd", probs, vf[:visible]).reshape(end - start, hq, d)
        out[start:end] = ob.to(q.dtype)
        lse[start:end] = block_lse.permute(2, 0, 1).reshape(end - start, hq)
    return out, lse


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedKVMeta,
    scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Ragged paged attention, row by row. Returns out [T, Hq, D] (and lse [T, Hq] float32)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    qo, kvp = meta.qo_indptr_host, meta.kv_indptr_host
    for r in range(meta.num_rows):
        pages = meta.kv_indices[kvp[r] : kvp[r + 1]]
        k, v = gather_row_kv(kv_cache, pages, meta.kv_len_host(r))
        o, s = attention_ref(q[qo[r] : qo[r + 1]], k, v, scale)
        out[qo[r] : qo[r + 1]] = o
        lse[qo[r] : qo[r + 1]] = s
    return (out, lse) if return_lse else out


def token_max_probs_ref(
    q: torch.Tensor,
    lse: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedKVMeta,
    scale: float,
) -> torch.Tensor:
    """Per listed KV token, the attention probability maximised over this rank's query heads.

    One query per row: q [R, Hq, D], lse [R, Hq] (the log-sum-exp of that query's full
    attention, so the probabilities are exact softmax values). Returns float32
    [nnz_pages, page_size]: entry (p, u) = max_h exp(scale * q_h . k_u - lse_h) for token u of
    listed page p, and 0 for slots past the row's kv_len. Summing over the last dim gives the
    page score s(P) (after a cross-rank max under tensor parallelism).
    """
    nnz, ps = meta.kv_indices.shape[0], meta.page_size
    result = torch.zeros(nnz, ps, dtype=torch.float32, device=q.device)
    kvp = meta.kv_indptr_host
    hq = q.shape[1]
    for r in range(meta.num_rows):
        pages = meta.kv_indices[kvp[r] : kvp[r + 1]]
        kv_len = meta.kv_len_host(r)
        k, _ = gather_row_kv(kv_cache, pages, kv_len)  # [L, Hkv, D]
        group = hq // k.shape[1]
        k_per_q = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        logits = torch.einsum("hd,lhd->hl", q[r].float(), k_per_q) * scale
        probs = torch.exp(logits - lse[r].float()[:, None]).amax(dim=0)  # [L]
        flat = result[kvp[r] : kvp[r + 1]].view(-1)
        flat[:kv_len] = probs
    return result


def page_scores_ref(
    q: torch.Tensor, lse: torch.Tensor, kv_cache: torch.Tensor, meta: PagedKVMeta, scale: float
) -> torch.Tensor:
    """The page scores s(P) of one rank's heads: ``token_max_probs_ref`` summed over each
    listed page's tokens, float32 [nnz_pages]."""
    return token_max_probs_ref(q, lse, kv_cache, meta, scale).sum(dim=-1)


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k/v [T, Hkv, D] into kv_cache at slots (page_id * page_size + offset) [T] int64."""
    ps = kv_cache.shape[2]
    pages, offsets = slot_mapping // ps, slot_mapping % ps
    kv_cache[pages, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[pages, 1, offsets] = v.to(kv_cache.dtype)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim, op for op as transformers' LlamaRMSNorm (fp32 statistics,
    normalised value rounded to x's dtype before the weight). With ``residual``: residual += x
    in place first (rounded to its dtype), and the norm is taken of that sum."""
    if residual is not None:
        residual.add_(x)
        x = residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary_ref(
    positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] at positions [T] with float32 tables [P, D/2]; computed in
    float32, returned in x's dtype."""
    c = cos[positions].unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2I] -> silu(gate) * up with gate, up = x.chunk(2, -1)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def choose_top_pages_ref(template: torch.Tensor, pages: torch.Tensor, scores: torch.Tensor,
                         rows: torch.Tensor, has_scores: torch.Tensor, first: int,
                         max_candidates: int) -> torch.Tensor:  # fmt: skip
    """Fill the top-k middle of each listed row's sparse page list; returns a new kv_indices.

    template: int32 [nnz] (every other page in place); pages: int32 [slots, W] the page table;
    scores: float32 [slots + 1, S] page scores by slot; rows: int32 [4, R] per row: slot,
    candidate count, n_top, offset of the middle in ``template``; has_scores: bool [R] (rows
    never scored rank their candidates by index); first: logical index of the first candidate
    page; max_candidates: max over rows of the candidate count (a host int, so no sync).
    The chosen pages are the n_top first of a stable descending sort of the scores (ties to
    the lower page), missing scores 0, written in ascending page order."""
    slot, n_cand, n_top, dst = rows.long().unbind(0)
    col = torch.arange(max_candidates, device=template.device)
    vals = scores.index_select(0, slot)[:, first : first + max_candidates]
    vals = torch.where(has_scores[:, None], vals, col.float()[None, :])
    vals = vals.masked_fill(col[None, :] >= n_cand[:, None], float("-inf"))
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices
    rank_ok = (col[None, :] < n_top[:, None]).expand_as(order)
    chosen = torch.zeros_like(rank_ok).scatter_(1, order, rank_ok)
    pos = chosen.long().cumsum(1) - 1  # ascending page order within the middle
    phys = pages[slot[:, None], (first + col).clamp_(max=pages.shape[1] - 1)[None, :]]
    nnz = template.shape[0]
    dest = torch.where(chosen, dst[:, None] + pos, nnz)  # unchosen: a dummy slot past the end
    out = torch.cat([template, template.new_zeros(1)])
    out.scatter_(0, dest.flatten(), phys.flatten())
    return out[:nnz]


def gather_lists_ref(table: torch.Tensor, counts: torch.Tensor, logical: torch.Tensor,
                     row_slot: torch.Tensor, capacity: int) -> tuple[torch.Tensor,
                                                                     torch.Tensor]:  # fmt: skip
    """Row r lists the pages logical[r, :counts[r]] (at most L = logical's columns) of
    page-table row row_slot[r] (table: int32 [slots, W]; columns clamped into it) ->
    (kv_indptr int32 [R + 1] from the counts, kv_indices int32 [capacity], 0 past
    kv_indptr[R])."""
    r = counts.shape[0]
    indptr = torch.zeros(r + 1, dtype=torch.long, device=counts.device)
    indptr[1:] = torch.cumsum(counts, 0)
    j = torch.arange(logical.shape[1], device=counts.device)[None, :]
    phys = table[row_slot[:, None], logical.clamp(0, table.shape[1] - 1)]
    dest = torch.where(j < counts[:, None], indptr[:-1, None] + j, capacity)
    indices = torch.zeros(capacity + 1, dtype=torch.int32, device=counts.device)
    indices.scatter_(0, dest.flatten(), phys.flatten())
    return indptr.int(), indices[:capacity]

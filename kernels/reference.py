"""Pure-torch references: the meaning of every kernel, and the CPU attention backend.

Shapes (T query tokens, Hq query heads, Hkv kv heads, D head dim, P pages, ps page size):
    q:        [T, Hq, D]
    kv_cache: [P, 2, ps, Hkv, D]   (index 0 = keys after RoPE, 1 = values; flashinfer NHD)
"""

from __future__ import annotations

import torch

from .device_plan import score_items
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
    per_query: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Ragged paged attention, row by row. Returns out [T, Hq, D] (and lse [T, Hq] float32).

    per_query: each query over exactly the keys it sees, one at a time (the deterministic mode:
    a query's output is then the same bits whatever its row's query count and the other rows;
    a block of queries under a causal mask rounds otherwise than one query)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    qo, kvp = meta.qo_indptr_host, meta.kv_indptr_host
    for r in range(meta.num_rows):
        pages = meta.kv_indices[kvp[r] : kvp[r + 1]]
        kv_len = meta.kv_len_host(r)
        k, v = gather_row_kv(kv_cache, pages, kv_len)
        if not per_query:
            o, s = attention_ref(q[qo[r] : qo[r + 1]], k, v, scale)
            out[qo[r] : qo[r + 1]] = o
            lse[qo[r] : qo[r + 1]] = s
            continue
        n = qo[r + 1] - qo[r]
        for i in range(n):  # query i sees keys [0, kv_len - n + i]
            seen = kv_len - n + i + 1
            t = qo[r] + i
            out[t : t + 1], lse[t : t + 1] = attention_ref(q[t : t + 1], k[:seen], v[:seen], scale)
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


def mlp_partials_ref(x: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor,
                     block_i: int) -> torch.Tensor:  # fmt: skip
    """``mlp_partials``' meaning: x [M, H], w_gu [2I, H], w_d [H, I] -> float32 [S, M, H], slice
    s = a[:, s*block_i : (s+1)*block_i] @ w_d[:, same]^T in float32, where a = silu(gate) * up
    with gate and up rounded to x's dtype, silu rounded, the product rounded (gate_up_silu)."""
    dt = x.dtype
    gate_up = (x.float() @ w_gu.float().t()).to(dt).float()
    gate, up = gate_up.chunk(2, dim=-1)
    a = (torch.nn.functional.silu(gate).to(dt).float() * up).to(dt).float()
    slices = a.split(block_i, dim=1)
    return torch.stack([part @ w.float().t() for part, w in
                        zip(slices, w_d.split(block_i, dim=1), strict=True)])  # fmt: skip


def rms_norm_parts_ref(parts: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``rms_norm_parts``' meaning: the partials summed in slice order (float32), rounded to
    residual's dtype, then ``rms_norm_ref`` with the residual add (residual updated)."""
    total = torch.zeros_like(parts[0])
    for part in parts:
        total += part
    return rms_norm_ref(total.to(residual.dtype), weight, eps, residual)


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


def plan_rows_ref(state: dict[str, torch.Tensor], chain: torch.Tensor, table: torch.Tensor,
                  layout: torch.Tensor, page_size: int, tokens: int, inputs: torch.Tensor,
                  sparse_capacity: int, full_capacity: int = 0, queries: int = 0,
                  verify_all: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """A self-planning graph step's rows: their query tokens and every page list, from a few
    numbers per row (``kernels/row_plan.py`` is one launch of this).

    state: int64 [n] each: ``slot`` (page-table row), ``flags`` (bit 1: a real row), ``x_id``
    and ``x_pos`` (the last committed token, whose KV is not written yet, and its position),
    and for ragged rows (queries 0) ``held`` (drafts held) and ``gamma`` (the draft length:
    a row holding that many verifies). chain: int64 [D, n], row r's drafts chain[:held, r].
    table: int32 [slots, W] the page table; layout: int32 [3, W + 1], the draft page policy's
    (head_end, n_top, tail_start) by page count (``PageSelector.layout``).

    A verify row's queries are [x_n, d_1 .. d_held] at x_pos .. x_pos + held and it lists
    every page; a draft row's one query is its last draft (x_n if none) at x_pos + held, and it
    lists the policy's pages: [0, head_end), n_top placeholders for the top-k middle (pages
    min(j, P - 1), chosen later from scores), [tail_start, P). Either way the row's last query
    sees end = x_pos + held + 1 tokens. With ``queries`` = q every row has q queries (padding
    rows too, none of whose tokens write KV), held = q - 1, and ``verify_all`` says whether the
    rows verify; else rows of no flag hold no query and no page.

    Writes inputs[:, :tokens] (int64 [3, >= tokens]: token ids, positions, KV slots; -1 and 0
    for tokens no row holds) and returns: qo int32 [n + 1]; rows int64 [6, n] (queries, pages,
    end, verify, row_slot, live); last int32 [n] (tokens on the last page); indptr int32
    [n + 1] and indices int32 [sparse_capacity] (the policy's lists, 0 past them); choose int32
    [4, n] (``choose_top_pages``' rows: slot, candidates, n_top, where the middle starts); with
    full_capacity, full_indptr and full_indices (every page of every row)."""
    slot, flags, x_id, x_pos = (state[k] for k in ("slot", "flags", "x_id", "x_pos"))
    n, dev, ps, width = slot.shape[0], slot.device, page_size, table.shape[1]
    live = (flags & 1) > 0
    if queries:
        held = torch.full_like(x_pos, queries - 1)
        verify = torch.full_like(live, verify_all)
        n_q = torch.full_like(x_pos, queries)
    else:
        held = state["held"]
        verify = live & (held >= state["gamma"])
        n_q = torch.where(verify, held + 1, live.long())
    qo = torch.zeros(n + 1, dtype=torch.long, device=dev)
    qo[1:] = torch.cumsum(n_q, 0)
    row_slot = torch.where(live, slot, 0)

    # tokens: row r's queries are qo[r] .. qo[r + 1] - 1
    e = torch.arange(tokens, device=dev)
    row = torch.searchsorted(qo[1:], e, right=True).clamp(max=n - 1)
    local = e - qo[row]
    real = e < qo[-1]
    drafts = chain.shape[0]
    held_tok = chain[(local - 1).clamp(0, drafts - 1), row]
    last_draft = chain[(held - 1).clamp(0, drafts - 1), torch.arange(n, device=dev)]
    draft_in = torch.where(held > 0, last_draft, x_id)
    ids = torch.where(verify[row], torch.where(local == 0, x_id[row], held_tok), draft_in[row])
    pos = x_pos[row] + torch.where(verify[row], local, held[row])
    block = (pos // ps).clamp(0, width - 1)
    kv_slot = table[row_slot[row], block].long() * ps + pos % ps
    kv_slot = torch.where(real & live[row], kv_slot, -1)
    inputs[:, :tokens].copy_(torch.stack([torch.where(real, ids, 0), torch.where(real, pos, 0),
                                          kv_slot]))  # fmt: skip

    # page lists
    end = x_pos + held + 1
    pages = torch.where(live, (end + ps - 1) // ps, 0)
    last = torch.where(live, end - (pages - 1) * ps, 1).int()
    head_end, n_top, tail_start = layout.long()[:, pages.clamp(0, width)]
    head_end = torch.where(verify, pages, head_end)
    n_top = torch.where(verify, 0, n_top)
    tail_start = torch.where(verify, pages, tail_start)
    counts = head_end + n_top + (pages - tail_start)
    j = torch.arange(width, device=dev)[None, :]
    middle_end = (head_end + n_top)[:, None]
    logical = torch.where(j >= middle_end, j - middle_end + tail_start[:, None],
                          torch.minimum(j, (pages - 1).clamp(min=0)[:, None]))  # fmt: skip
    indptr, indices = gather_lists_ref(table, counts, logical, row_slot, sparse_capacity)
    out = {
        "qo": qo.int(), "last": last, "indptr": indptr, "indices": indices,
        "rows": torch.stack([n_q, pages, end, verify.long(), row_slot, live.long()]),
        "choose": torch.stack([row_slot, tail_start - head_end, n_top,
                               indptr[:-1].long() + head_end]).int(),
    }  # fmt: skip
    if full_capacity:
        out["full_indptr"], out["full_indices"] = gather_lists_ref(
            table, pages, j.expand(n, -1), row_slot, full_capacity)
    return out


def accept_rows_ref(argmax: torch.Tensor, tokens: torch.Tensor, qo: torch.Tensor,
                    rows: torch.Tensor, x_id: torch.Tensor, x_pos: torch.Tensor,
                    start_pos: torch.Tensor, chain: torch.Tensor,
                    held: torch.Tensor | None = None) -> None:  # fmt: skip
    """Greedy acceptance of a planned step's rows (``plan_rows_ref``'s qo and rows), in place.

    argmax, tokens: int64 [t], the target's argmax at each query token and the token itself.
    A live verify row accepts a = the longest prefix of its drafts (tokens 1..) equal to the
    argmax before them; then x_id = argmax at its query a, x_pos = start_pos + a + 1 and (with
    held) no draft held. A draft row (held given: asynchronous rows) appends the argmax at its
    query to its drafts, chain[held, r], and holds one more. Other rows keep their numbers.
    x_id, x_pos, start_pos, held: int64 [n]; chain: int64 [D, n]."""
    n, t, max_q = x_id.shape[0], argmax.shape[0], chain.shape[0] + 1
    n_q, verify, live = rows[0], rows[3] > 0, rows[5] > 0
    verify = verify & live
    start = qo[:-1].long()
    k = torch.arange(max_q, device=argmax.device)
    idx = (start[:, None] + k[None, :]).clamp(max=t - 1)  # [n, max_q] a row's tokens
    match = (argmax[idx[:, :-1]] == tokens[idx[:, 1:]]) & (k[None, :-1] < n_q[:, None] - 1)
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    bonus = argmax[idx.gather(1, accepted[:, None])[:, 0]]
    if held is not None:
        draft = live & ~verify
        cols = torch.arange(n, device=argmax.device)
        d_at = held.clamp(max=chain.shape[0] - 1)
        chain[d_at, cols] = torch.where(draft, argmax[start.clamp(max=t - 1)], chain[d_at, cols])
        held.copy_(torch.where(verify, 0, held + draft.long()))
    x_id.copy_(torch.where(verify, bonus, x_id))
    x_pos.copy_(torch.where(verify, start_pos + accepted + 1, x_pos))


def score_lists_ref(first: torch.Tensor | None, last: torch.Tensor | None,
                    seen_first: torch.Tensor, seen_last: torch.Tensor, live: torch.Tensor,
                    single: torch.Tensor | None, row_slot: torch.Tensor, table: torch.Tensor,
                    page_size: int, capacity: int, per_item: int,
                    item_capacity: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """The refresh layer's scoring queries of n rows and their page lists (DESIGN.md §1.2: a
    row is scored from its first and last query; ``kernels/row_plan.py`` is one launch of this).

    Query 2r + k (k = 0: row r's first query, token first[r], seeing seen_first[r] KV tokens;
    k = 1: its last, token last[r], seeing seen_last[r]) lists the pages it sees of page-table
    row row_slot[r]. A row that is not ``live`` lists none, nor does the second query of a
    ``single`` row (a row of one query: draft rows read the KV once). first = last = None: row
    r's one query is token r (every row single). first, last, seen_*, row_slot: int64 [n];
    live, single: bool [n]; table: int32 [slots, W].

    -> which int64 [2n] (each query's token), pages int64 [2n], and the scoring kernel's
    metadata and work: qo int32 [2n + 1] (one query a row), indptr int32 [2n + 1], indices
    int32 [capacity] (0 past the lists), last int32 [2n], work int32 [2, item_capacity] (row,
    first listed token, per ``per_item`` tokens of each list; ``device_plan.score_items``)
    and count int32 [1] (work past it is not read)."""
    n, dev, ps = live.shape[0], live.device, page_size
    if first is None:
        first = last = torch.arange(n, device=dev)
        single = torch.ones_like(live)
    which = torch.stack([first, last], dim=1).flatten()
    seen = torch.stack([seen_first, seen_last], dim=1).flatten()
    live2 = live.repeat_interleave(2)
    if single is not None:  # a single row's second query: no page, no work
        live2 = live2 & ~torch.stack([torch.zeros_like(single), single], dim=1).flatten()
    pages = torch.where(live2, (seen + ps - 1) // ps, 0)
    last_len = torch.where(live2, seen - (pages - 1) * ps, 1).int()
    j = torch.arange(table.shape[1], device=dev)[None, :]
    indptr, indices = gather_lists_ref(table, pages, j.expand(2 * n, -1),
                                       row_slot.repeat_interleave(2), capacity)  # fmt: skip
    work, count = score_items(indptr, ps, per_item, item_capacity)
    return {"which": which, "pages": pages, "last": last_len, "indptr": indptr,
            "indices": indices, "qo": torch.arange(2 * n + 1, dtype=torch.int32, device=dev),
            "work": work.int(), "count": count.int()}  # fmt: skip


def store_row_scores_ref(page_scores: torch.Tensor, indptr: torch.Tensor, pages: torch.Tensor,
                         live: torch.Tensor, single: torch.Tensor | bool | None,
                         slot: torch.Tensor, scores: torch.Tensor) -> None:  # fmt: skip
    """Each live row's page scores replace its slot's row of the score table (float32
    [slots + 1, S]; padding rows write the last row, a scratch row): per page, the mean of its
    two scoring queries' scores (``score_lists_ref``; sum, then divide), or its first query's
    alone where ``single`` (a bool [n]; True: every row; None: no row); 0 past a query's pages.
    page_scores: float32 [>= indptr[-1]] per listed page (``page_scores``); indptr int32
    [2n + 1] and pages int64 [2n] (``score_lists_ref``); live bool [n]; slot int64 [n]."""
    n, width = live.shape[0], scores.shape[1]
    j = torch.arange(width, device=live.device)[None, :]
    at = (indptr[:-1, None].long() + j).clamp(max=page_scores.shape[0] - 1)
    per_query = torch.where(j < pages[:, None], page_scores[at], 0.0).view(n, 2, -1)
    rows = (per_query[:, 0] + per_query[:, 1]) / 2.0  # sum, then divide: as the host
    if single is True:
        rows = per_query[:, 0]
    elif single is not None:
        rows = torch.where(single[:, None], per_query[:, 0], rows)
    scores.index_copy_(0, torch.where(live, slot, scores.shape[0] - 1), rows)

"""Triton row planning: a self-planning graph step's query tokens and page lists in one launch.

Meaning: ``reference.plan_rows_ref`` (it says what each output is). The draft-step, verify and
asynchronous-run graphs (``worker/draft_graphs.py``, ``verify_graphs.py``, ``async_graphs.py``)
derive their step from a few numbers per row on the device; in tensor ops that was ~60-90
small kernels a step (~1.5 us each on an H200, most of a draft step's planning), here one.

One program per row. Each reads the numbers of every row (a batch: a few hundred at most) for
its offsets (queries and pages of the rows before it), then writes its own: its tokens, its
metadata, its sparse (policy) list and, with FULL, its full list. The last program also pads
the tokens past the last row's.

The same file holds the step's other row-wise glue, one launch each: ``accept_rows`` (the
greedy acceptance after the step, ``reference.accept_rows_ref``), ``score_lists`` (the refresh
layer's scoring queries and their page lists and work, ``score_lists_ref``) and
``store_row_scores`` (their averaged scores into the score table, ``store_row_scores_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_numbers(i, ok, slot_ptr, flags_ptr, held_ptr, gamma_ptr, x_pos_ptr, layout_ptr,
                 layout_stride, width, PAGE_SIZE: tl.constexpr, QUERIES: tl.constexpr,
                 VERIFY_ALL: tl.constexpr):  # fmt: skip
    """Rows i (masked by ok): live, verify, held, queries, pages, head_end, n_top, tail_start."""
    live = (tl.load(flags_ptr + i, mask=ok, other=0) & 1) != 0
    x_pos = tl.load(x_pos_ptr + i, mask=ok, other=0)
    if QUERIES > 0:
        held = tl.zeros_like(x_pos) + (QUERIES - 1)
        verify = (tl.zeros_like(x_pos) + VERIFY_ALL) != 0
        n_q = tl.where(ok, tl.zeros_like(x_pos) + QUERIES, 0)
    else:
        held = tl.load(held_ptr + i, mask=ok, other=0)
        verify = live & (held >= tl.load(gamma_ptr + i, mask=ok, other=0))
        n_q = tl.where(verify, held + 1, live.to(tl.int64))
    end = x_pos + held + 1
    pages = tl.where(live, (end + PAGE_SIZE - 1) // PAGE_SIZE, 0)
    at = tl.minimum(tl.maximum(pages, 0), width)
    head_end = tl.load(layout_ptr + at, mask=ok, other=0).to(tl.int64)
    n_top = tl.load(layout_ptr + layout_stride + at, mask=ok, other=0).to(tl.int64)
    tail_start = tl.load(layout_ptr + 2 * layout_stride + at, mask=ok, other=0).to(tl.int64)
    head_end = tl.where(verify, pages, head_end)
    n_top = tl.where(verify, 0, n_top)
    tail_start = tl.where(verify, pages, tail_start)
    return live, verify, held, n_q, x_pos, end, pages, head_end, n_top, tail_start


@triton.jit
def _pick(x, i, r):
    """Row r's entry of a per-row vector."""
    return tl.sum(tl.where(i == r, x, 0), axis=0)


@triton.jit(do_not_specialize=["n", "tokens", "width"])
def _plan_rows_kernel(
    slot_ptr, flags_ptr, held_ptr, gamma_ptr, x_id_ptr, x_pos_ptr, chain_ptr, chain_stride,
    drafts, table_ptr, table_stride, width, layout_ptr, layout_stride,
    inputs_ptr, inputs_stride, tokens, qo_ptr, rows_ptr, last_ptr, indptr_ptr, indices_ptr,
    capacity, choose_ptr, full_indptr_ptr, full_indices_ptr, full_capacity, n,
    PAGE_SIZE: tl.constexpr, QUERIES: tl.constexpr, VERIFY_ALL: tl.constexpr,
    FULL: tl.constexpr, R_BLOCK: tl.constexpr, Q_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    i = tl.arange(0, R_BLOCK)
    ok = i < n
    live, verify, held, n_q, x_pos, end, pages, head_end, n_top, tail_start = _row_numbers(
        i, ok, slot_ptr, flags_ptr, held_ptr, gamma_ptr, x_pos_ptr, layout_ptr, layout_stride,
        width, PAGE_SIZE, QUERIES, VERIFY_ALL)
    counts = head_end + n_top + (pages - tail_start)
    before = ok & (i < r)
    q_start = tl.sum(tl.where(before, n_q, 0), axis=0)
    l_start = tl.sum(tl.where(before, counts, 0), axis=0)
    f_start = tl.sum(tl.where(before, pages, 0), axis=0)
    if r == 0:
        tl.store(qo_ptr, 0)
        tl.store(indptr_ptr, 0)
        if FULL:
            tl.store(full_indptr_ptr, 0)

    # row r's numbers
    r_live = _pick(live.to(tl.int64), i, r)
    r_verify = _pick(verify.to(tl.int64), i, r)
    r_held, r_q = _pick(held, i, r), _pick(n_q, i, r)
    r_pos, r_end, r_pages = _pick(x_pos, i, r), _pick(end, i, r), _pick(pages, i, r)
    r_head, r_top, r_tail = _pick(head_end, i, r), _pick(n_top, i, r), _pick(tail_start, i, r)
    r_count = _pick(counts, i, r)
    r_slot = tl.where(r_live != 0, tl.load(slot_ptr + r), 0)
    tl.store(qo_ptr + r + 1, (q_start + r_q).to(tl.int32))
    tl.store(indptr_ptr + r + 1, (l_start + r_count).to(tl.int32))
    tl.store(last_ptr + r, tl.where(r_live != 0, r_end - (r_pages - 1) * PAGE_SIZE, 1)
             .to(tl.int32))  # fmt: skip
    tl.store(rows_ptr + r, r_q)
    tl.store(rows_ptr + n + r, r_pages)
    tl.store(rows_ptr + 2 * n + r, r_end)
    tl.store(rows_ptr + 3 * n + r, r_verify)
    tl.store(rows_ptr + 4 * n + r, r_slot)
    tl.store(rows_ptr + 5 * n + r, r_live)
    tl.store(choose_ptr + r, r_slot.to(tl.int32))
    tl.store(choose_ptr + n + r, (r_tail - r_head).to(tl.int32))
    tl.store(choose_ptr + 2 * n + r, r_top.to(tl.int32))
    tl.store(choose_ptr + 3 * n + r, (l_start + r_head).to(tl.int32))

    # row r's query tokens
    k = tl.arange(0, Q_BLOCK)
    k_ok = k < r_q
    x_id = tl.load(x_id_ptr + r)
    held_tok = tl.load(chain_ptr + tl.minimum(tl.maximum(k - 1, 0), drafts - 1) * chain_stride
                       + r, mask=k_ok, other=0)  # fmt: skip
    last_draft = tl.load(chain_ptr + tl.minimum(tl.maximum(r_held - 1, 0), drafts - 1)
                         * chain_stride + r)  # fmt: skip
    draft_in = tl.where(r_held > 0, last_draft, x_id)
    ids = tl.where(r_verify != 0, tl.where(k == 0, x_id, held_tok), draft_in)
    pos = r_pos + tl.where(r_verify != 0, k, r_held)
    block = tl.minimum(tl.maximum(pos // PAGE_SIZE, 0), width - 1)
    phys = tl.load(table_ptr + r_slot * table_stride + block, mask=k_ok, other=0).to(tl.int64)
    kv_slot = tl.where(r_live != 0, phys * PAGE_SIZE + pos % PAGE_SIZE, -1)
    at = q_start + k
    k_ok = k_ok & (at < tokens)  # queries past the token bucket are dropped, as the reference's
    tl.store(inputs_ptr + at, ids, mask=k_ok)
    tl.store(inputs_ptr + inputs_stride + at, pos, mask=k_ok)
    tl.store(inputs_ptr + 2 * inputs_stride + at, kv_slot, mask=k_ok)
    if r == n - 1:  # the tokens no row holds
        total = q_start + r_q
        for e0 in range(total, tokens, BLOCK):
            e = e0 + tl.arange(0, BLOCK)
            e_ok = e < tokens
            zero = tl.zeros([BLOCK], tl.int64)
            tl.store(inputs_ptr + e, zero, mask=e_ok)
            tl.store(inputs_ptr + inputs_stride + e, zero, mask=e_ok)
            tl.store(inputs_ptr + 2 * inputs_stride + e, zero - 1, mask=e_ok)

    # row r's lists: [0, head_end), the middle's placeholders, [tail_start, pages)
    middle_end = r_head + r_top
    row_ptr = table_ptr + r_slot * table_stride
    for j0 in range(0, r_count, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        j_ok = j < r_count
        col = tl.where(j >= middle_end, j - middle_end + r_tail,
                       tl.minimum(j, tl.maximum(r_pages - 1, 0)))  # fmt: skip
        col = tl.minimum(tl.maximum(col, 0), width - 1)
        page = tl.load(row_ptr + col, mask=j_ok, other=0)
        tl.store(indices_ptr + l_start + j, page, mask=j_ok & (l_start + j < capacity))
    if FULL:
        tl.store(full_indptr_ptr + r + 1, (f_start + r_pages).to(tl.int32))
        for j0 in range(0, r_pages, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            j_ok = j < r_pages
            page = tl.load(row_ptr + tl.minimum(j, width - 1), mask=j_ok, other=0)
            tl.store(full_indices_ptr + f_start + j, page,
                     mask=j_ok & (f_start + j < full_capacity))  # fmt: skip


def plan_rows(state: dict[str, torch.Tensor], chain: torch.Tensor, table: torch.Tensor,
              layout: torch.Tensor, page_size: int, tokens: int, inputs: torch.Tensor,
              sparse_capacity: int, full_capacity: int = 0, queries: int = 0,
              verify_all: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """``reference.plan_rows_ref`` in one launch (and the lists' zero fill)."""
    slot = state["slot"]
    n, dev = slot.shape[0], slot.device
    if table.dtype != torch.int32 or table.stride(1) != 1 or layout.dtype != torch.int32:
        raise ValueError(f"table and layout must be int32 (table rows contiguous), got "
                         f"{table.dtype} {table.stride()} and {layout.dtype}")  # fmt: skip
    if layout.shape != (3, table.shape[1] + 1) or layout.stride(1) != 1:
        raise ValueError(f"layout must be [3, {table.shape[1] + 1}] with contiguous rows, got "
                         f"{tuple(layout.shape)}")  # fmt: skip
    if inputs.dtype != torch.int64 or inputs.stride(1) != 1 or inputs.shape[1] < tokens:
        raise ValueError(f"inputs must be int64 [3, >= {tokens}], got {inputs.dtype} "
                         f"{tuple(inputs.shape)}")  # fmt: skip
    fields = ["slot", "flags", "x_id", "x_pos"] + ([] if queries else ["held", "gamma"])
    for name in fields:
        t = state[name]
        if t.dtype != torch.int64 or t.shape != (n,) or t.stride(0) != 1:
            raise ValueError(f"state[{name!r}] must be contiguous int64 [{n}], got {t.dtype} "
                             f"{tuple(t.shape)}")  # fmt: skip
    if chain.dtype != torch.int64 or chain.dim() != 2 or chain.shape[1] != n \
            or chain.stride(1) != 1:  # fmt: skip
        raise ValueError(f"chain must be int64 [D, {n}] with contiguous rows, got "
                         f"{chain.dtype} {tuple(chain.shape)}")  # fmt: skip
    i32 = dict(dtype=torch.int32, device=dev)
    out = {
        "qo": torch.empty(n + 1, **i32), "last": torch.empty(n, **i32),
        "indptr": torch.empty(n + 1, **i32), "indices": torch.zeros(sparse_capacity, **i32),
        "rows": torch.empty(6, n, dtype=torch.int64, device=dev),
        "choose": torch.empty(4, n, **i32),
    }  # fmt: skip
    if full_capacity:
        out["full_indptr"] = torch.empty(n + 1, **i32)
        out["full_indices"] = torch.zeros(full_capacity, **i32)
    full_indptr, full_indices = out.get("full_indptr", out["indptr"]), out.get("full_indices",
                                                                               out["indices"])
    held, gamma = (state["x_pos"], state["x_pos"]) if queries else (state["held"], state["gamma"])
    block = max(16, min(1024, triton.next_power_of_2(max(1, table.shape[1]))))
    _plan_rows_kernel[(n,)](
        slot, state["flags"], held, gamma, state["x_id"], state["x_pos"], chain,
        chain.stride(0), chain.shape[0], table, table.stride(0), table.shape[1], layout,
        layout.stride(0), inputs, inputs.stride(0), tokens, out["qo"], out["rows"],
        out["last"], out["indptr"], out["indices"], sparse_capacity, out["choose"],
        full_indptr, full_indices, full_capacity, n, PAGE_SIZE=page_size, QUERIES=queries,
        VERIFY_ALL=int(verify_all), FULL=bool(full_capacity),
        R_BLOCK=max(16, triton.next_power_of_2(n)),
        Q_BLOCK=max(16, triton.next_power_of_2(max(queries, chain.shape[0] + 1))),
        BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["n", "tokens"])
def _accept_rows_kernel(
    argmax_ptr, tokens_ptr, qo_ptr, rows_ptr, x_id_ptr, x_pos_ptr, start_pos_ptr, chain_ptr,
    chain_stride, drafts, held_ptr, n, tokens, HAS_HELD: tl.constexpr, MAX_Q: tl.constexpr,
    R_BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, R_BLOCK)
    ok = i < n
    n_q = tl.load(rows_ptr + i, mask=ok, other=0)
    live = tl.load(rows_ptr + 5 * n + i, mask=ok, other=0) != 0
    verify = live & (tl.load(rows_ptr + 3 * n + i, mask=ok, other=0) != 0)
    start = tl.load(qo_ptr + i, mask=ok, other=0).to(tl.int64)
    accepted = tl.zeros([R_BLOCK], tl.int64)
    still = verify
    for k in tl.static_range(MAX_Q - 1):
        still = still & (k < n_q - 1)
        guess = tl.load(argmax_ptr + tl.minimum(start + k, tokens - 1), mask=still, other=0)
        token = tl.load(tokens_ptr + tl.minimum(start + k + 1, tokens - 1), mask=still, other=0)
        still = still & (guess == token)
        accepted += still.to(tl.int64)
    bonus = tl.load(argmax_ptr + tl.minimum(start + accepted, tokens - 1), mask=verify, other=0)
    if HAS_HELD:
        held = tl.load(held_ptr + i, mask=ok, other=0)
        draft = live & ~verify
        first = tl.load(argmax_ptr + tl.minimum(start, tokens - 1), mask=draft, other=0)
        d_at = tl.minimum(held, drafts - 1)
        tl.store(chain_ptr + d_at * chain_stride + i, first, mask=draft)
        tl.store(held_ptr + i, tl.where(verify, 0, held + draft.to(tl.int64)), mask=ok)
    tl.store(x_id_ptr + i, bonus, mask=verify)
    start_pos = tl.load(start_pos_ptr + i, mask=verify, other=0)
    tl.store(x_pos_ptr + i, start_pos + accepted + 1, mask=verify)


def accept_rows(argmax: torch.Tensor, tokens: torch.Tensor, qo: torch.Tensor,
                rows: torch.Tensor, x_id: torch.Tensor, x_pos: torch.Tensor,
                start_pos: torch.Tensor, chain: torch.Tensor,
                held: torch.Tensor | None = None) -> None:  # fmt: skip
    """``reference.accept_rows_ref`` in one launch (one program: the rows are a batch)."""
    n = x_id.shape[0]
    for name, t in (("x_id", x_id), ("x_pos", x_pos), ("start_pos", start_pos),
                    ("held", held if held is not None else x_id)):  # fmt: skip
        if t.dtype != torch.int64 or t.shape != (n,) or t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous int64 [{n}], got {t.dtype} "
                             f"{tuple(t.shape)}")  # fmt: skip
    if rows.shape != (6, n) or not rows.is_contiguous() or chain.stride(1) != 1:
        raise ValueError(f"rows must be contiguous [6, {n}] and chain [D, {n}] with contiguous "
                         f"rows, got {tuple(rows.shape)} and {tuple(chain.shape)}")  # fmt: skip
    _accept_rows_kernel[(1,)](
        argmax, tokens, qo, rows, x_id, x_pos, start_pos, chain, chain.stride(0),
        chain.shape[0], held if held is not None else x_id, n, argmax.shape[0],
        HAS_HELD=held is not None, MAX_Q=chain.shape[0] + 1,
        R_BLOCK=max(16, triton.next_power_of_2(n)), num_warps=4,
    )  # fmt: skip


@triton.jit(do_not_specialize=["n", "width", "capacity", "item_capacity"])
def _score_lists_kernel(
    first_ptr, last_ptr, seen_first_ptr, seen_last_ptr, live_ptr, single_ptr, row_slot_ptr,
    table_ptr, table_stride, width, which_ptr, pages_ptr, last_len_ptr, qo_ptr, indptr_ptr,
    indices_ptr, capacity, work_ptr, count_ptr, item_capacity, n,
    PAGE_SIZE: tl.constexpr, PER_ITEM: tl.constexpr, IDENTITY: tl.constexpr,
    HAS_SINGLE: tl.constexpr, V_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    v = tl.program_id(0)  # query 2r + k of row r
    u = tl.arange(0, V_BLOCK)
    u_ok = u < 2 * n
    row, second = u // 2, (u % 2) == 1
    seen = tl.where(second, tl.load(seen_last_ptr + row, mask=u_ok, other=0),
                    tl.load(seen_first_ptr + row, mask=u_ok, other=0))  # fmt: skip
    live = tl.load(live_ptr + row, mask=u_ok, other=0) != 0
    if IDENTITY:  # one query a row: every second query lists nothing
        live = live & ~second
    elif HAS_SINGLE:
        live = live & ~(second & (tl.load(single_ptr + row, mask=u_ok, other=0) != 0))
    pages = tl.where(live, (seen + PAGE_SIZE - 1) // PAGE_SIZE, 0)
    items = (pages * PAGE_SIZE + PER_ITEM - 1) // PER_ITEM
    before = u_ok & (u < v)
    l_start = tl.sum(tl.where(before, pages, 0), axis=0)
    i_start = tl.sum(tl.where(before, items, 0), axis=0)
    v_pages, v_items = _pick(pages, u, v), _pick(items, u, v)
    v_seen, v_live = _pick(seen, u, v), _pick(live.to(tl.int64), u, v)
    r, k = v // 2, v % 2
    if IDENTITY:
        token = r.to(tl.int64)
    else:
        token = tl.where(k == 1, tl.load(last_ptr + r), tl.load(first_ptr + r))
    if v == 0:
        tl.store(qo_ptr, 0)
        tl.store(indptr_ptr, 0)
    tl.store(which_ptr + v, token)
    tl.store(pages_ptr + v, v_pages)
    tl.store(last_len_ptr + v, tl.where(v_live != 0, v_seen - (v_pages - 1) * PAGE_SIZE, 1)
             .to(tl.int32))  # fmt: skip
    tl.store(qo_ptr + v + 1, v + 1)
    tl.store(indptr_ptr + v + 1, (l_start + v_pages).to(tl.int32))
    slot = tl.load(row_slot_ptr + r)
    for j0 in range(0, v_pages, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        j_ok = j < v_pages
        page = tl.load(table_ptr + slot * table_stride + tl.minimum(j, width - 1), mask=j_ok,
                       other=0)  # fmt: skip
        tl.store(indices_ptr + l_start + j, page, mask=j_ok & (l_start + j < capacity))
    for i0 in range(0, v_items, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        i_ok = (i < v_items) & (i_start + i < item_capacity)
        tl.store(work_ptr + i_start + i, tl.zeros([BLOCK], tl.int32) + v, mask=i_ok)
        tl.store(work_ptr + item_capacity + i_start + i, (i * PER_ITEM).to(tl.int32), mask=i_ok)
    if v == 2 * n - 1:
        tl.store(count_ptr, (i_start + v_items).to(tl.int32))


def score_lists(first: torch.Tensor | None, last: torch.Tensor | None,
                seen_first: torch.Tensor, seen_last: torch.Tensor, live: torch.Tensor,
                single: torch.Tensor | None, row_slot: torch.Tensor, table: torch.Tensor,
                page_size: int, capacity: int, per_item: int,
                item_capacity: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """``reference.score_lists_ref`` in one launch (and the lists' zero fill)."""
    n, dev = live.shape[0], live.device
    named = [("seen_first", seen_first), ("seen_last", seen_last), ("row_slot", row_slot)]
    named += [] if first is None else [("first", first), ("last", last)]
    for name, t in named:
        if t.dtype != torch.int64 or t.shape != (n,):
            raise ValueError(f"{name} must be int64 [{n}], got {t.dtype} {tuple(t.shape)}")
    if table.dtype != torch.int32 or table.stride(1) != 1 or per_item % page_size:
        raise ValueError(f"table must be int32 with contiguous rows and per_item a multiple "
                         f"of the page size, got {table.dtype} and {per_item}")  # fmt: skip
    i32 = dict(dtype=torch.int32, device=dev)
    out = {
        "which": torch.empty(2 * n, dtype=torch.int64, device=dev),
        "pages": torch.empty(2 * n, dtype=torch.int64, device=dev),
        "last": torch.empty(2 * n, **i32), "qo": torch.empty(2 * n + 1, **i32),
        "indptr": torch.empty(2 * n + 1, **i32), "indices": torch.zeros(capacity, **i32),
        "work": torch.empty(2, item_capacity, **i32), "count": torch.empty(1, **i32),
    }  # fmt: skip
    if n == 0:
        out["qo"].zero_(), out["indptr"].zero_(), out["count"].zero_()
        return out
    identity = first is None
    live, single = _bytes(live), None if single is None else _bytes(single)
    _score_lists_kernel[(2 * n,)](
        seen_first if identity else first, seen_first if identity else last, seen_first,
        seen_last, live, live if single is None else single, row_slot, table, table.stride(0),
        table.shape[1], out["which"], out["pages"], out["last"], out["qo"], out["indptr"],
        out["indices"], capacity, out["work"], out["count"], item_capacity, n,
        PAGE_SIZE=page_size, PER_ITEM=per_item, IDENTITY=identity,
        HAS_SINGLE=single is not None, V_BLOCK=max(16, triton.next_power_of_2(2 * n)),
        BLOCK=max(16, min(1024, triton.next_power_of_2(max(1, table.shape[1])))), num_warps=4,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["width", "cap", "scratch"])
def _store_row_scores_kernel(
    page_scores_ptr, indptr_ptr, pages_ptr, live_ptr, single_ptr, slot_ptr, scores_ptr,
    scores_stride, width, cap, scratch, SINGLE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    live = tl.load(live_ptr + r) != 0
    dest = tl.where(live, tl.load(slot_ptr + r), scratch).to(tl.int64)
    one = False  # the row's first query alone (SINGLE 1: every row; 2: per row)
    if SINGLE == 2:
        one = tl.load(single_ptr + r) != 0
    a_start = tl.load(indptr_ptr + 2 * r).to(tl.int64)
    b_start = tl.load(indptr_ptr + 2 * r + 1).to(tl.int64)
    a_pages = tl.load(pages_ptr + 2 * r)
    b_pages = tl.load(pages_ptr + 2 * r + 1)
    for j0 in range(0, width, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        a_ok, b_ok = j < a_pages, j < b_pages
        a = tl.load(page_scores_ptr + tl.minimum(a_start + j, cap - 1), mask=a_ok, other=0.0)
        b = tl.load(page_scores_ptr + tl.minimum(b_start + j, cap - 1), mask=b_ok, other=0.0)
        a = tl.where(a_ok, a, 0.0)
        b = tl.where(b_ok, b, 0.0)
        if SINGLE == 1:
            value = a
        else:
            value = tl.where(one, a, (a + b) / 2.0)
        tl.store(scores_ptr + dest * scores_stride + j, value, mask=j < width)


def store_row_scores(page_scores: torch.Tensor, indptr: torch.Tensor, pages: torch.Tensor,
                     live: torch.Tensor, single: torch.Tensor | bool | None, slot: torch.Tensor,
                     scores: torch.Tensor) -> None:  # fmt: skip
    """``reference.store_row_scores_ref`` in one launch."""
    n = live.shape[0]
    if scores.dtype != torch.float32 or scores.stride(1) != 1 or slot.dtype != torch.int64:
        raise ValueError(f"scores must be float32 with contiguous rows and slot int64, got "
                         f"{scores.dtype} and {slot.dtype}")  # fmt: skip
    if n == 0:
        return
    mode = 1 if single is True else (0 if single is None else 2)
    live, single = _bytes(live), _bytes(single) if mode == 2 else None
    _store_row_scores_kernel[(n,)](
        page_scores, indptr, pages, live, single if mode == 2 else live, slot, scores,
        scores.stride(0), scores.shape[1], page_scores.shape[0], scores.shape[0] - 1,
        SINGLE=mode, BLOCK=max(16, min(1024, triton.next_power_of_2(scores.shape[1]))),
        num_warps=4,
    )  # fmt: skip


def _bytes(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 (a view: no copy), so kernels read plain bytes."""
    return flags.view(torch.uint8) if flags.dtype == torch.bool else flags

"""One step's flattened inputs and attention plan (DESIGN.md §1.4: built once, used by every layer).

The host plans with numpy over O(rows) numbers (no per-token Python loops) and sends them in two
asynchronous copies from pooled pinned buffers (``kernels.host.upload``): the int64 token
inputs (ids, positions, KV slots; padded to the CUDA-graph bucket when graphs run) and one
int32 buffer of per-row numbers (page counts, slots, list layouts, offsets). Every page list
(full, sparse, scoring) is then gathered on the device from the device-resident page table
(``page_table.py``), so no host array ever holds every listed page.
Draft rows' sparse lists have lengths that depend only on page counts; their top-k middles are
chosen on the device (``draft_pages``) before the first layer and again after the refresh layer
has scored pages. Nothing here waits for the device.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from aspire_ray.kernels.host import offsets, ragged_arange, upload
from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.plan import RowKind, RowPlan

from .draft_pages import choose_top_pages
from .page_table import ragged_rows
from .step_attention import ScoringQueries, StepAttention
from .step_resources import StepResources

_VERIFY, _DRAFT, _PREFILL = int(RowKind.VERIFY), int(RowKind.DRAFT), int(RowKind.PREFILL)


class _Int32Upload:
    """Host int32 arrays gathered while planning, sent in one copy. Parts start 16-byte aligned:
    Triton specialises kernels on pointer alignment, which must not change from step to step."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def add(self, arr) -> int:
        self.parts.append(np.asarray(arr, dtype=np.int32).reshape(-1))
        return len(self.parts) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        starts, total = [], 0
        for p in self.parts:
            starts.append(total)
            total += -(-len(p) // 4) * 4
        buf = np.zeros(max(total, 4), dtype=np.int32)
        for s, p in zip(starts, self.parts, strict=True):
            buf[s : s + len(p)] = p
        dev = upload(buf, device)
        return [dev[s : s + len(p)] for s, p in zip(starts, self.parts, strict=True)]


@dataclass
class _Lists:
    """One PagedKVMeta: its host arrays, the upload handles of its offsets and of the per-row
    numbers its page list is gathered from (``gather``)."""

    q_lens: np.ndarray
    pages: np.ndarray  # [R] listed pages per row
    last: np.ndarray
    handles: tuple[int, int, int]  # qo_indptr, kv_indptr, kv_last_page_len
    slots: int  # handle of int32 [R]: each row's page-table slot
    counts: int  # handle of int32 [R]: ``pages``

    def meta(self, t: list[torch.Tensor], kv_indices: torch.Tensor, page_size: int) -> PagedKVMeta:
        h = self.handles
        return PagedKVMeta(t[h[0]], t[h[1]], kv_indices, t[h[2]], page_size,
                           qo_indptr_host=offsets(self.q_lens).tolist(),
                           kv_indptr_host=offsets(self.pages).tolist(),
                           kv_last_page_len_host=self.last.tolist())  # fmt: skip

    def rows(self, t: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, j) of every listed page, int64 [nnz] each, on the device."""
        return ragged_rows(t[self.counts], int(self.pages.sum()))


class StepBatch:
    """Flattened inputs and the attention plan of one step.

    Inputs. resources: the shard's tables and policies, the only shard state planning reads
    (it writes page scores, through them). slots: [R] each row's page-table slot. scored: [R]
    whether the row's request holds page scores (a draft row's top-k middle is then chosen
    from them before the first layer, not only after the refresh layer). device_tokens:
    (index [M], ids [M]), int64 on the device: input tokens replaced after the upload (the
    rows' host token ids there are placeholders); shift: added to every row's start_pos
    (step s of a draft chain plans its rows with shift s).

    Outputs. tokens: int64 [3, n] on the device (ids, positions, KV slots), n = T real tokens
    or the padded graph bucket (ids 0, positions 0, slots -1 past T); input_ids, positions and
    slot_mapping are its [T] views. logit_index: int32 [N] tokens whose logits are needed;
    logit_offsets: [R + 1] host offsets of each row's logits among them. scored_now: row ->
    the pages the refresh layer scores for it in this step (its request's scored pages from
    then on: the caller, which owns the requests, records them).
    """

    def __init__(self, resources: StepResources, rows: list[RowPlan], slots: Sequence[int],
                 scored: Sequence[bool], graph_inputs: torch.Tensor | None = None,
                 device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None,
                 shift: int = 0) -> None:  # fmt: skip
        self.resources, self.rows = resources, rows
        ps, dev, table = resources.page_size, resources.device, resources.page_table
        table.flush()  # the block tables' deltas reach the device before any gather
        nr = len(rows)
        n = np.fromiter((row.num_tokens for row in rows), np.int64, nr)
        start = np.fromiter((row.start_pos for row in rows), np.int64, nr) + shift
        kind = np.fromiter((int(row.kind) for row in rows), np.int64, nr)
        sample = np.fromiter((row.sample for row in rows), bool, nr)
        slot = np.fromiter(slots, np.int64, nr)
        ctx = start + n
        pages = (ctx + ps - 1) // ps
        short = np.nonzero(pages > table.sizes[slot])[0]
        if len(short):
            r = int(short[0])
            raise RuntimeError(f"request {rows[r].req_id}: {table.sizes[slot[r]]} pages cannot "
                               f"hold {rows[r].context_len + shift} tokens")  # fmt: skip
        tok_kvp = offsets(n)
        t = int(tok_kvp[-1])
        self.num_tokens = t
        pos = ragged_arange(n) + np.repeat(start, n)
        # even width: each row starts 16-byte aligned (Triton specialises on alignment)
        width = t + t % 2 if graph_inputs is None else graph_inputs.shape[1]
        tokens = np.zeros((3, width), dtype=np.int64)
        tokens[0, :t] = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in rows),
                                    np.int64, t)  # fmt: skip
        tokens[1, :t] = pos
        tokens[2, t:] = -1  # padding tokens: the KV store skips negative slots
        tokens[2, :t] = table.host[np.repeat(slot, n), pos // ps].astype(np.int64) * ps + pos % ps
        self.tokens = upload(tokens, dev, graph_inputs)
        self.input_ids, self.positions, self.slot_mapping = (x[:t] for x in self.tokens)
        if device_tokens is not None:  # tokens the host does not know yet (a draft chain)
            self.input_ids.index_copy_(0, *device_tokens)

        # logits: every token of a verify row; the last token of a draft row / sampling prefill
        n_logits = np.where(kind == _VERIFY, n,
                            ((kind == _DRAFT) | ((kind == _PREFILL) & sample)).astype(np.int64))
        self.logit_offsets = offsets(n_logits).tolist()
        up = _Int32Upload()
        h_logits = up.add(np.repeat(tok_kvp[1:] - n_logits, n_logits) + ragged_arange(n_logits))
        last = ctx - (pages - 1) * ps
        h_slot = up.add(slot)
        full_lists = _Lists(n, pages, last, (up.add(tok_kvp), up.add(offsets(pages)), up.add(last)),
                            h_slot, up.add(pages))  # fmt: skip
        draft = kind == _DRAFT
        self.has_drafts = bool(draft.any())
        resources.reserve_scores(table.slots, int(pages.max()))
        scoring = None
        if resources.scoring:
            scoring = self._plan_scoring(up, slot, n, kind, sample, ctx,
                                         resources.refresh_while_drafting)  # fmt: skip
        sparse = None
        if self.has_drafts:
            scored_rows = scoring[-1] if scoring is not None else np.zeros(nr, bool)
            sparse = self._plan_sparse(up, np.asarray(scored, bool), slot, draft, n, pages,
                                       last, full_lists, scored_rows)  # fmt: skip
        self.scored_now: dict[int, int] = {} if scoring is None else {
            r: int(pages[r]) for r in np.nonzero(scoring[-1])[0].tolist()}  # fmt: skip

        tensors = up.send(dev)
        self.logit_index = tensors[h_logits]
        pages_by_slot = table.table
        row, j = full_lists.rows(tensors)
        meta_full = full_lists.meta(tensors, pages_by_slot[tensors[h_slot][row], j], ps)
        meta_pre, self._top = meta_full, None
        if sparse is not None:
            lists, layout, top = sparse
            row, j = lists.rows(tensors)
            mid_end, tail_start, row_pages = (tensors[h].long()[row] for h in layout)
            # middles get a placeholder page (the device choice fills them)
            logical = torch.where(j >= mid_end, j + tail_start - mid_end,
                                  torch.minimum(j, row_pages - 1))  # fmt: skip
            meta_pre = lists.meta(tensors, pages_by_slot[tensors[h_slot][row], logical], ps)
            if top is not None:
                h_info, first, max_cand, h_pre, h_post = top
                self._template = meta_pre.kv_indices
                self._top = (tensors[h_info].view(4, -1), first, max_cand)
                self._has_post = None if h_post is None else tensors[h_post].bool()
                meta_pre.kv_indices = self._choose(self._template, tensors[h_pre].bool())
        queries = None
        if scoring is not None:
            h_idx, q_lists, h_slots, h_count, _ = scoring
            row, j = q_lists.rows(tensors)
            q_slot = tensors[q_lists.slots].long()[row]
            queries = ScoringQueries(tensors[h_idx],
                                     q_lists.meta(tensors, pages_by_slot[q_slot, j], ps))
            dest = q_slot * resources.scores.width + j
            self._store = (dest, tensors[h_slots], tensors[h_count].float())
        refresh_full = resources.refresh_while_drafting or not self.has_drafts
        self.attention = StepAttention(
            resources.backend, resources.tp, self.slot_mapping, meta_pre, resources.refresh_layer,
            meta_refresh=meta_full if refresh_full else meta_pre, scoring=queries,
            on_scores=self._apply_scores if queries is not None else None,
        )

    # ---- planning ----------------------------------------------------------------------------
    def _plan_scoring(self, up, slot, n, kind, sample, ctx, score_drafts: bool):
        """Which queries score pages at the refresh layer (DESIGN.md §1.2), and where their
        scores go in the table. Draft rows (when refreshing while drafting): their one query;
        verify rows: first and last query (averaged); sampling prefill rows: the last token.
        Each query lists the pages it sees, gathered on the device."""
        ps = self.resources.page_size
        two = (kind == _VERIFY) & (n > 1)
        one = ((kind == _DRAFT) & score_drafts) | ((kind == _PREFILL) & sample) | \
            ((kind == _VERIFY) & (n == 1))  # fmt: skip
        n_q = one.astype(np.int64) + 2 * two
        if not n_q.any():
            return None
        q_row = np.repeat(np.arange(len(n)), n_q)
        local = np.where(two[q_row] & (ragged_arange(n_q) == 0), 0, n[q_row] - 1)
        visible = ctx[q_row] - n[q_row] + 1 + local
        q_pages = (visible + ps - 1) // ps
        q_last = visible - (q_pages - 1) * ps
        q_lists = _Lists(np.ones(len(q_row), np.int64), q_pages, q_last,
                         (up.add(np.arange(len(q_row) + 1)), up.add(offsets(q_pages)),
                          up.add(q_last)), up.add(slot[q_row]), up.add(q_pages))  # fmt: skip
        owners = np.nonzero(n_q)[0]
        tok_kvp = offsets(n)
        return (up.add(tok_kvp[q_row] + local), q_lists, up.add(slot[owners]),
                up.add(n_q[owners]), n_q > 0)

    def _plan_sparse(self, up, scored, slot, draft, n, pages, last, full_lists, scored_rows):
        """Draft rows' lists from the policy's layout, full lists for the other rows: the
        layout per row (gathered on the device) and, if some row has a top-k middle, what the
        device choice needs. scored: [R] bool, the rows' requests have scores before this step;
        scored_rows: [R] bool, the refresh layer scores them in this step."""
        head_end, n_top, tail_start = self.resources.selector.layout(pages)
        head_end = np.where(draft, head_end, pages)
        n_top = np.where(draft, n_top, 0)
        tail_start = np.where(draft, tail_start, pages)
        counts = head_end + n_top + (pages - tail_start)
        sparse_kvp = offsets(counts)
        h = full_lists.handles
        lists = _Lists(n, counts, last, (h[0], up.add(sparse_kvp), h[2]), full_lists.slots,
                       up.add(counts))  # fmt: skip
        layout = (up.add(head_end + n_top), up.add(tail_start), full_lists.counts)
        top = np.nonzero(n_top > 0)[0]
        if len(top) == 0:
            return lists, layout, None
        has_pre = scored[top]
        n_cand = tail_start[top] - head_end[top]
        info = np.stack([slot[top], n_cand, n_top[top], sparse_kvp[top] + head_end[top]])
        # after the refresh layer only rows whose request it scored can change
        h_post = up.add(has_pre | scored_rows[top]) if scored_rows[top].any() else None
        return lists, layout, (up.add(info), int(head_end[top[0]]), int(n_cand.max()),
                               up.add(has_pre), h_post)  # fmt: skip

    # ---- device choice -------------------------------------------------------------------------
    def _choose(self, template: torch.Tensor, has_scores: torch.Tensor) -> torch.Tensor:
        rows, first, max_cand = self._top
        return choose_top_pages(template, self.resources.page_table.table,
                                self.resources.scores, rows, has_scores, first,
                                max_cand)  # fmt: skip

    def _apply_scores(self, page_scores: torch.Tensor) -> PagedKVMeta:
        """Store the scored requests' page scores; re-choose the draft rows' pages that changed."""
        t0 = time.perf_counter()
        self.resources.store_scores(page_scores, *self._store)
        meta = self.attention.meta_pre
        if self._top is not None and self._has_post is not None:
            meta = replace(meta, kv_indices=self._choose(self._template, self._has_post))
            # the attention plan depends only on the host lists, which are unchanged
            plans = self.attention.meta_pre.__dict__.get("_triton_attention_plans")
            if plans is not None:
                meta.__dict__["_triton_attention_plans"] = plans
        self.attention.refresh_seconds += time.perf_counter() - t0
        return meta

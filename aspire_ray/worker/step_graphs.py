"""Whole-step CUDA graphs of decode steps: attention captured with the dense layers.

The piecewise graphs (``cuda_graphs.py``) leave every layer's attention eager, because its page
lists and work split change every step; for a small model that host work (~0.1 ms per layer)
is most of a decode step, and all of a draft step. A decode step (draft and verify rows only,
at most ``max_q`` queries per row) is replayed here from one graph instead: attention reads
fixed metadata buffers (``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``)
and a ``FixedPlan`` (fixed grids; work lists and item counts on the device), into which each
step copies its own before the replay.

With a page-scoring policy the refresh layer l_r is in the graph too (``_FixedRefresh``): its
full attention over fixed full lists, the scoring queries' page scores (a ``FixedScoreWork``),
the score-table update and the draft rows' new top-k pages, written over the fixed
``kv_indices`` that the layers after l_r read. Padding is harmless by construction: padded
scoring queries and score rows land in a scratch slot of the score table, padded draft rows
choose nothing.

Steps that do not fit (prefill rows, more work than a plan holds) use the piecewise graphs.
Buffers shared with the piecewise graphs (inputs, residual) and between buckets are safe
because replays run one after another on one stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from aspire_ray.kernels import PagedKVMeta
from aspire_ray.kernels.page_scores import BLOCK_N, FixedScoreWork
from aspire_ray.kernels.paged_attention import AttentionConfig, FixedPlan

from .cuda_graphs import PiecewiseGraphs
from .draft_pages import PageScoreTable, choose_top_pages
from .step_attention import StepAttention


def _int32(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


def _fixed_meta(rows: int, indices: torch.Tensor, page_size: int, plan) -> PagedKVMeta:
    dev = indices.device
    return PagedKVMeta(_int32(rows + 1, dev), _int32(rows + 1, dev), indices, _int32(rows, dev),
                       page_size, fixed_plan=plan)  # fmt: skip


def _copy_meta(dst: PagedKVMeta, src: PagedKVMeta) -> bool:
    """src's lists into dst's fixed buffers and plan; False if they do not fit."""
    rows, nnz = src.num_rows, src.kv_indices.shape[0]
    if rows > dst.num_rows or nnz > dst.kv_indices.shape[0] or not dst.fixed_plan.load(src):
        return False
    dst.qo_indptr[: rows + 1].copy_(src.qo_indptr)
    dst.kv_indptr[: rows + 1].copy_(src.kv_indptr)
    dst.kv_last_page_len[:rows].copy_(src.kv_last_page_len)
    dst.kv_indices[:nnz].copy_(src.kv_indices)
    return True


def _put(dst: torch.Tensor, src: torch.Tensor | None, pad) -> None:
    """dst[:len(src)] = src, the rest = pad (along dim -1)."""
    k = 0 if src is None else src.shape[-1]
    if k:
        dst[..., :k].copy_(src)
    dst[..., k:].fill_(pad)


@dataclass
class _FixedRefresh:
    """A bucket's fixed inputs of the refresh layer (see the module docstring)."""

    meta: PagedKVMeta  # the lists the refresh layer attends over (full lists, usually)
    token_index: torch.Tensor  # int64 [S]: the scoring queries among the step's tokens
    score_meta: PagedKVMeta  # one row per scoring query (fixed_plan: a FixedScoreWork)
    dest: torch.Tensor  # int64 [nnz_s]: score-table index of each scored page
    slots: torch.Tensor  # int64 [R]: the scored requests' table rows
    num_queries: torch.Tensor  # float32 [R]: their scoring-query counts
    top: torch.Tensor  # int32 [5, R]: choose_top_pages' per-row info
    has_scores: torch.Tensor  # bool [R]
    template: torch.Tensor  # int32 [nnz]: the sparse lists with top-k placeholders
    full_indices: torch.Tensor  # int32 [nnz]: the full lists' page ids


class StepGraphs:
    def __init__(self, pieces: PiecewiseGraphs, split_layer: int | None, max_q: int,
                 max_tokens: int, config: AttentionConfig, table: PageScoreTable | None = None,
                 first_candidate: int = 0, max_pages: int = 0,
                 max_requests: int = 0) -> None:  # fmt: skip
        """split_layer: the scoring refresh layer (None: no scoring); max_q: most queries of a
        row; max_tokens: largest decode step to capture. Scoring policies: the page-score
        table (grown now to ``max_requests`` slots of ``max_pages``: the graphs hold its
        address), the logical index of the first top-k candidate page."""
        self.pieces = pieces
        self.model = pieces.model
        self.split = split_layer
        self.max_q = max_q
        self.config = config
        self.buckets = [n for n in pieces.buckets if n <= max(max_tokens, 1)]
        attn = self.model.layers[0].self_attn
        self.heads = (attn.q_heads, attn.kv_heads, attn.head_dim)
        self.table, self.first, self.max_pages = table, first_candidate, max_pages
        self.scratch = table.reserve(max_requests, max_pages) if table is not None else -1
        self.plans: dict[tuple[str, int], FixedPlan] = {}
        self.metas: dict[int, PagedKVMeta] = {}
        self.refresh: dict[int, _FixedRefresh] = {}
        self.graphs: dict[int, list] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self._ptrs: tuple | None = None
        self._shared: dict[str, torch.Tensor] = {}
        self.steps = 0  # steps replayed whole

    # ---- capture -------------------------------------------------------------------------------
    def ensure(self, n: int, kv_caches: list[torch.Tensor]) -> bool:
        """Make bucket n's graph ready (before the step writes its inputs: a capture clears
        them); False if n has none."""
        if n not in self.buckets:
            return False
        ptrs = (kv_caches[0].data_ptr(), None if self.table is None
                else self.table.scores.data_ptr())  # fmt: skip
        if self._ptrs != ptrs:  # a new KV pool or score table: recapture
            self.graphs.clear()
            self.hidden.clear()
            self._shared.clear()
            self._ptrs = ptrs
        if n not in self.graphs:
            self._capture(n, kv_caches)
        return True

    def capture_all(self, kv_caches: list[torch.Tensor]) -> None:
        for n in reversed(self.buckets):
            self.ensure(n, kv_caches)

    def _buffer(self, name: str, n: int, dtype=torch.int32) -> torch.Tensor:
        """A fixed buffer shared by every bucket (replays never overlap): [:n] of the largest."""
        buf = self._shared.get(name)
        if buf is None or buf.shape[0] < n:
            buf = torch.zeros(n, dtype=dtype, device=self.pieces.device)
            self._shared[name] = buf
        return buf[:n]

    def _plan(self, kind: str, n: int) -> FixedPlan:
        """Bucket n's plan for the pre/post lists or the refresh layer's; all share the
        largest partial buffers (their launches never overlap)."""
        if (kind, n) not in self.plans:
            hq, hkv, d = self.heads
            big = max(self.plans.values(), default=None, key=lambda p: p.plan.part_rows)
            self.plans[kind, n] = FixedPlan.for_tokens(n, self.max_q, hq, hkv, d,
                                                       self.pieces.device, self.config, big)
        return self.plans[kind, n]

    def _fixed_refresh(self, n: int, pool: int, page_size: int) -> _FixedRefresh:
        s_cap = 2 * n  # a verify row scores its first and last query
        nnz_s = min(2 * pool, s_cap * self.max_pages)
        work = FixedScoreWork(-(-nnz_s * page_size // BLOCK_N) + s_cap, self.pieces.device)
        top = self._buffer("top", 5 * n).view(5, n)
        return _FixedRefresh(
            meta=_fixed_meta(n, self._buffer("refresh_indices", pool), page_size,
                             self._plan("refresh", n)),
            token_index=self._buffer("token_index", s_cap, torch.int64),
            score_meta=_fixed_meta(s_cap, self._buffer("score_indices", nnz_s), page_size, work),
            dest=self._buffer("dest", nnz_s, torch.int64),
            slots=self._buffer("slots", n, torch.int64),
            num_queries=self._buffer("num_queries", n, torch.float32),
            top=top, has_scores=self._buffer("has_scores", n, torch.bool),
            template=self._buffer("template", pool), full_indices=self._buffer("full", pool))

    def _attend(self, i: int, n: int, q, kv_cache, meta: PagedKVMeta) -> torch.Tensor:
        """Layer i's attention inside the graph; at the refresh layer also the page scores
        and the draft rows' new pages (written over ``meta.kv_indices``)."""
        backend, scale = self.pieces.backend, self.model.layers[i].self_attn.scale
        if i != self.split:
            return backend.attention(q, kv_cache, meta, scale)
        fr = self.refresh[n]
        out, lse = backend.attention(q, kv_cache, fr.meta, scale, return_lse=True)
        idx = fr.token_index
        probs = backend.token_max_probs(q[idx], lse[idx], kv_cache, fr.score_meta, scale)
        self.table.store(probs.sum(dim=-1), fr.dest, fr.slots, fr.num_queries)
        chosen = choose_top_pages(fr.template, fr.full_indices, self.table, fr.top,
                                  fr.has_scores, self.first, self.table.width - self.first)
        meta.kv_indices.copy_(chosen)
        return out

    def _forward(self, n: int, meta: PagedKVMeta, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The whole step over the bucket's fixed buffers -> final hidden [n, H]."""
        p, layers = self.pieces, self.model.layers
        ids, positions, slots = p.inputs[n][:, :n]
        residual = p.residual[:n]
        residual.copy_(self.model.embed_tokens(ids))
        x = None
        for i, layer in enumerate(layers):
            q, k, v = layer.pre_attention(x, residual, positions, self.model.rotary)
            p.backend.store_kv(k, v, kv_caches[i], slots)
            x = layer.post_attention(self._attend(i, n, q, kv_caches[i], meta), residual)
        return self.model.norm(x, residual)

    def _capture(self, n: int, kv_caches: list[torch.Tensor]) -> None:
        p = self.pieces
        pool, page_size = kv_caches[0].shape[0], kv_caches[0].shape[2]
        # rows never share pages: a step lists at most every page once
        meta = _fixed_meta(n, self._buffer("indices", pool), page_size, self._plan("pre", n))
        self.metas[n] = meta
        if self.split is not None:
            self.refresh[n] = fr = self._fixed_refresh(n, pool, page_size)
            fr.meta.fixed_plan.clear()
            fr.score_meta.fixed_plan.clear()
            self._pad_refresh(fr, meta)
        fn = [lambda: self._forward(n, meta, kv_caches)]
        with torch.inference_mode():
            p.inputs_for(n, kv_caches)
            p.inputs[n][2].fill_(-1)  # the warm-up run and the capture write no KV
            meta.fixed_plan.clear()  # no work items: the warm-up run only compiles
            p.run_captures(fn)  # eager once (compiles), then captured
            graphs, out = p.run_captures(fn, capture=True)
        self.graphs[n], self.hidden[n] = graphs, out

    # ---- one step ------------------------------------------------------------------------------
    def _pad_refresh(self, fr: _FixedRefresh, meta: PagedKVMeta) -> None:
        """Inputs under which the refresh layer changes nothing real: no scoring queries,
        scores into the scratch slot, no top-k rows (the template is the current lists)."""
        scratch = self.scratch * self.table.width
        _put(fr.token_index, None, 0)
        _put(fr.dest, None, scratch)
        _put(fr.slots, None, self.scratch)
        _put(fr.num_queries, None, 1.0)
        _put(fr.top, None, 0)
        fr.top[0].fill_(self.scratch)
        _put(fr.has_scores, None, False)
        fr.template.copy_(meta.kv_indices[: fr.template.shape[0]])

    def _load_refresh(self, n: int, batch) -> bool:
        fr, meta, att = self.refresh[n], self.metas[n], batch.attention
        if not _copy_meta(fr.meta, att.meta_refresh):
            return False
        scoring = att.scoring
        if scoring is not None:
            s = scoring.token_index.shape[0]
            if s > fr.token_index.shape[0] or \
                    not _copy_meta(fr.score_meta, scoring.meta):  # fmt: skip
                return False
            dest, slots, count = batch._store
            if dest.shape[0] > fr.dest.shape[0]:
                return False
            _put(fr.token_index, scoring.token_index, 0)
            _put(fr.dest, dest, self.scratch * self.table.width)
            _put(fr.slots, slots, self.scratch)
            _put(fr.num_queries, count, 1.0)
        else:
            fr.score_meta.fixed_plan.clear()
            _put(fr.slots, None, self.scratch)
            _put(fr.dest, None, self.scratch * self.table.width)
        nnz = batch.full_indices.shape[0]
        fr.full_indices[:nnz].copy_(batch.full_indices)
        if batch._top is None:
            _put(fr.top, None, 0)
            fr.top[0].fill_(self.scratch)
            _put(fr.has_scores, None, False)
            fr.template[: meta.kv_indices.shape[0]].copy_(meta.kv_indices)
            return True
        info, first, _ = batch._top
        if first != self.first:
            return False
        _put(fr.top, info, 0)
        fr.top[0, info.shape[1]:].fill_(self.scratch)
        has = batch._has_post if batch._has_post is not None else batch._has_pre
        _put(fr.has_scores, has, False)
        fr.template[: batch._template.shape[0]].copy_(batch._template)
        return True

    def load(self, n: int, batch) -> bool:
        """Copy the step's metadata into bucket n's buffers; False if the step does not fit
        (then the step must not replay: the buffers may be partly written)."""
        meta = self.metas.get(n)
        if meta is None or not _copy_meta(meta, batch.attention.meta_pre):
            return False
        return self.split is None or self._load_refresh(n, batch)

    def run(self, n: int, num_tokens: int) -> torch.Tensor:
        """Replay bucket n (inputs and ``load`` done) -> hidden [num_tokens, H]."""
        self.steps += 1
        self.graphs[n][0].replay()
        return self.hidden[n][:num_tokens]

"""Batched draft page selection (device path) equals the per-row policies (``select``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import random_prompts, run_staggered

from aspire_ray import SamplingParams
from aspire_ray.config import SpecConfig
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.worker import step_batch, worker
from aspire_ray.worker.draft_pages import PageScoreTable, choose_top_pages
from aspire_ray.worker.page_policies import StreamingWindow, TopKPages

SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6)


def _batched(sel: TopKPages, pages: list[int], scores: list[torch.Tensor | None]) -> list:
    """Every row's list through layout + choose_top_pages, with logical page ids as physical."""
    table = PageScoreTable(torch.device("cpu"), width=4, slots=len(pages))
    table.ensure_width(max(pages) + 3)
    # the page table: slot r holds logical page ids as physical ones
    page_table = torch.arange(table.width, dtype=torch.int32).repeat(len(pages), 1)
    p = np.array(pages)
    head_end, n_top, tail_start = sel.layout(p)
    counts = head_end + n_top + p - tail_start
    template, info, has = [], [], []
    out_at = 0
    for r, (n, s) in enumerate(zip(pages, scores, strict=True)):
        if s is not None:
            table.scores[r, : len(s)] = s
        template += list(range(head_end[r])) + [-1] * n_top[r] + list(range(tail_start[r], n))
        if n_top[r]:
            info.append([r, tail_start[r] - head_end[r], n_top[r], out_at + head_end[r]])
            has.append(s is not None)
        out_at += counts[r]
    out = torch.tensor(template, dtype=torch.int32)
    if info:
        rows = torch.tensor(info, dtype=torch.int32).T.contiguous()
        first = int(sel.cfg.keep_sink_page)
        out = choose_top_pages(out, page_table, table, rows, torch.tensor(has), first,
                               int(rows[1].max()))  # fmt: skip
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [out[bounds[r] : bounds[r + 1]].tolist() for r in range(len(pages))]


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "no-sink"])
def test_top_k_matches_select_with_ties_and_partial_scores(sink):
    sel = TopKPages(SpecConfig(mode="aspire", k_min=4, recent_pages=2, rho=0.2,
                               keep_sink_page=sink))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    pages, scores = [], []
    for _ in range(40):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        scored = int(torch.randint(0, n + 3, (1,), generator=gen))  # may lag or exceed n
        # few distinct values: many ties, which go to the lower page index
        s = torch.randint(0, 4, (scored,), generator=gen).float() / 4 if scored else None
        pages.append(n)
        scores.append(s)
    got = _batched(sel, pages, scores)
    assert got == [sel.select(s, n) for s, n in zip(scores, pages, strict=True)]


def test_streaming_layout_matches_select():
    sel = StreamingWindow(SpecConfig(mode="magicdec", k_min=3, recent_pages=1, rho=0.07))
    for n in range(1, 80):
        head_end, n_top, tail_start = (int(x[0]) for x in sel.layout(np.array([n])))
        assert n_top == 0
        assert list(range(head_end)) + list(range(tail_start, n)) == sel.select(None, n)


def test_score_table_grows_and_keeps_rows():
    table = PageScoreTable(torch.device("cpu"), width=2, slots=1)
    table.ensure_slots(2)
    a, b = 0, 1
    assert table.scores.shape[0] == 3 and table.scratch == 2  # and the scratch row
    table.scores[a, :2] = torch.tensor([1.0, 2.0])
    table.ensure_width(5)
    assert table.width >= 5 and table.scores[a, :2].tolist() == [1.0, 2.0]
    # two queries of one owner (3 and 2 pages) average; untouched rows keep their scores
    table.store(torch.tensor([1.0, 3.0, 5.0, 3.0, 1.0]),
                torch.tensor([b * table.width + j for j in (0, 1, 2, 0, 1)]),
                torch.tensor([b]), torch.tensor([2.0]))  # fmt: skip
    assert table.scores[b, :3].tolist() == [2.0, 2.0, 2.5]
    assert table.scores[a, :2].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("mode", ["aspire", "aspire_fixed"])  # aspire_fixed: draft chains too
def test_engine_lists_match_per_row_policy(tiny_model_dir, monkeypatch, mode):
    """Every draft row of every step, before and after the refresh layer, lists exactly the
    pages ``TopKPages.select`` picks from the request's scores at that moment."""
    checked = {"pre": 0, "post": 0}
    cfg = build_engine_config(tiny_model_dir("llama"), spec_mode=mode,
                              max_num_batched_tokens=64, num_pages=120, **SPARSE)  # fmt: skip
    engine = LLMEngine(cfg)
    w = engine.executor.worker  # its requests' scores; planning itself never sees the Worker

    class Checked(step_batch.StepBatch):
        def __init__(self, resources, rows, *args, shift=0, **kwargs):
            before = {r.req_id: _scores(w.requests[r.req_id]) for r in rows}
            self.shift = shift  # a draft chain's step
            super().__init__(resources, rows, *args, shift=shift, **kwargs)
            self._check(self.attention.meta_pre, before, "pre")

        def _apply_scores(self, page_scores):
            meta = super()._apply_scores(page_scores)
            after = {r.req_id: _scores(w.requests[r.req_id]) for r in self.rows}
            self._check(meta, after, "post")
            return meta

        def _check(self, meta, scores, when):
            kvp, ps = meta.kv_indptr_host, self.resources.page_size
            for r, row in enumerate(self.rows):
                if row.kind != worker.RowKind.DRAFT:
                    continue
                bt = self.resources.page_table.host[w.requests[row.req_id].slot].tolist()
                pages = -(-(row.context_len + self.shift) // ps)
                chosen = self.resources.selector.select(scores[row.req_id], pages)
                assert meta.kv_indices[kvp[r] : kvp[r + 1]].tolist() == [bt[j] for j in chosen]
                checked[when] += 1

    monkeypatch.setattr(worker, "StepBatch", Checked)
    prompts = random_prompts(4, [30, 100, 150], vocab=256, seed=3)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 4
    run_staggered(engine, prompts, params, arrive_every=3)
    assert checked["pre"] > 10 and checked["post"] > 10


def _scores(req):
    s = req.scores
    return None if s is None else s.clone()

"""Asynchronous runs (``RowPlan.async_gamma``: aspire's steps several to a plan, each request
drafting until it holds its draft length, then verifying): the row kinds follow the drafts
held; greedy output equals ``ar``'s token for token, with the steps planned on the host and
with the self-planning graphs (``worker/async_graphs.py``; CPU: Triton's interpreter, graphs
emulated by EagerGraph), and the graphs draft and verify what the host-planned steps do."""

from __future__ import annotations

import pytest
from helpers import random_prompts, run_staggered, use_eager_graphs

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import RowKind, RowPlan

SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6, gamma_init=3)


def test_async_kinds_follow_the_drafts_held():
    row = RowPlan("a", RowKind.DRAFT, [7], 11, 0, [], num_steps=9, verify_after=[5, 6, 7],
                  async_gamma=3)  # fmt: skip
    # holds 2 drafts: one more, then verify 3; then 3 drafts and verify them; then a draft
    assert row.async_kinds() == [-1, 3, -1, -1, -1, 3, -1, -1, -1]
    row.async_gamma = 0  # plain decoding: every step verifies no draft
    assert RowPlan("a", RowKind.DRAFT, [5], 9, 0, [], num_steps=3, verify_after=[5],
                   async_gamma=0).async_kinds() == [0, 0, 0]
    # more drafts held than the length: verify them first
    assert RowPlan("a", RowKind.DRAFT, [7], 11, 0, [], num_steps=2, verify_after=[5, 6, 7],
                   async_gamma=1).async_kinds() == [2, -1]


def _engine(model_dir, mode, **spec):
    cfg = build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=64,
                              num_pages=120, max_num_seqs=4, page_size=4, calibrate="off",
                              **{**SPARSE, **spec})  # fmt: skip
    return LLMEngine(cfg)


def _greedy(engine, n=4, max_tokens=20):
    prompts = random_prompts(n, [8, 24, 40], vocab=256, seed=4)
    params = [SamplingParams(max_tokens=max_tokens + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(n)]  # fmt: skip
    return run_staggered(engine, prompts, params, arrive_every=2)


def _recording(worker):
    """Record the plans' asynchronous rows' segments: (req, drafts, verified tokens)."""
    segments, execute = [], worker.execute

    def recording(plan):
        out = execute(plan)
        for row, res in zip(plan.rows, out.results, strict=True):
            if row.async_gamma is not None:
                segments.extend((res.req_id, tuple(seg.tokens),
                                 seg.verified and tuple(seg.verified.tokens))
                                for seg in (res, *res.rounds))  # fmt: skip
        return out

    worker.execute = recording
    return segments


@pytest.mark.parametrize("mode", ["aspire", "aspire_fsm"])
def test_async_runs_match_ar(tiny_model_dir, mode):
    model_dir = tiny_model_dir("llama")
    expected = _greedy(_engine(model_dir, "ar"))
    engine = _engine(model_dir, mode, async_steps=6)
    segments = _recording(engine.executor.worker)
    assert _greedy(engine) == expected
    kinds = engine.stats()["step_kinds"]
    assert kinds.get("async", 0) >= 12, kinds  # most steps ran in asynchronous runs
    assert any(tokens for _, tokens, _ in segments), "no run drafted"
    assert any(verified for _, _, verified in segments), "no run verified"


def test_async_runs_not_for_sampled_batches(tiny_model_dir):
    engine = _engine(tiny_model_dir("llama"), "aspire", async_steps=6)
    prompts = random_prompts(2, [8, 24], vocab=256, seed=4)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)]
    run_staggered(engine, prompts, params, arrive_every=1)
    assert "async" not in engine.stats()["step_kinds"]


@pytest.mark.slow
def test_async_graphs_run_as_planned_steps(tiny_model_dir):
    # aspire: top-k pages chosen from scores; every row rescores at the refresh layer (draft
    # rows from their query, verify rows from their first and last); ragged rows' attention
    # work planned on the device
    model_dir = tiny_model_dir("llama")
    planned = _engine(model_dir, "aspire", async_steps=6, attention_backend="triton")
    use_eager_graphs(planned, draft_graphs=False)
    on_host = _recording(planned.executor.worker)
    expected = _greedy(planned)
    engine = _engine(model_dir, "aspire", async_steps=6, attention_backend="triton")
    w = use_eager_graphs(engine)
    on_graphs = _recording(w)
    assert _greedy(engine) == expected
    assert w.async_graphs.steps >= 12, "too few steps replayed by the asynchronous graphs"
    assert on_graphs == on_host and len(on_host) > 6  # the same drafts and verifications

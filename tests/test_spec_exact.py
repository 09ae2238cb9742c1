"""Every speculation mode's greedy output equals plain autoregressive decoding (fp32, CPU)."""

from __future__ import annotations

import pytest
from helpers import random_prompts, run_staggered

from aspire_ray import SamplingParams
from aspire_ray.config import SPEC_MODES
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config

# Prompts of 1..150 tokens (up to 10 pages of 16); with k_min=3 pages and 1 recent page the
# sparse lists are strict subsets, so drafting really is sparse.
LENGTHS = [1, 30, 60, 100, 150]
SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6)


def _run(model_dir, mode, num_pages, max_tokens=32, n=6, **extra):
    cfg = build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=64,
                              num_pages=num_pages, **SPARSE, **extra)
    engine = LLMEngine(cfg)
    prompts = random_prompts(n, LENGTHS, vocab=256, seed=3)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * n
    return engine, run_staggered(engine, prompts, params, arrive_every=3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_all_modes_match_ar(tiny_model_dir, family):
    model_dir = tiny_model_dir(family)
    _, expected = _run(model_dir, "ar", num_pages=120)
    for mode in SPEC_MODES[1:]:
        engine, got = _run(model_dir, mode, num_pages=120)
        assert got == expected, mode
        drafted = engine.stats()["step_kinds"]
        assert any("draft" in k for k in drafted), f"{mode} never drafted"


@pytest.mark.parametrize("mode, refresh", [("aspire", False), ("aspire_fixed", False),
                                           ("specattn", True)])  # fmt: skip
def test_the_refresh_while_drafting_switched_matches_ar(tiny_model_dir, mode, refresh):
    """``SpecConfig.draft_refresh`` against the mode's row: `aspire` with pages chosen at
    verifications only (the bench variant ``norefresh``), specattn with the refresh layer;
    the same tokens as `ar`, and the draft rows' scoring follows the switch."""
    model_dir = tiny_model_dir("llama")
    _, expected = _run(model_dir, "ar", num_pages=120)
    engine, got = _run(model_dir, mode, num_pages=120, draft_refresh=refresh)
    assert got == expected
    worker = engine.executor.worker
    assert worker.cfg.spec.refresh_while_drafting is refresh
    assert worker.step_resources.refresh_while_drafting is refresh


@pytest.mark.parametrize("mode", ["magicdec", "aspire"])
def test_modes_match_ar_under_preemption(tiny_model_dir, mode):
    model_dir = tiny_model_dir("llama")
    _, expected = _run(model_dir, "ar", num_pages=120)
    # no admission headroom, so that requests really are preempted and recomputed
    engine, got = _run(model_dir, mode, num_pages=16, admission_headroom_tokens=0)
    assert got == expected
    assert engine.scheduler.num_preemptions > 0


def test_sparse_lists_are_strict_subsets():
    """The draft rows' page lists really are smaller than the full lists."""
    from aspire_ray.config import SpecConfig
    from aspire_ray.worker.page_policies import TopKPages

    sel = TopKPages(SpecConfig(mode="aspire", **{k: v for k, v in SPARSE.items()
                                                   if k in ("k_min", "recent_pages", "rho")}))
    assert len(sel.select(None, 10)) == 3
    assert sel.select(None, 3) == [0, 1, 2]

"""KV exhaustion: more concurrent long requests than the page pool holds. Requests queue or are
preempted and recomputed; every one completes with the greedy output of an unloaded run, the
pool invariants hold after every step and every page is free at the end."""

from __future__ import annotations

import pytest
from helpers import random_prompts

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config

NUM_REQUESTS, PROMPT_LEN, NEW_TOKENS = 6, 70, 20
# k_min=3 pages with 1 recent page: on ~70-token prompts (5 pages) drafting really is sparse.
# One request needs at most 7 pages (79 + 20 + d_max tokens); a pool of 14 holds two.
SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6)
MAX_STEPS = 5000  # a stuck request fails the test instead of hanging it


def _run(model_dir: str, mode: str, num_pages: int,
         headroom: int | None = None) -> tuple[LLMEngine, dict[str, list[int]]]:  # fmt: skip
    cfg = build_engine_config(model_dir, spec_mode=mode, num_pages=num_pages, page_size=16,
                              max_num_batched_tokens=64, calibrate="off",
                              admission_headroom_tokens=headroom, **SPARSE)  # fmt: skip
    engine = LLMEngine(cfg)
    prompts = random_prompts(NUM_REQUESTS, [PROMPT_LEN - 7, PROMPT_LEN, PROMPT_LEN + 9],
                             vocab=256, seed=11)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):  # all at once: the pool cannot hold them together
        engine.add_request(f"r{i}", prompt, params)
    done: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", out
                done[out.request_id] = out.token_ids
        engine.blocks.check()
    assert not engine.has_unfinished(), f"requests stuck after {MAX_STEPS} steps"
    assert engine.blocks.num_used == 0, "pages leaked"
    assert not engine.requests, "finished requests left behind"
    return engine, done


@pytest.fixture(scope="module")
def unloaded(tiny_model_dir) -> dict[str, list[int]]:
    """Plain greedy outputs with a pool that holds every request at once (no preemption);
    speculative greedy output equals plain greedy output (tests/test_spec_exact.py)."""
    engine, done = _run(tiny_model_dir("llama"), "ar", num_pages=NUM_REQUESTS * 7 + 4)
    assert engine.scheduler.num_preemptions == 0
    return done


@pytest.mark.parametrize("headroom", [0, None], ids=["no-headroom", "headroom"])
@pytest.mark.parametrize("mode", ["ar", "aspire"])
def test_exhausted_pool_completes_exactly(tiny_model_dir, unloaded, mode, headroom):
    # without admission headroom the requests are preempted and recomputed; with it (the
    # default) they wait instead; either way every one completes exactly
    engine, got = _run(tiny_model_dir("llama"), mode, num_pages=14, headroom=headroom)
    assert len(got) == NUM_REQUESTS
    assert all(len(t) == NEW_TOKENS for t in got.values())
    assert got == unloaded
    if headroom == 0:
        assert engine.scheduler.num_preemptions > 0
    if mode == "aspire":
        assert any("draft" in k for k in engine.stats()["step_kinds"]), "never drafted"

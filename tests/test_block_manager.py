"""Page pool invariants: used + free == total, no page owned twice, all pages come back."""

from __future__ import annotations

import random

import pytest
from helpers import random_prompts

from aspire_ray import SamplingParams
from aspire_ray.engine.block_manager import BlockManager, OutOfPagesError
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config


def test_random_alloc_free_keeps_invariants():
    rng = random.Random(0)
    bm = BlockManager(num_pages=50, page_size=16)
    owned: dict[str, list[int]] = {}
    for _ in range(2000):
        owner = f"r{rng.randrange(8)}"
        if rng.random() < 0.55:
            n = rng.randrange(1, 6)
            if bm.can_allocate(n):
                owned.setdefault(owner, []).extend(bm.allocate(owner, n))
            else:
                with pytest.raises(OutOfPagesError):
                    bm.allocate(owner, n)
        elif owned.get(owner):
            k = rng.randrange(1, len(owned[owner]) + 1)
            pages, owned[owner] = owned[owner][-k:], owned[owner][:-k]
            bm.free(owner, pages)
        bm.check()
        assert bm.num_used + bm.num_free == bm.num_pages
        assert bm.num_used == sum(len(v) for v in owned.values())
    for owner, pages in owned.items():
        bm.free(owner, pages)
    bm.check()
    assert bm.num_free == 50


def test_free_of_unowned_page_raises():
    bm = BlockManager(4, 16)
    pages = bm.allocate("a", 2)
    with pytest.raises(RuntimeError):
        bm.free("b", pages)


@pytest.mark.parametrize("mode", ["ar", "aspire"])
def test_abort_at_random_moments_returns_every_page(tiny_model_dir, mode):
    cfg = build_engine_config(tiny_model_dir("llama"), spec_mode=mode, num_pages=40,
                              max_num_batched_tokens=64, k_min=3, recent_pages=1)
    engine = LLMEngine(cfg)
    rng = random.Random(1)
    prompts = random_prompts(12, [3, 40, 90], vocab=256, seed=4)
    live = []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.0,
                                                      ignore_eos=True))
        live.append(f"r{i}")
        for _ in range(rng.randrange(0, 4)):
            for out in engine.step():
                if out.finished:
                    live.remove(out.request_id)
            engine.blocks.check()
        if live and rng.random() < 0.6:
            engine.abort_request(live.pop(rng.randrange(len(live))))
            engine.blocks.check()
    for rid in list(live):
        engine.abort_request(rid)
    engine.step()  # lets the workers drop their state
    engine.blocks.check()
    assert engine.blocks.num_used == 0
    assert not engine.has_unfinished()


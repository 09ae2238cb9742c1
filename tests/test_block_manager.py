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
    bm = BlockManager(num_pages=500, page_size=16)
    owned: dict[str, list[int]] = {}
    for _ in range(2000):
        owner = f"r{rng.randrange(8)}"
        if rng.random() < 0.55:
            n = rng.randrange(1, 6) if rng.random() < 0.8 else rng.randrange(30, 90)
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
    assert bm.num_free == 500


def test_free_of_unowned_page_raises():
    bm = BlockManager(4, 16)
    pages = bm.allocate("a", 2)
    with pytest.raises(RuntimeError):
        bm.free("b", pages)


@pytest.mark.parametrize("n", [2, 3, 200])
def test_a_bad_free_frees_nothing(n):
    bm = BlockManager(3 * n, 16)
    a, b = bm.allocate("a", n), bm.allocate("b", n)
    assert len(set(a) | set(b)) == 2 * n and bm.num_used == 2 * n
    for bad in (a[:-1] + b[-1:], a[:-1] + a[:1], a[:-1] + [3 * n]):
        with pytest.raises(RuntimeError):
            bm.free("a", bad)  # someone else's page, a page twice, no such page
        bm.check()
        assert bm.num_used == 2 * n
    bm.free("a", a)
    bm.free("b", b[::-1])
    bm.check()
    assert bm.num_free == 3 * n


def test_long_and_short_lists_keep_the_lifo_order():
    # pages come back in the order a loop of pops gives, whichever path serves the call
    for n in (5, 100):
        bm = BlockManager(300, 16)
        first = bm.allocate("a", n)
        assert first == list(range(n))
        bm.free("a", first[2:])
        assert bm.allocate("b", 3) == first[-1:-4:-1]


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


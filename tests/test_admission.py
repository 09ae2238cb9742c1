"""Admission keeps room for the running requests' next plan, and preemption takes the request
that is cheapest to recompute (issue 15: at the largest batch, requests were preempted for want
of draft pages and recomputed from their 32k-token prompts). Engine over the FakeExecutor: no
model, the pool invariants checked after every step."""

from __future__ import annotations

import pytest
from fake_executor import FakeExecutor

from aspire_ray import SamplingParams
from aspire_ray.config import SpecConfig
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=2048)  # fmt: skip


def _engine(mode: str, num_pages: int, **kw) -> LLMEngine:
    cfg = build_engine_config("dummy", load_format="dummy", hf_overrides=TINY, spec_mode=mode,
                              calibrate="off", num_pages=num_pages, **kw)  # fmt: skip
    return LLMEngine(cfg, executor=FakeExecutor(cfg, info={"num_pages": num_pages}))


def _run(engine: LLMEngine, prompts: list[int], max_tokens: int) -> dict[str, int]:
    """Requests of these prompt lengths, all added at once -> req_id -> preemptions."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", [(7 * i + j) % 256 for j in range(n)], params)
            for i, n in enumerate(prompts)]  # fmt: skip
    done = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = len(out.token_ids)
        engine.blocks.check()
    assert done == {r.req_id: max_tokens for r in reqs}, "a request did not complete"
    assert engine.blocks.num_used == 0, "pages leaked"
    return {r.req_id: r.metrics.preemptions for r in reqs}


@pytest.mark.parametrize("mode", ["magicdec", "aspire"])
def test_admission_leaves_room_for_the_next_plan(mode):
    # six 200-token prompts (13 pages each) fit the 80-page pool, their 24 new tokens and
    # drafts do not: admitting all six preempts one later; the headroom admits five and lets
    # the sixth wait for a finished request's pages
    growth = SpecConfig(mode=mode).plan_growth_tokens
    engine = _engine(mode, 80)
    assert engine.scheduler.headroom_tokens == growth >= 17
    assert sum(_run(engine, [200] * 6, 24).values()) == 0
    no_headroom = _engine(mode, 80, admission_headroom_tokens=0)
    assert sum(_run(no_headroom, [200] * 6, 24).values()) > 0


def test_headroom_does_not_hold_back_what_fits():
    # 84 pages hold all six requests to the end: every one is admitted at once
    engine = _engine("magicdec", 84)
    _run(engine, [200] * 6, 24)
    assert engine.stats()["step_kinds"].get("prefill", 0) == 1


def test_preemption_takes_the_cheapest_request_to_recompute():
    # a 40-token request admitted first, a 390-token one after it, a pool of exactly their
    # pages and no headroom: when the short one needs a page, it is preempted itself (40
    # tokens to recompute) rather than the newest request (390)
    engine = _engine("ar", 3 + 25, admission_headroom_tokens=0)
    preempted = _run(engine, [40, 390], 20)
    assert preempted["r0"] > 0 and preempted["r1"] == 0


def test_lookahead_pages_go_before_any_request_does():
    # the next plans' lookahead pages (async runs started early) are taken back from requests
    # without a row yet before anyone is preempted for want of a page
    engine = _engine("aspire", 24, admission_headroom_tokens=0)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    a = engine.add_request("a", list(range(1, 101)), params)
    b = engine.add_request("b", list(range(2, 102)), params)
    while a.num_computed < 100 or b.num_computed < 100:  # both prefilled
        engine.step()
    sched, blocks = engine.scheduler, engine.blocks
    exact = blocks.pages_for(b.num_computed + len(b.drafts))
    b.pages += blocks.allocate(b.req_id, blocks.num_free)  # b's lookahead fills the pool
    assert blocks.num_free == 0 and len(b.pages) > exact
    sched._unscheduled = [b]
    need_ctx = blocks.pages_for(len(a.pages) * blocks.page_size + 1) * blocks.page_size
    assert sched._ensure_pages(a, need_ctx)  # a got its page, and nobody was preempted
    assert a in sched.running and b in sched.running and sched._unscheduled == [b]
    assert len(b.pages) == exact and len(a.pages) == blocks.pages_for(need_ctx)
    blocks.check()


def test_prompt_token_ids_are_checked_at_admission():
    # every id an integer in [0, vocab): a clear error, no page taken, no request left behind
    from aspire_ray import InvalidRequestError

    np = pytest.importorskip("numpy")
    engine = _engine("ar", 64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    bad = [[1, 2.0], [1, "2"], [1, None], [1, -1], [1, 256], [[1], 2], [1, 2**70], [True]]
    for i, prompt in enumerate(bad):
        with pytest.raises(InvalidRequestError, match=r"integers in \[0, 256\)"):
            engine.add_request(f"bad{i}", prompt, params)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], params)
    assert not engine.requests and engine.blocks.num_used == 0
    # numpy integers pass as the Python ints they hold (an output must serialize as JSON)
    req = engine.add_request("np", np.arange(5, 37, dtype=np.int32), params)
    assert req.prompt_token_ids == tuple(range(5, 37))
    assert all(type(t) is int for t in req.prompt_token_ids)
    assert engine.add_request("edge", [0, 255], params).prompt_token_ids == (0, 255)

"""gamma = 0 is never absorbing (issue 15, item 1; DESIGN.md §1.5): a request whose target draft
length is 0 still drafts a probe token every ``probe_every`` verifications, so alpha and the
cost model keep learning, and the request drafts again once its text turns predictable."""

from __future__ import annotations

import pytest
from fake_executor import FakeExecutor

from aspire_ray import SamplingParams
from aspire_ray.config import SpecConfig
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.engine.request import Request
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import SamplingSpec
from aspire_ray.spec.cost_model import CostCoefficients, CostModel
from aspire_ray.spec.draft_policy import Action, DraftPolicy

PROBE_EVERY = 16


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ASPIRE_RAY_CACHE", str(tmp_path))


def _engine(seconds=None, calibrate="off", **kw):
    cfg = build_engine_config(
        "dummy",
        load_format="dummy",
        spec_mode="aspire",
        calibrate=calibrate,
        k_min=3,
        recent_pages=1,
        probe_every=PROBE_EVERY,
        # one plan per step: the policy chooses at every verification (an asynchronous run
        # keeps the draft length of its start for all its steps)
        async_steps=1,
        **kw,
    )
    # 32 layers: the refresh layer is 1/32 of a draft row's reads, as in a real model
    fake = FakeExecutor(cfg, num_layers=32, seconds=seconds)
    return LLMEngine(cfg, executor=fake), fake


def _add(engine: LLMEngine, n: int, max_tokens: int, prompt_len: int = 600) -> list[Request]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [
        engine.add_request(f"r{i}", [(7 * i + j) % 256 for j in range(prompt_len)], params)
        for i in range(n)
    ]


def test_policy_probes_every_k_plain_verifications():
    """The trap's coefficients (b_kv = b_tok = 0: c = 1, gamma = 0 for every alpha < 1)."""
    cfg = SpecConfig(mode="aspire", probe_every=4)
    model = CostModel()
    model.coef = CostCoefficients(b_model=1e-2, b_tok=0.0, b_kv=0.0, r2=1.0)
    policy = DraftPolicy(cfg, model, page_size=16, num_layers=24)
    req = Request(
        "r", list(range(3000)), SamplingParams(max_tokens=1000), SamplingSpec(0.0, 0, 1.0, 0), 0.0
    )
    policy.on_admit(req)
    req.verified_once, req.alpha = True, 0.1
    req.alpha_accepted, req.alpha_tried = 0.1 * req.alpha_tried, req.alpha_tried  # (pooled)
    assert model.draft_verify_ratio(64, 500.0, 0, 3000) == 1.0
    actions = []
    for _ in range(20):
        action = policy.decide([req], [16])[0]
        actions.append(action)
        if action == Action.DRAFT:
            req.drafts.append(0)
        else:
            policy.on_verified(req, len(req.drafts), 0)
            req.drafts = []
    v, d = Action.VERIFY, Action.DRAFT
    assert actions == [v, v, v, v, d, v] * 3 + [v, v]
    assert policy.num_probes == 3 and req.alpha < 0.1


@pytest.mark.parametrize("quantum", [1, 4])
def test_trap_still_drafts_now_and_then(quantum):
    """docs/bench_decode_h200.json: every step costs the same, the fit is b_kv = b_tok = 0,
    c = 1, and (without probes) each request drafted once, before its first verification.
    With verify slots (quantum 4, the default) the first round's length moves to a slot, the
    probes do not: one draft each (``DraftPolicy.keeps_its_target``)."""
    engine, fake = _engine(seconds=lambda n, kv: 1e-2, refit_every=8, verify_quantum=quantum)
    fake.accept = False  # low acceptance: alpha falls
    reqs = _add(engine, 4, max_tokens=200)
    while engine.has_unfinished():
        engine.step()
    model = engine.cost_model
    assert model.fitted and model.coef.b_kv == pytest.approx(0, abs=1e-15)
    assert model.coef.b_tok == pytest.approx(0, abs=1e-15)
    assert model.draft_verify_ratio(4, 600.0, 0, 800) == pytest.approx(1.0)  # the trap's fit
    for req in reqs:
        gammas = req.metrics.gamma_history
        # gamma_init before the first verification (on a slot: 2 or 3 drafts, the nearest)
        assert gammas[0] == 3 if quantum == 1 else gammas[0] in (2, 3)
        # ~200 tokens at one per step: a probe every PROBE_EVERY + 2 steps
        assert len(gammas) >= 200 // (PROBE_EVERY + 2) - 1, gammas
        assert set(gammas[1:]) == {1}
    assert engine.stats()["probes"] >= 4 * (200 // (PROBE_EVERY + 2) - 2)


def test_request_recovers_when_acceptance_turns_high():
    # KV-bound steps (calibrated from the fake device at start-up): c ~ 0.2 at these contexts
    engine, fake = _engine(seconds=lambda n, kv: 1e-4 + 1e-6 * n + 1e-6 * kv, calibrate="force")
    reqs = _add(engine, 4, max_tokens=1000)
    fake.accept = False
    for _ in range(80):
        engine.step()
    assert all(engine.policy.target(r, 4) == 0 for r in reqs), [r.alpha for r in reqs]
    assert all(r.plain_verifies > 0 for r in reqs)
    low = [len(r.metrics.gamma_history) for r in reqs]

    fake.accept = True  # the text turns predictable
    for _ in range(80):
        engine.step()
    for req, n in zip(reqs, low, strict=True):
        later = req.metrics.gamma_history[n:]
        assert engine.policy.target(req, 4) > 0, (req.alpha, later)
        assert max(later) >= 2, later  # drafting for real again, not just probing
    assert engine.cost_model.fitted

"""A new request's acceptance prior (``DraftPolicy.prior_alpha``): what the engine's recent
verifications accepted, once they tried a few drafts; ``alpha_init`` before. With alpha_init
alone every request of a fresh batch drafted its first rounds at the prior's length (3-4 drafts
at 0.8) where the text accepted ~0.95 (docs/speculation.md)."""

from __future__ import annotations

import pytest

from aspire_ray import SamplingParams
from aspire_ray.config import SpecConfig
from aspire_ray.engine.request import Request
from aspire_ray.plan import SamplingSpec
from aspire_ray.spec import draft_policy
from aspire_ray.spec.draft_policy import DraftPolicy


def _request(name: str) -> Request:
    return Request(name, list(range(100)), SamplingParams(max_tokens=100),
                   SamplingSpec(0.0, 0, 1.0, 0), 0.0)  # fmt: skip


def test_a_new_request_starts_from_what_the_engine_saw():
    cfg = SpecConfig(mode="aspire", alpha_init=0.8, gamma_init=3)
    policy = DraftPolicy(cfg, None, page_size=16, num_layers=24)
    first = _request("a")
    policy.on_admit(first)
    assert first.alpha == 0.8  # nothing seen yet: the configured prior
    assert first.alpha_accepted == pytest.approx(0.8 * first.alpha_tried)
    # rounds of 8 drafts, 7 accepted (8 tried: the rejected one counts)
    policy.on_verified(first, 8, 7)
    policy.on_admit(second := _request("b"))
    assert second.alpha == 0.8  # 8 drafts tried: too few to go by
    policy.on_verified(first, 8, 7)
    policy.on_verified(first, 8, 7)  # ~24 tried (each round leaves the earlier ones 0.995)
    policy.on_admit(third := _request("c"))
    assert third.alpha == pytest.approx(7 / 8, rel=1e-3)  # the engine's acceptance
    assert third.alpha_accepted == pytest.approx(third.alpha * third.alpha_tried)
    # plain verifications (no drafts) teach it nothing
    policy.on_verified(first, 0, 0)
    assert policy.prior_alpha() == pytest.approx(7 / 8, rel=1e-3)


def test_the_prior_follows_the_traffic_and_stays_below_one():
    policy = DraftPolicy(SpecConfig(mode="aspire"), None, page_size=16, num_layers=24)
    req = _request("a")
    policy.on_admit(req)
    for _ in range(50):
        policy.on_verified(req, 8, 8)  # every draft accepted
    assert policy.prior_alpha() == draft_policy.PRIOR_MAX  # never a promise of every draft
    for _ in range(2000):  # the text turns unpredictable: the prior follows it
        policy.on_verified(req, 4, 0)
    assert policy.prior_alpha() < 0.05

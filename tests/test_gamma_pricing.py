"""`aspire`'s draft lengths priced at each row's margin (``SpecConfig.gamma_pricing`` "marginal",
``DraftPolicy.marginal_gammas``): the batch's throughput maximized jointly.

Invariants: a batch of identical requests gets DESIGN.md §1.5's homogeneous choice; a mixed batch
gets the assignment that a brute-force search over every assignment finds best; a low-alpha
request amid long-context ones still drafts, where the homogeneous price makes it verify."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from aspire_ray import SamplingParams
from aspire_ray.config import SpecConfig
from aspire_ray.engine.request import Request
from aspire_ray.plan import SamplingSpec
from aspire_ray.spec.acceptance import expected_tokens
from aspire_ray.spec.cost_model import CostCoefficients, CostModel
from aspire_ray.spec.draft_policy import DraftPolicy

# Qwen2.5-Coder-0.5B at 32k on an H200 (docs/bench_decode_h200_qwen05b_32k_regcaps_run1.json:
# `aspire`'s fit): 1.35 ms a step, 1.5 us a query token, 3.9 ns a KV token
H200_QWEN = CostCoefficients(b_model=1.35e-3, b_tok=1.5e-6, b_kv=3.9e-9, r2=0.9)


def _policy(pricing: str, d_max: int = 16, coef: CostCoefficients = H200_QWEN) -> DraftPolicy:
    model = CostModel()
    model.coef = coef
    spec = SpecConfig(mode="aspire", gamma_pricing=pricing, d_max=d_max)
    return DraftPolicy(spec, model, page_size=16, num_layers=24, query_tile=9)


def _request(i: int, alpha: float, context: int) -> Request:
    req = Request(f"r{i}", [1] * context, SamplingParams(max_tokens=1000), SamplingSpec(0, 0, 1, 0),
                  0.0)  # fmt: skip
    req.alpha, req.verified_once = alpha, True
    return req


def _throughput(policy: DraftPolicy, reqs: list[Request], gammas) -> float:
    """Tokens a second of a batch whose requests cycle with these draft lengths (the ratio
    ``marginal_gammas`` maximizes), from the policy's own KV reads."""
    coef = policy.cost_model.coef
    gain, seconds = 0.0, coef.b_model
    for req, g in zip(reqs, gammas, strict=True):
        ctx = req.num_tokens
        d = coef.b_tok + coef.b_kv * policy.kv_reads.draft(policy.sparse_tokens(ctx), ctx)
        v = coef.b_tok * (g + 1) + coef.b_kv * policy.kv_reads.full(ctx, g + 1)
        gain += expected_tokens(req.alpha, g) / (g + 1)
        seconds += (g * d + v) / (g + 1)
    return gain / seconds


@pytest.mark.parametrize("context", [2000, 16000, 32000])
@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.87, 0.92, 0.97])
def test_identical_requests_get_the_homogeneous_choice(alpha, context):
    """For B copies of one request the batch's ratio is DESIGN.md §1.5's E(g) / (g T_draft +
    T_verify(g)) over B: the same optimum (compared by value: ties may pick another g)."""
    batch = 16
    reqs = [_request(i, alpha, context) for i in range(batch)]
    marginal = _policy("marginal").marginal_gammas(reqs)
    homogeneous = _policy("homogeneous").cost_optimal_gamma(reqs[0], batch)
    assert len(set(marginal)) == 1
    policy = _policy("marginal")
    assert _throughput(policy, reqs, marginal) == pytest.approx(
        _throughput(policy, reqs, [homogeneous] * batch), rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_mixed_batch_gets_the_best_assignment(seed):
    """Dinkelbach's iteration finds the assignment a search over all (d_max + 1)^B finds."""
    rng = np.random.default_rng(seed)
    reqs = [_request(i, float(rng.uniform(0.2, 0.98)), int(rng.integers(500, 32000)))
            for i in range(4)]  # fmt: skip
    policy = _policy("marginal", d_max=5)
    best = max(_throughput(policy, reqs, gs) for gs in itertools.product(range(6), repeat=4))
    assert _throughput(policy, reqs, policy.marginal_gammas(reqs)) == pytest.approx(best, rel=1e-12)


def test_low_alpha_request_drafts_beside_long_context_ones():
    """One request of alpha 0.5 among 63 of 0.9, all at 32k: its verify row reads 32k tokens of
    KV each step it verifies, which the batch pays in every one of its steps; the homogeneous
    price charges its draft steps a whole b_model and makes it draft fewer tokens."""
    reqs = [_request(0, 0.5, 32000)] + [_request(i, 0.9, 32000) for i in range(1, 64)]
    marginal = _policy("marginal").targets(reqs, [16] * 64)
    homogeneous = _policy("homogeneous").targets(reqs, [16] * 64)
    assert marginal[0] > homogeneous[0] >= 0
    policy = _policy("marginal")
    assert _throughput(policy, reqs, marginal) > _throughput(policy, reqs, homogeneous)


def test_free_steps_and_empty_batches():
    policy = _policy("marginal", coef=CostCoefficients(0.0, 0.0, 0.0, r2=1.0))
    assert policy.marginal_gammas([_request(0, 0.9, 4000)]) == [0]
    assert policy.marginal_gammas([]) == []


def test_settings_are_checked():
    with pytest.raises(ValueError, match="gamma_pricing"):
        SpecConfig(mode="aspire", gamma_pricing="cheapest")
    with pytest.raises(ValueError, match="alpha_estimator"):
        SpecConfig(mode="aspire", alpha_estimator="mean")

"""Scheduler math (DESIGN.md §1.5): acceptance EMA, optimal gamma, cost-model fit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aspire_ray.spec.acceptance import (
    best_gamma,
    expected_speedup,
    expected_tokens,
    optimal_gamma,
    update_alpha,
    update_pooled,
)
from aspire_ray.spec.cost_model import CostModel


def test_gamma_reference_value():
    assert optimal_gamma(alpha=0.9, c=0.1, d_max=16) == 10


def test_gamma_is_zero_when_drafting_costs_as_much_as_verifying():
    assert optimal_gamma(alpha=0.5, c=1.0, d_max=16) == 0


def test_gamma_clamped_by_d_max():
    assert optimal_gamma(alpha=0.99, c=0.001, d_max=16) == 16


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 0.999), st.floats(0.001, 1.5), st.integers(0, 24))
def test_best_gamma_with_one_verify_time_is_optimal_gamma(alpha, c, d_max):
    """Same optimum (up to rounding on exact ties, such as alpha = c at g = 0 and 1)."""
    g = best_gamma(alpha, c * 2e-3, [2e-3] * (d_max + 1))
    best = expected_speedup(alpha, c, optimal_gamma(alpha, c, d_max))
    assert 0 <= g <= d_max
    assert expected_speedup(alpha, c, g) == pytest.approx(best, rel=1e-12)


def test_best_gamma_stops_before_a_second_query_tile():
    """alpha 0.9, drafts a tenth of a verification: 10 drafts when the verification costs the
    same for any count; 8 when a 10th query needs a second tile and so a second KV read."""
    flat = [1.0] * 17
    tiled = [1.0 if g + 1 <= 9 else 2.0 for g in range(17)]
    assert best_gamma(0.9, 0.1, flat) == 10
    assert best_gamma(0.9, 0.1, tiled) == 8
    # 17 queries in two tiles commit fewer tokens per read than 9 in one, even at alpha ~1
    assert best_gamma(0.999, 0.001, flat) == 16 and best_gamma(0.999, 0.001, tiled) == 8
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.5, 1) == pytest.approx(1.5)


def test_alpha_ema_reference_value():
    assert update_alpha(0.9, drafted=3, accepted=1) == pytest.approx(0.82)


def test_alpha_unchanged_without_drafts():
    assert update_alpha(0.9, drafted=0, accepted=0) == 0.9


def test_alpha_full_acceptance_moves_up():
    # a = d = 4: alpha_hat = 4 / min(5, 4) = 1
    assert update_alpha(0.5, drafted=4, accepted=4) == pytest.approx(0.6)


def test_cost_model_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = (2e-3, 3e-5, 4e-8)
    model = CostModel(min_samples=8)
    for _ in range(400):
        n = int(rng.integers(1, 512))
        kv = int(rng.integers(100, 500_000))
        t = truth[0] + truth[1] * n + truth[2] * kv
        model.add_sample(n, kv, t * (1 + rng.normal(0, 0.01)))
    coef = model.fit()
    assert coef.b_model == pytest.approx(truth[0], rel=0.05)
    assert coef.b_tok == pytest.approx(truth[1], rel=0.05)
    assert coef.b_kv == pytest.approx(truth[2], rel=0.05)
    assert coef.r2 > 0.99


def test_cost_model_refits_only_the_per_step_term_when_underdetermined():
    model = CostModel(min_samples=4)
    prior = model.coef
    for _ in range(10):
        model.add_sample(1, 1000, 0.01)  # one point repeated: rank 1
    coef = model.fit()
    assert (coef.b_tok, coef.b_kv) == (prior.b_tok, prior.b_kv)  # the slopes stay the prior's
    assert model.status.startswith("offset: ") and model.predict(1, 1000) == pytest.approx(0.01)


def test_draft_verify_ratio_grows_with_sparse_budget():
    model = CostModel()
    small = model.draft_verify_ratio(batch=16, draft_kv_tokens=512, drafts=4, context_tokens=8192)
    large = model.draft_verify_ratio(batch=16, draft_kv_tokens=4096, drafts=4, context_tokens=8192)
    assert 0 < small < large < 1


@settings(max_examples=300, deadline=None)
@given(st.floats(0.0, 1.0), st.floats(0.0, 2.0), st.integers(1, 64))
def test_optimal_gamma_early_stop_equals_full_scan(alpha, c, d_max):
    from aspire_ray.spec.acceptance import expected_speedup

    values = [expected_speedup(alpha, c, g) for g in range(d_max + 1)]
    assert optimal_gamma(alpha, c, d_max) == values.index(max(values))


@pytest.mark.parametrize("alpha", [0.6, 0.87])
def test_pooled_alpha_is_the_acceptance_rate_where_the_per_round_mean_is_not(alpha):
    """i.i.d. acceptance, rounds of 2-8 drafts: the pooled estimate (accepted over tried) tracks
    alpha; DESIGN.md §1.5's EMA of a / min(a + 1, d) sits 0.1-0.2 below it, since a round
    rejected early weighs as much as a long one."""
    rng = np.random.default_rng(0)
    per_round, (acc, tried) = 0.8, (2.4, 3.0)
    sums = np.zeros(2)
    n = 20000
    for i in range(n):
        d = 2 + i % 7
        draws = rng.random(d) < alpha
        a = d if draws.all() else int(np.argmin(draws))
        per_round = update_alpha(per_round, d, a)
        acc, tried = update_pooled(acc, tried, d, a)
        sums += (per_round, acc / tried)
    mean_per_round, mean_pooled = sums / n
    assert abs(mean_pooled - alpha) < 0.03
    assert mean_per_round < alpha - 0.1


def test_pooled_alpha_reference_values():
    # 3 of 5 accepted: 4 tried (the 4th rejected); a round without drafts changes nothing
    expected = (0.8 * 2.4 + 3, 0.8 * 3 + 4)
    assert update_pooled(2.4, 3.0, drafted=5, accepted=3) == pytest.approx(expected)
    assert update_pooled(2.4, 3.0, drafted=4, accepted=4, ema=0.5) == pytest.approx((5.2, 5.5))
    assert update_pooled(2.4, 3.0, drafted=0, accepted=0) == (2.4, 3.0)

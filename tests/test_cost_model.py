"""The cost model sees what a step costs (issue 15, item 2): draft rows' refresh-layer reads are
a feature, the fit is bounded by physics, a fit that cannot pin down three terms keeps the
prior's slopes and refits the per-step term (or falls back to the prior), the prior is physical
where the bandwidth was measured, the prediction error is tracked by step kind; a fit of all
zeros cannot kill the engine (issue 19)."""

from __future__ import annotations

import numpy as np
import pytest
from fake_executor import TRUE, FakeExecutor

from aspire_ray import SamplingParams
from aspire_ray.config import SpecConfig
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.engine.request import Request
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import RowKind, RowPlan, SamplingSpec
from aspire_ray.spec.cost_model import (
    BOUND_FRACTION,
    KV_READ_FACTOR,
    PRIOR,
    CollectiveCost,
    CostBounds,
    CostCoefficients,
    CostModel,
    KVReads,
)
from aspire_ray.spec.draft_policy import DraftPolicy


def _cfg(mode="aspire", calibrate="off", **kw):
    return build_engine_config(
        "dummy",
        load_format="dummy",
        spec_mode=mode,
        calibrate=calibrate,
        k_min=3,
        recent_pages=1,
        **kw,
    )


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ASPIRE_RAY_CACHE", str(tmp_path))
    return tmp_path


def _drive(engine: LLMEngine, prompts: int = 4, max_tokens: int = 60, stagger: int = 1) -> None:
    """Requests of different prompt lengths arriving ``stagger`` steps apart, run to the end."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = [list(range(1, 100 + 37 * i)) for i in range(prompts)]
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % stagger == 0:
            engine.add_request(f"r{step}", pending.pop(0), params)
        engine.step()
        step += 1
    assert engine.blocks.num_used == 0


# ---- features --------------------------------------------------------------------------------
def test_draft_rows_pay_for_the_refresh_layer():
    reads = KVReads(num_layers=24, refresh_while_drafting=True)
    # 32k context, |S| = 2,304 tokens: 23 sparse layers + the full list read and scored at l_r
    assert reads.draft(2304, 32768) == pytest.approx((23 * 2304 + 1.5 * 32768) / 24)
    assert KVReads(24, refresh_while_drafting=False).draft(2304, 32768) == 2304
    sparse, ctx = np.array([80, 2304]), np.array([1000, 32768])  # the policy prices rows at once
    for refresh in (True, False):
        reads_of = KVReads(24, refresh)
        one_by_one = [reads_of.draft(s, c) for s, c in zip(sparse, ctx, strict=True)]
        assert list(reads_of.draft(sparse, ctx)) == one_by_one
    assert reads.full(32768) == 32768
    # query tiles of 9 tokens (Qwen2.5: 7 q heads per KV head in a 64-row tile): a verify row
    # of up to 9 queries reads its KV once, of 10-18 twice
    tiled = KVReads(24, refresh_while_drafting=True, query_tile=9)
    assert [tiled.full(1000, q) for q in (1, 9, 10, 18, 19)] == [1000, 1000, 2000, 2000, 3000]
    assert reads.full(1000, 17) == 1000  # no tiles (the torch reference): one read
    with pytest.raises(ValueError, match="query_tile"):
        KVReads(24, True, query_tile=0)

    # context 1000: 63 pages, |S| = max(k_min 3, ceil(0.07 * 63)) = 5 pages = 80 tokens
    rows = [
        RowPlan("a", RowKind.DRAFT, [0], 999, 0, []),
        RowPlan("b", RowKind.VERIFY, [0, 0, 0], 500, 0, [], num_drafts=2),
        RowPlan("c", RowKind.PREFILL, [0] * 64, 0, 0, []),
    ]
    refreshed = (3 * 80 + 1.5 * 1000) / 4
    for mode, draft_kv in (
        ("aspire", refreshed),
        ("magicdec", 80.0),
        ("specattn", 80.0),
        ("aspire_fixed", refreshed),
    ):
        policy = DraftPolicy(SpecConfig(mode=mode, k_min=3, recent_pages=1), None, 16, 4)
        assert policy.step_features(rows) == (68, pytest.approx(draft_kv + 503 + 64)), mode
    # a 3-query verify row in query tiles of 2 tokens reads its 503 tokens twice
    policy = DraftPolicy(SpecConfig(mode="magicdec", k_min=3, recent_pages=1), None, 16, 4, 2)
    assert policy.step_features(rows) == (68, pytest.approx(80.0 + 2 * 503 + 64))


def test_cost_optimal_gamma_sees_query_tiles():
    """Coefficients of Qwen2.5-Coder-0.5B at 32k on an H200 (b_kv ~ 0.75 TB/s-equivalent of
    its 12 KiB per token): the no-tile model drafts 10 at alpha 0.97; with tiles of 9 query
    tokens (a 10th query reads the 32k KV once more) it stops at 8."""
    coef = CostCoefficients(b_model=1.5e-3, b_tok=2e-6, b_kv=3.3e-9, r2=0.99)
    gammas = []
    for tile in (None, 9):
        model = CostModel()
        model.coef = coef
        policy = DraftPolicy(SpecConfig(mode="aspire"), model, 16, 24, tile)
        req = Request("r", [1] * 32000, SamplingParams(max_tokens=100), SamplingSpec(0, 0, 1, 0),
                      0.0)  # fmt: skip
        req.alpha, req.verified_once = 0.97, True
        gammas.append(policy.cost_optimal_gamma(req, batch=64))
    assert gammas == [10, 8]
    model.coef = CostCoefficients(0.0, 0.0, 0.0, r2=1.0)  # steps priced free: no division by 0
    assert policy.cost_optimal_gamma(req, batch=64) == 0


# ---- physics bounds --------------------------------------------------------------------------
def test_bounds_from_start_up_measurements():
    # Qwen2.5-Coder-0.5B on an H200: 12 KiB of KV per token, ~1 GB of weights, ~4 TB/s
    b = CostBounds.from_device(kv_bytes_per_token=12288, weight_bytes=1e9, bandwidth=4e12)
    assert b.b_kv == pytest.approx(BOUND_FRACTION * 12288 / 4e12)
    assert b.b_model == pytest.approx(BOUND_FRACTION * 1e9 / 4e12)
    assert b.b_tok == 0
    assert CostBounds.from_device(12288, 1e9, None) == CostBounds()  # not measured (CPU)
    # the prior obeys the bounds too
    model = CostModel(prior=CostCoefficients(1e-6, 1e-7, 1e-12), bounds=b)
    assert model.coef.b_kv == b.b_kv and model.coef.b_model == b.b_model


def test_fit_is_bounded_below_by_physics():
    """Noise that hides the KV term (the unconstrained fit says b_kv = 0) cannot make KV free."""
    rng = np.random.default_rng(0)
    bounds = CostBounds(b_model=1e-4, b_kv=1e-10)
    model = CostModel(bounds=bounds)
    free = CostModel()
    for _ in range(200):
        n = int(rng.integers(1, 512))
        kv = float(rng.integers(1000, 400_000))
        t = 4e-3 + 2e-6 * n + rng.normal(0, 2e-5) - 1e-10 * kv  # an (unphysical) negative slope
        model.add_sample(n, kv, t)
        free.add_sample(n, kv, t)
    assert free.fit().b_kv == 0 and free.fitted
    coef = model.fit()
    assert model.fitted, model.status
    assert coef.b_kv == pytest.approx(bounds.b_kv)
    assert coef.b_model >= bounds.b_model and coef.b_tok == pytest.approx(2e-6, rel=0.05)


def test_engine_takes_bounds_from_the_workers_description():
    cfg = _cfg(calibrate="force")
    info = {"kv_bytes_per_token": 12288, "weight_bytes": 1e9, "memory_bandwidth": 4e12}
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg, info=info))
    assert engine.cost_model.bounds == CostBounds.from_device(12288, 1e9, 4e12)
    assert engine.stats()["cost_model"]["bounds"]["b_kv"] == pytest.approx(
        BOUND_FRACTION * 12288 / 4e12
    )
    # the fake device's truth is above the bounds: the calibrated fit recovers it exactly
    c = engine.cost_model.coef
    assert (c.b_model, c.b_tok, c.b_kv) == pytest.approx(TRUE, rel=1e-6)


# ---- poor fits fall back to the calibrated prior ------------------------------------------
def _calibrated() -> CostModel:
    model = CostModel(min_samples=8)
    model.set_prior(CostCoefficients(2e-3, 5e-5, 3e-7, r2=0.99, samples=40))
    return model


def test_poor_fit_falls_back_to_the_calibrated_prior():
    rng = np.random.default_rng(1)
    model = _calibrated()
    for _ in range(100):  # many shapes, but the times are noise
        model.add_sample(
            int(rng.integers(1, 512)),
            float(rng.integers(100, 500_000)),
            float(rng.uniform(1e-3, 1e-2)),
        )
    assert model.fit() == model.prior and model.status.startswith("prior: r2")
    assert model.fallbacks == 1 and not model.fitted


def test_too_few_shapes_or_collinear_features_fall_back():
    # a steady `ar` batch: one shape over and over (the trap's window)
    model = _calibrated()
    for i in range(64):
        model.add_sample(64, 64 * (8192 + i), 0.02 + 1e-6 * i)
    assert model.fit() == model.prior and "distinct step shapes" in model.status
    # a draining `ar` batch: n_tokens = B and kv_tokens ~ B * 8192: b_tok and b_kv trade off
    model = _calibrated()
    for i, b in enumerate(range(64, 0, -1)):
        model.add_sample(b, b * (8192 + i), 2e-3 + 1e-5 * b)
    assert model.fit() == model.prior and "ill-conditioned" in model.status


def test_good_fit_replaces_the_prior():
    rng = np.random.default_rng(2)
    model = _calibrated()
    truth = CostCoefficients(3e-3, 2e-5, 5e-8)
    for _ in range(64):
        n, kv = int(rng.integers(1, 512)), float(rng.integers(100, 500_000))
        model.add_sample(n, kv, truth.predict(n, kv) * (1 + rng.normal(0, 0.01)))
    coef = model.fit()
    assert model.status == "fit" and coef.r2 > 0.99
    assert coef.b_kv == pytest.approx(truth.b_kv, rel=0.05)


# ---- offset fits: one serving shape pins down the per-step term -----------------------------
def test_steady_batch_refits_the_per_step_term_on_the_prior_slopes():
    # a serving batch repeats one step shape: three terms are not identifiable, but its
    # overhead is (the calibrated prior came from steps that each paid a host round trip)
    model = _calibrated()  # prior (2e-3, 5e-5, 3e-7)
    truth = CostCoefficients(4.5e-3, 5e-5, 3e-7)
    for i in range(40):
        n, kv = 120, 540_000.0 + i
        model.add_sample(n, kv, truth.predict(n, kv))
    coef = model.fit()
    assert model.status.startswith("offset: ") and "distinct step shapes" in model.status
    assert not model.fitted and model.fallbacks == 1
    assert (coef.b_tok, coef.b_kv) == (model.prior.b_tok, model.prior.b_kv)
    assert coef.b_model == pytest.approx(truth.b_model, rel=1e-6)
    assert model.predict(120, 540_000.0) == pytest.approx(truth.predict(120, 540_000.0))
    # a step that captured its CUDA graphs (seconds) does not move the per-step term
    model.add_sample(120, 540_000.0, 2.5)
    assert model.fit().b_model == pytest.approx(truth.b_model, rel=1e-6)


def test_offset_fit_uses_only_steps_measured_since_the_prior():
    model = CostModel(min_samples=8)
    for i in range(50):  # the start-up sweep's steps: 9 ms of host round trip each
        model.add_sample(8, 1000.0 * (i % 5 + 1), 9e-3)
    model.set_prior(CostCoefficients(9e-3, 1e-6, 1e-9))
    for _ in range(3):  # served steps: 3 ms over the same slopes
        model.add_sample(64, 200_000.0, 3e-3 + 64e-6 + 2e-4)
    assert model.fit().b_model == pytest.approx(3e-3) and model.status.startswith("offset")
    # slopes that alone over-predict the steps cannot be offset: the prior stays
    model.set_prior(CostCoefficients(1e-3, 1e-6, 1e-7))  # 20 ms of KV for a 3 ms step
    for _ in range(3):
        model.add_sample(64, 200_000.0, 3e-3)
    assert model.fit() == model.prior and model.status.startswith("prior: ")


def test_physical_prior_where_the_bandwidth_was_measured():
    b = CostBounds.from_device(kv_bytes_per_token=12288, weight_bytes=1e9, bandwidth=4e12)
    prior = CostModel(bounds=b).prior
    assert prior.b_kv == pytest.approx(KV_READ_FACTOR * 12288 / 4e12)
    assert prior.b_model == pytest.approx(1e9 / 4e12) and prior.b_tok == 0
    assert CostModel().prior == PRIOR  # nothing measured (CPU): the built-in prior


# ---- tensor parallelism: the all-reduces measured on the TP group ---------------------------
# Qwen3-8B's shape at TP=2 on NVLink (assumed): 36 layers, ~12 us a call, 16 KB (4096 bf16) of
# activations a token at ~200 GB/s
TP2 = CollectiveCost.from_all_reduce(num_layers=36, latency=12e-6, per_token=16384 / 200e9)


def test_collective_term_counts_every_all_reduce():
    # 2 all-reduces a layer + the embedding's carry tokens; the LM head's all-gather adds a call
    assert TP2.per_step == pytest.approx(74 * 12e-6)
    assert TP2.per_token == pytest.approx(73 * 16384 / 200e9)
    assert CollectiveCost.from_all_reduce(36, 0.0, 0.0) == CollectiveCost()  # TP=1


def test_bounds_and_priors_grow_by_the_collectives():
    one = CostBounds.from_device(12288, 8e9, 4e12)
    two = CostBounds.from_device(6144, 4e9, 4e12, TP2)  # each shard: half the KV and weights
    assert two.b_model == pytest.approx(BOUND_FRACTION * (4e9 / 4e12 + TP2.per_step))
    assert two.b_tok == pytest.approx(BOUND_FRACTION * TP2.per_token) and one.b_tok == 0
    assert two.b_kv == pytest.approx(one.b_kv / 2)
    p1, p2 = one.physical_prior(), two.physical_prior()
    assert p2.b_model == pytest.approx(p1.b_model / 2 + TP2.per_step)
    assert p2.b_tok == pytest.approx(TP2.per_token) and p1.b_tok == 0
    # no bandwidth (a CPU gloo group): the collectives alone bound, and add to the prior
    cpu = CostBounds.from_device(None, None, None, TP2)
    assert (cpu.b_model, cpu.b_tok, cpu.b_kv) == pytest.approx(
        (BOUND_FRACTION * TP2.per_step, BOUND_FRACTION * TP2.per_token, 0.0))
    prior = CostModel(bounds=cpu).prior
    assert (prior.b_model, prior.b_tok, prior.b_kv) == pytest.approx(
        (PRIOR.b_model + TP2.per_step, PRIOR.b_tok + TP2.per_token, PRIOR.b_kv))
    assert CostModel(bounds=CostBounds.from_device(None, None, None, CollectiveCost())).prior \
        == PRIOR  # fmt: skip


def test_online_fit_cannot_undercut_the_collectives():
    """Steps whose query tokens look cheaper than their all-reduces allow (noise, a slow
    all-reduce measurement) are refitted with each token paying at least its bound."""
    rng = np.random.default_rng(4)
    model = CostModel(bounds=CostBounds.from_device(6144, 4e9, 4e12, TP2))
    free = CostModel()
    for _ in range(200):
        n, kv = int(rng.integers(1, 512)), float(rng.integers(1000, 400_000))
        t = 4e-3 + 0.6 * TP2.per_token * n + 2e-9 * kv + rng.normal(0, 2e-5)
        model.add_sample(n, kv, t)
        free.add_sample(n, kv, t)
    assert free.fit().b_tok == pytest.approx(0.6 * TP2.per_token, rel=0.05)
    coef = model.fit()
    assert model.fitted, model.status
    assert coef.b_tok == pytest.approx(BOUND_FRACTION * TP2.per_token)
    assert coef.b_model >= BOUND_FRACTION * (1e-3 + TP2.per_step)
    summary = model.summary()["collective"]
    assert summary == {"per_step": TP2.per_step, "per_token": TP2.per_token}


def test_engine_takes_the_collective_term_from_the_workers_description():
    cfg = _cfg()
    info = {"all_reduce_latency": 12e-6, "all_reduce_per_token": 16384 / 200e9}
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg, num_layers=36, info=info))
    assert engine.cost_model.bounds.collective == TP2
    assert LLMEngine(cfg, executor=FakeExecutor(cfg)).stats()["cost_model"]["collective"] == {
        "per_step": 0.0, "per_token": 0.0}


def test_sweep_that_hides_the_kv_term_takes_the_physical_rate():
    # a GPU sweep of short contexts: per-step overhead and noise, the KV term invisible
    rng = np.random.default_rng(3)
    info = {"kv_bytes_per_token": 12288, "weight_bytes": 1e9, "memory_bandwidth": 4e12}
    cfg = _cfg(calibrate="force")
    engine = LLMEngine(cfg, executor=FakeExecutor(
        cfg, info=info, seconds=lambda n, kv: 3e-3 + 2e-6 * n + rng.uniform(0, 1e-3)))
    model = engine.cost_model
    assert model.status.startswith("prior: sweep with the physical KV rate")
    assert model.prior.b_kv == pytest.approx(KV_READ_FACTOR * 12288 / 4e12)
    assert model.prior.b_model == pytest.approx(3.5e-3, rel=0.2)
    assert engine.calibration is not None and engine.calibration.source == "sweep"


def test_served_runs_refit_the_per_step_term():
    # asynchronous runs of one shape on a device whose slopes the physical prior knows:
    # the online refits (every refit_every decode steps, not plans) learn its overhead
    info = {"kv_bytes_per_token": 12288, "weight_bytes": 1e9, "memory_bandwidth": 4e12}
    b_kv = KV_READ_FACTOR * 12288 / 4e12
    cfg = _cfg(calibrate="off", refit_every=16)
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg, info=info,
                                                  seconds=lambda n, kv: 2e-3 + b_kv * kv))
    engine.cost_model.min_samples = 2
    _drive(engine, prompts=4, max_tokens=60)
    model = engine.cost_model
    assert engine.stats()["step_kinds"]["async"] > 0
    assert model.prior.b_model == pytest.approx(1e9 / 4e12)  # physical: the weights alone
    # the first refit does not wait refit_every steps: the prior of a sweep (or of physics)
    # does not know the served steps' overhead
    lazy = LLMEngine(_cfg(calibrate="off", refit_every=10_000), executor=FakeExecutor(
        cfg, info=info, seconds=lambda n, kv: 2e-3 + b_kv * kv))
    lazy.cost_model.min_samples = 2
    _drive(lazy, prompts=4, max_tokens=60)
    assert lazy.cost_model.coef.b_model == pytest.approx(2e-3), lazy.cost_model.status
    assert model.status.split(":")[0] in ("offset", "fit"), model.status
    assert model.coef.b_model == pytest.approx(2e-3) and model.coef.b_kv == pytest.approx(b_kv)
    assert engine.stats()["cost_model"]["status"] == model.status


# ---- issue 19, defect 2 ----------------------------------------------------------------------
def test_fit_of_all_zeros_does_not_divide_by_zero():
    model = CostModel(min_samples=4)
    for n, kv in ((1, 10), (2, 400), (8, 90), (30, 3000), (64, 70_000), (5, 12), (100, 9e5)):
        model.add_sample(n, kv, 0.0)
    assert model.fit() == PRIOR and model.status == "prior: predicts steps of no cost"
    model.coef = CostCoefficients(0.0, 0.0, 0.0)  # however it got there
    assert (
        model.draft_verify_ratio(batch=8, draft_kv_tokens=100, drafts=3, context_tokens=1000) == 1.0
    )


def test_engine_survives_steps_measured_at_zero_seconds():
    cfg = _cfg(refit_every=4, async_steps=1)  # a sample per step: enough of them to refit
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg, seconds=lambda n, kv: 0.0))
    _drive(engine, max_tokens=40)
    assert engine.healthy and engine.cost_model.fallbacks > 0
    assert engine.cost_model.draft_verify_ratio(4, 100.0, 0, 1000) > 0


def test_verify_row_must_fit_the_token_budget():
    with pytest.raises(ValueError, match=r"d_max \+ 1 \(65.*max_num_batched_tokens \(32\)"):
        _cfg(d_max=64, max_num_batched_tokens=32)
    _cfg(d_max=31, max_num_batched_tokens=32)  # d_max + 1 = 32 fits
    _cfg(mode="ar", d_max=64, max_num_batched_tokens=32)  # `ar` never drafts


# ---- prediction error ------------------------------------------------------------------------
def test_prediction_error_is_tracked_by_step_kind():
    cfg = _cfg(calibrate="force", async_steps=1)  # one plan per step: each kind of its own
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg))
    _drive(engine, prompts=5, max_tokens=50, stagger=3)
    err = engine.stats()["cost_model"]["prediction_error"]
    assert {"draft", "verify", "mixed", "prefill"} <= set(err)
    kinds = engine.stats()["step_kinds"]
    assert err["draft"]["steps"] == kinds["draft"] and err["verify"]["steps"] == kinds["verify"]
    # the calibrated model is the fake device's truth: no error on any kind of step
    for kind, e in err.items():
        assert e["mean_abs"] < 1e-9, kind

    # asynchronous runs: their mean step is a point of the same model (kept as "mixed")
    cfg = _cfg(calibrate="force")
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg))
    _drive(engine, prompts=5, max_tokens=50, stagger=3)
    err = engine.stats()["cost_model"]["prediction_error"]
    assert engine.stats()["step_kinds"]["async"] > 0
    assert err["mixed"]["mean_abs"] < 1e-9

    # the built-in prior is wrong about this device, and the error says by how much
    cfg = _cfg(calibrate="off", refit_every=10_000, async_steps=1)
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg))
    engine.cost_model.min_samples = 10**6  # never refitted
    _drive(engine, prompts=5, max_tokens=50, stagger=3)
    err = engine.stats()["cost_model"]["prediction_error"]
    assert err["verify"]["mean"] > 1.0  # PRIOR's 10 ms per step vs ~2-3 ms measured
    assert err["verify"]["mean_abs"] == pytest.approx(
        err["verify"]["abs_sum"] / err["verify"]["steps"]
    )


def test_prefill_steps_are_priced_but_not_fitted():
    # a prefill chunk's compute-bound attention is not the linear model's: on an H200, 133
    # chunks of 32k prompts in the window refused every fit (r2 0.70)
    cfg = _cfg(calibrate="off", async_steps=1)
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg))
    _drive(engine, prompts=5, max_tokens=50, stagger=3)
    err = engine.stats()["cost_model"]["prediction_error"]
    fitted = sum(e["steps"] for kind, e in err.items() if kind != "prefill")
    assert err["prefill"]["steps"] > 0
    assert engine.cost_model.num_samples == fitted


def test_cpu_worker_describes_its_bytes_and_measures_no_bandwidth(tiny_model_dir):
    cfg = build_engine_config(
        tiny_model_dir("llama"), spec_mode="aspire", num_pages=40, calibrate="off"
    )
    engine = LLMEngine(cfg)
    info = engine.info
    # tiny llama: 4 layers x (K, V) x 2 kv heads x head_dim 16 x fp32
    assert info.kv_bytes_per_token == 4 * 2 * 2 * 16 * 4
    # every weight but the input embedding (256 x 64 fp32), which a step gathers rows of
    params = sum(p.numel() for p in engine.executor.worker.model.parameters())
    assert info.weight_bytes == 4 * (params - 256 * 64)
    assert info.memory_bandwidth is None
    assert engine.cost_model.bounds == CostBounds()

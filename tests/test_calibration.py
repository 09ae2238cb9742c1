"""Start-up calibration of the cost model: the sweep recovers known coefficients, its plans are
valid and leave nothing behind, the fit is cached per deployment and reused."""

from __future__ import annotations

import json

import pytest
from fake_executor import TRUE, FakeExecutor

from aspire_ray.engine.calibration import CPU_SWEEP, cache_path, deployment_key
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.spec.cost_model import PRIOR


def _cfg(mode="aspire", calibrate="auto", **kw):
    return build_engine_config("dummy", load_format="dummy", spec_mode=mode,
                               calibrate=calibrate, k_min=3, recent_pages=1, **kw)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ASPIRE_RAY_CACHE", str(tmp_path))
    return tmp_path


def test_sweep_recovers_known_coefficients_and_cleans_up():
    cfg = _cfg(calibrate="force")
    fake = FakeExecutor(cfg)
    engine = LLMEngine(cfg, executor=fake)
    cal = engine.calibration
    assert cal.source == "sweep" and len(cal.samples) >= 16
    c = engine.cost_model.coef
    for got, want in zip((c.b_model, c.b_tok, c.b_kv), TRUE, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    assert c.r2 == pytest.approx(1.0)
    assert engine.blocks.num_used == 0 and not fake.tables  # pages back, requests dropped
    engine.blocks.check()
    # the sweep spans the features (several batch sizes, contexts and draft lengths)
    ns, kvs = {s[0] for s in cal.samples}, {s[1] for s in cal.samples}
    assert len(ns) >= 4 and len(kvs) >= 4


def test_cache_is_reused_per_deployment(cache_dir):
    cfg = _cfg()
    first = LLMEngine(cfg, executor=FakeExecutor(cfg))
    assert first.calibration.source == "sweep"
    path = cache_path(deployment_key(first))
    assert path.parent == cache_dir / "calibration" and path.exists()
    assert json.loads(path.read_text())["key"]["tp_size"] == 1

    again = FakeExecutor(cfg)
    second = LLMEngine(cfg, executor=again)
    assert second.calibration.source == "cache"
    assert again.calls == 0, "a cached deployment must not re-run the sweep"
    assert second.cost_model.coef == first.cost_model.coef
    # the samples come back too, so the online refits start from a well-posed window
    assert second.cost_model.num_samples == len(first.calibration.samples)

    # another device (or TP degree, dtype, page size, k_min/rho) is another deployment
    other = FakeExecutor(cfg, device_name="other-gpu")
    assert LLMEngine(cfg, executor=other).calibration.source == "sweep" and other.calls > 0
    forced = _cfg(calibrate="force")
    ex = FakeExecutor(forced)
    assert LLMEngine(forced, executor=ex).calibration.source == "sweep" and ex.calls > 0


def test_each_tp_degree_has_its_own_calibration():
    """TP=1 and TP=2 never share a fit: the all-reduces change every coefficient."""
    fits = {}
    for tp in (1, 2, 1, 2):
        cfg = _cfg(tp_size=tp)
        fake = FakeExecutor(cfg, seconds=lambda n, kv, tp=tp: tp * (TRUE[0] + TRUE[1] * n)
                            + TRUE[2] * kv)  # fmt: skip
        engine = LLMEngine(cfg, executor=fake)
        cal = engine.calibration
        assert f"-tp{tp}-" in cal.path
        if tp in fits:  # the second start of a degree loads its own fit
            assert cal.source == "cache" and fake.calls == 0
            assert engine.cost_model.coef == fits[tp]
        else:
            assert cal.source == "sweep" and fake.calls > 0
            fits[tp] = engine.cost_model.coef
    assert fits[2].b_model == pytest.approx(2 * fits[1].b_model, rel=1e-6)


def test_off_and_modes_without_cost_model_skip():
    for cfg in (_cfg(calibrate="off"), _cfg(mode="magicdec")):
        fake = FakeExecutor(cfg)
        engine = LLMEngine(cfg, executor=fake)
        assert engine.calibration is None and fake.calls == 0
        assert engine.cost_model.coef == PRIOR
    with pytest.raises(ValueError, match="calibrate must be one of"):
        _cfg(calibrate="sometimes")


def test_real_cpu_sweep_is_short_and_sane(tiny_model_dir):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = build_engine_config(tiny_model_dir("llama"), spec_mode="aspire", calibrate="force",
                                  k_min=3, recent_pages=1, num_pages=200)
        engine = LLMEngine(cfg)
    finally:
        torch.set_num_threads(threads)
    cal = engine.calibration
    print(f"CPU sweep {cal.seconds:.2f} s, {len(cal.samples)} samples, {cal.coefficients}")
    assert cal.seconds < 10  # ~0.3-1 s on an idle 2-core machine; CPU_SWEEP is sized for < 2 s
    assert len(cal.samples) == sum(len(CPU_SWEEP.batches) * (CPU_SWEEP.draft_steps
                                                             + len(CPU_SWEEP.drafts))
                                   for _ in CPU_SWEEP.contexts)
    # CPU step times of a tiny model are mostly Python overhead and noise: the fit may be
    # refused (r2 below the threshold), and then the prior stays in force
    model = engine.cost_model
    c = model.coef
    assert model.status == "fit" or model.status.startswith("prior: ")
    assert (c.r2 is not None) == model.fitted
    assert c.b_model > 0 and min(c.b_tok, c.b_kv) >= 0
    assert engine.executor.worker.requests == {} and engine.blocks.num_used == 0

"""Tensor parallelism over Ray actors (CPU, gloo): TP=2 equals TP=1 in every spec mode, every rank
selects the same pages, bad head counts fail clearly, a dead worker fails requests fast."""

from __future__ import annotations

import math
import time

import pytest
from helpers import local_ray, random_prompts

from aspire_ray import LLM, SamplingParams
from aspire_ray.config import SPEC_MODES
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.spec.cost_model import BOUND_FRACTION

ray = pytest.importorskip("ray")

# Prompts of 60..150 tokens (4..10 pages of 16); with k_min=3 pages and 1 recent page the
# sparse lists are strict subsets, so drafting really is sparse.
LENGTHS = [60, 150, 100]
SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6)
MAX_NEW = 20
SCORED_MODES = ("specattn", "aspire_fixed", "aspire_fsm", "aspire")  # top-k from page scores


@pytest.fixture(scope="module")
def ray_local():
    # 8 logical CPUs so that several 2-bundle placement groups fit on a 2-core machine
    with local_ray(num_cpus=8):
        yield


def _cfg(model_dir, mode, tp, **extra):
    extra.setdefault("calibrate", "off")
    return build_engine_config(model_dir, spec_mode=mode, tp_size=tp, max_num_batched_tokens=64,
                               num_pages=120, **SPARSE, **extra)


def _run(engine, on_step=None) -> dict[str, list[int]]:
    """Requests arrive one every 2 steps while others decode; returns id -> tokens."""
    prompts = random_prompts(len(LENGTHS), LENGTHS, vocab=256, seed=5)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    pending, done, step = list(enumerate(prompts)), {}, 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", out.error
                done[out.request_id] = out.token_ids
        if on_step is not None:
            on_step()
        engine.blocks.check()
        step += 1
    assert engine.blocks.num_used == 0
    return dict(sorted(done.items()))


# Both transports get the full check: one model each.
TRANSPORT = {"llama": "compiled", "qwen3": "plain"}


@pytest.fixture(scope="module")
def tp2_executor(ray_local, tiny_model_dir):
    """family -> one tp=2 RayExecutor per model, reconfigured per spec mode (starting actors
    costs seconds; rebuilding a tiny model in them costs milliseconds)."""
    from aspire_ray.executor.ray_executor import RayExecutor

    executors = {}

    def get(family: str, cfg):
        if family not in executors:
            executors[family] = RayExecutor(cfg, transport=TRANSPORT[family])
        else:
            executors[family].reconfigure(cfg)
        return executors[family]

    yield get
    for ex in executors.values():
        ex.shutdown()


def _same_scores_on_every_rank(executor, scored: list):
    """After each step: every rank holds bit-identical refresh-layer page scores (they feed the
    top-k page selection, so identical scores mean identical pages on every rank)."""

    def check():
        per_rank = executor.call_ranks("page_scores")
        assert all(r == per_rank[0] for r in per_rank[1:]), "ranks disagree on page scores"
        scored.extend(s for s in per_rank[0].values() if s is not None)

    return check


def _check_collective_term(tp1: LLMEngine, tp2: LLMEngine) -> None:
    """The cost model's collective term is 0 at TP=1 and measured at TP=2, where a shard reads
    its share of the weights; the prediction error by step kind is reported at TP=2."""
    one, two = tp1.stats()["cost_model"], tp2.stats()["cost_model"]
    assert one["collective"] == {"per_step": 0.0, "per_token": 0.0}
    assert tp1.info.all_reduce_latency == tp1.info.all_reduce_per_token == 0.0
    assert two["collective"]["per_step"] > 0 and two["collective"]["per_token"] >= 0
    assert two["bounds"]["b_model"] > one["bounds"]["b_model"]
    # the prior without a calibration (CPU: no bandwidth) is PRIOR plus the collectives
    assert two["prior"]["b_model"] == pytest.approx(
        one["prior"]["b_model"] + two["collective"]["per_step"])
    assert tp2.info.weight_bytes < tp1.info.weight_bytes  # the shard's bytes
    errors = two["prediction_error"]
    assert {"draft", "verify"} <= set(errors) or "mixed" in errors, errors
    assert all(e["steps"] > 0 and math.isfinite(e["mean_abs"]) for e in errors.values())


# llama: 4 q / 2 kv heads (kv heads split); qwen3: 4 q / 1 kv head (kv head replicated, q/k norm)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp2_equals_tp1_every_mode(tiny_model_dir, tp2_executor, family):
    model_dir = tiny_model_dir(family)
    for mode in SPEC_MODES:
        t0 = time.perf_counter()
        tp1_engine = LLMEngine(_cfg(model_dir, mode, tp=1))
        expected = _run(tp1_engine)
        t1 = time.perf_counter()
        cfg = _cfg(model_dir, mode, tp=2)
        executor = tp2_executor(family, cfg)
        assert executor.describe().tp_size == 2 and executor.transport == TRANSPORT[family]
        engine = LLMEngine(cfg, executor=executor)
        scored: list = []
        got = _run(engine, _same_scores_on_every_rank(executor, scored)
                   if mode in SCORED_MODES else None)
        print(f"{family} {mode}: tp1 {t1 - t0:.2f}s tp2 {time.perf_counter() - t1:.2f}s "
              f"{engine.stats()['steps']} steps")
        assert got == expected, f"{family} {mode}: tp=2 differs from tp=1"
        if mode == "aspire":
            _check_collective_term(tp1_engine, engine)
        if mode != "ar":
            assert any("draft" in k for k in engine.stats()["step_kinds"]), f"{mode} never drafted"
        if mode in SCORED_MODES:
            assert scored, f"{mode}: no page scores were ever computed"


@pytest.mark.slow
def test_tp4_equals_tp1(ray_local, tiny_model_dir):
    """TP=4 over 4 gloo ranks (4 q heads: one per rank; 2 kv heads: each replicated twice), in
    ar and aspire: one executor, reconfigured for the second mode (starting 4 actors costs
    seconds)."""
    from aspire_ray.executor.ray_executor import RayExecutor

    model_dir = tiny_model_dir("llama")
    executor = None
    try:
        for mode in ("ar", "aspire"):
            expected = _run(LLMEngine(_cfg(model_dir, mode, tp=1)))
            cfg = _cfg(model_dir, mode, tp=4)
            if executor is None:
                executor = RayExecutor(cfg, transport="plain")
            else:
                executor.reconfigure(cfg)
            assert executor.describe().tp_size == 4
            engine = LLMEngine(cfg, executor=executor)
            checker = _same_scores_on_every_rank(executor, []) if mode in SCORED_MODES else None
            assert _run(engine, checker) == expected, f"{mode}: tp=4 differs from tp=1"
    finally:
        if executor is not None:
            executor.shutdown()


def test_calibration_runs_on_tp2(tiny_model_dir, tp2_executor, tmp_path, monkeypatch):
    monkeypatch.setenv("ASPIRE_RAY_CACHE", str(tmp_path))
    model_dir = tiny_model_dir("llama")
    cfg = _cfg(model_dir, "aspire", tp=2, calibrate="force")
    engine = LLMEngine(cfg, executor=tp2_executor("llama", cfg))
    cal = engine.calibration
    assert cal.source == "sweep" and "-tp2-" in cal.path
    # CPU step times are noisy: a refused fit (r2 below the threshold) keeps the prior
    model = engine.cost_model
    c = model.coef
    assert (c.r2 is not None) == model.fitted and c.b_model > 0 and min(c.b_tok, c.b_kv) >= 0
    # the all-reduce measured on the gloo group at start-up, the same on every rank, bounds
    # every coefficient the sweep's fit or a refit can take (2 calls a layer + embedding)
    info = engine.info
    print(f"all-reduce: {info.all_reduce_latency * 1e6:.1f} us + "
          f"{info.all_reduce_per_token * 1e9:.2f} ns/token; {model.summary()['collective']}")
    assert info.all_reduce_latency > 0 and info.all_reduce_per_token >= 0
    per_rank = engine.executor.measure_all_reduce()
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
    coll = model.bounds.collective
    assert coll.per_step == pytest.approx((2 * info.num_layers + 2) * info.all_reduce_latency)
    assert model.summary()["collective"]["per_step"] == coll.per_step > 0
    assert model.bounds.b_model >= BOUND_FRACTION * coll.per_step
    assert model.bounds.b_tok >= BOUND_FRACTION * coll.per_token
    assert c.b_model >= model.bounds.b_model and c.b_tok >= model.bounds.b_tok
    assert engine.blocks.num_used == 0
    leftover = engine.executor.call_ranks("page_scores")
    assert all(not r for r in leftover), "synthetic requests leaked"


def test_the_engine_stats_carry_each_shard_rss(tiny_model_dir, tp2_executor):
    """stats()["rss_bytes"]: one figure a shard actor ("shard0", "shard1"), each its own
    process's RSS (read here by pid); this process, the engine's, is not among them."""
    import os

    import psutil

    cfg = _cfg(tiny_model_dir("qwen3"), "aspire", tp=2)
    executor = tp2_executor("qwen3", cfg)
    engine = LLMEngine(cfg, executor=executor)
    _run(engine)
    rss = engine.stats()["rss_bytes"]
    pids = executor.call_ranks("__ray_call__", lambda shard: os.getpid())
    assert set(rss) == {"shard0", "shard1"}
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for rank, pid in enumerate(pids):
        assert rss[f"shard{rank}"] == pytest.approx(psutil.Process(pid).memory_info().rss,
                                                    rel=0.25)  # fmt: skip


def test_heads_that_cannot_be_split_fail_clearly(tiny_model_dir):
    overrides = dict(model_type="llama", hidden_size=96, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                     vocab_size=64)
    cfg = build_engine_config("dummy", load_format="dummy", hf_overrides=overrides, tp_size=2,
                              calibrate="off")
    with pytest.raises(ValueError, match=r"3 attention heads cannot be split over tp_size=2"):
        LLMEngine(cfg)


def test_all_reduce_cost_is_zero_on_one_rank():
    import torch

    from aspire_ray.tp import single_rank
    from aspire_ray.tp.collective_cost import AllReduceCost, measure_all_reduce

    got = measure_all_reduce(single_rank(), 64, torch.float32, torch.device("cpu"))
    assert got == AllReduceCost() and got.seconds(100) == 0.0


def test_llm_tp2_end_to_end_then_worker_death_fails_fast(ray_local, tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(2, [40, 70], vocab=256, seed=9)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(spec_mode="aspire", calibrate="off", num_pages=64, **SPARSE)
    expected = [o.token_ids for o in LLM(model_dir, tp_size=1, **kw).generate(prompts, params)]
    llm = LLM(model_dir, tp_size=2, **kw)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(f"pending-{i}", p, SamplingParams(max_tokens=200))
        engine.step()
        ray.kill(engine.executor.actors[1])
        t0 = time.perf_counter()
        outs = [o for _ in range(3) for o in engine.step()]  # the first step that notices
        assert time.perf_counter() - t0 < 10, "a dead worker must not hang the engine"
        assert sorted(o.request_id for o in outs) == ["pending-0", "pending-1"]
        for o in outs:
            assert o.finished and o.finish_reason == "error"
            assert "shard worker" in o.error and "died" in o.error.lower()
        assert not engine.healthy and not engine.has_unfinished()
        assert engine.stats()["healthy"] is False
        with pytest.raises(RuntimeError, match="unhealthy"):
            engine.add_request("late", prompts[0])
    finally:
        llm.shutdown()


def test_idle_worker_death_found_by_the_health_probe(ray_local, tiny_model_dir):
    """No step runs, yet the replica's health probe finds the dead rank: the engine turns
    unhealthy naming it, and a new request fails at once instead of on its first step."""
    import asyncio

    from aspire_ray.serving.async_engine import AsyncLLMEngine
    from aspire_ray.serving.errors import EngineDeadError

    aengine = AsyncLLMEngine(LLMEngine(_cfg(tiny_model_dir("llama"), "ar", tp=2)))
    try:
        aengine.probe_workers()
        assert aengine.healthy  # live idle ranks answer the ping
        ray.kill(aengine.engine.executor.actors[1])
        deadline = time.monotonic() + 10
        while aengine.healthy and time.monotonic() < deadline:
            aengine.probe_workers()
        assert not aengine.healthy and "shard worker rank 1 died" in aengine.error

        async def one_request():
            async for _ in aengine.generate("late", [1, 2, 3], SamplingParams(max_tokens=2)):
                pass

        with pytest.raises(EngineDeadError, match="rank 1 died"):
            asyncio.run(one_request())
    finally:
        aengine.shutdown()


def test_worker_death_under_compiled_graph(tiny_model_dir, tp2_executor):
    """The compiled-graph transport fails as fast as plain calls (runs last: kills its rank)."""
    cfg = _cfg(tiny_model_dir("llama"), "aspire", tp=2)
    executor = tp2_executor("llama", cfg)
    assert executor.transport == "compiled"
    engine = LLMEngine(cfg, executor=executor)
    engine.add_request("a", list(range(1, 90)), SamplingParams(max_tokens=50))
    engine.step()
    ray.kill(executor.actors[0])
    t0 = time.perf_counter()
    outs = engine.step() or engine.step()
    assert time.perf_counter() - t0 < 10
    assert [o.finish_reason for o in outs] == ["error"] and "rank 0 died" in outs[0].error
    assert not engine.healthy


"""Step timings cross the actor boundary typed (issue 19): every StepOutput carries a
StepTimings whose parts add up to its total, and the engine sums them into stats()["timings"],
a plain dict of seconds (benchmarks read it as JSON). A step that was not timed gives the cost
model no sample."""

from __future__ import annotations

import json

import pytest
from fake_executor import FakeExecutor
from helpers import random_prompts

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import StepOutput, StepTimings

WORKER_KEYS = ("prepare", "forward", "sample", "refresh", "total")


def _recording(engine: LLMEngine) -> list[StepOutput]:
    """Every StepOutput the engine gets from its executor from now on."""
    outs, execute = [], engine.executor.execute

    def recording(plan):
        out = execute(plan)
        outs.append(out)
        return out

    engine.executor.execute = recording
    return outs


def _run(engine: LLMEngine, n: int = 3, max_tokens: int = 8) -> None:
    for i, prompt in enumerate(random_prompts(n, [20, 40], vocab=256, seed=5)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                           temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("mode", ["ar", "aspire_fixed"])  # plain steps; chains and rounds too
def test_worker_times_every_step_and_the_engine_sums_them(tiny_model_dir, mode):
    cfg = build_engine_config(tiny_model_dir("llama"), spec_mode=mode, num_pages=120,
                              max_num_batched_tokens=64, k_min=3, recent_pages=1)  # fmt: skip
    engine = LLMEngine(cfg)
    outs = _recording(engine)
    before = dict(engine.stats()["timings"])  # start-up calibration's steps, if any
    _run(engine)
    assert len(outs) >= 2  # a prefill, then decode steps (ar: chains of them)
    for out in outs:
        t = out.timings
        assert isinstance(t, StepTimings) and t.measured
        assert min(t.prepare, t.forward, t.sample, t.refresh) >= 0.0
        assert t.total >= t.forward
        # prepare, forward and sample split the step (refresh is inside the forward)
        assert t.prepare + t.forward + t.sample == pytest.approx(t.total, rel=1e-9, abs=1e-12)
    timings = engine.stats()["timings"]
    assert json.loads(json.dumps(timings)) == timings  # a plain dict of floats
    assert {"schedule", "execute", "commit"} <= timings.keys()
    for key in WORKER_KEYS:
        summed = sum(getattr(out.timings, key) for out in outs)
        assert timings[key] - before.get(key, 0.0) == pytest.approx(summed, rel=1e-9, abs=1e-12)


def test_untimed_steps_give_the_cost_model_no_sample():
    cfg = build_engine_config("dummy", load_format="dummy", spec_mode="aspire", calibrate="off",
                              k_min=3, recent_pages=1)  # fmt: skip

    class Untimed(FakeExecutor):
        def execute(self, plan):
            return StepOutput(plan.step_id, super().execute(plan).results)  # default: untimed

    untimed = LLMEngine(cfg, executor=Untimed(cfg))
    _run(untimed)
    assert untimed.cost_model.num_samples == 0
    assert "total" not in untimed.stats()["timings"]
    assert sum(untimed.stats()["step_seconds"].values()) == 0.0

    timed = LLMEngine(cfg, executor=FakeExecutor(cfg))
    outs = _recording(timed)
    _run(timed)
    assert timed.cost_model.num_samples > 0
    assert all(out.timings.total >= out.timings.forward > 0 for out in outs)
    total = sum(out.timings.total for out in outs)
    assert timed.stats()["timings"]["total"] == pytest.approx(total)
    assert sum(timed.stats()["step_seconds"].values()) == pytest.approx(total)

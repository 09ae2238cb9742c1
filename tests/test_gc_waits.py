"""worker/gc_waits.py: while the worker executes a plan, the garbage collections that come due
wait for its waits on the device (``EngineConfig.gc_at_waits``), where queued GPU work hides
them, instead of falling between two plans (docs/benchmarks.md §8.36: 10-20 ms collections,
GPU gaps of the same length). The GPU side: tests/test_gpu_engine.py."""

from __future__ import annotations

import gc
import weakref

import torch

from aspire_ray import LLM, SamplingParams
from aspire_ray.worker import gc_waits
from aspire_ray.worker.device_result import DeviceResult
from aspire_ray.worker.worker import Worker


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # only the cyclic collector frees it


def _garbage_cycle() -> weakref.ref:
    return weakref.ref(_Cycle())


def test_deferred_turns_automatic_collections_off_and_back():
    assert gc.isenabled()
    with gc_waits.deferred():
        assert not gc.isenabled()
        with gc_waits.deferred():  # a plan inside a plan (the worker's warm-up): one block
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with gc_waits.deferred(enabled=False):  # the switch off: the collector as it was
        assert gc.isenabled()
    gc.disable()  # a process that runs without the collector keeps it off
    try:
        with gc_waits.deferred():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collect_runs_the_due_generations_only_while_deferred():
    thresholds = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # (what an earlier test or library set must not matter)
    try:
        ref = _garbage_cycle()
        assert gc_waits.collect() is None  # not deferred: automatic collections do their work
        with gc_waits.deferred():
            ref = _garbage_cycle()
            assert gc_waits.collect() in (1, 2)  # generation 1 at least: the young cycle freed
            assert ref() is None
            # generation 2 exactly where as many generation-1 collections as its threshold
            # have run since the last one, as the automatic collector would
            seen = set()
            for _ in range(12):
                _garbage_cycle()
                due = 2 if gc.get_count()[2] >= 10 else 1
                assert gc_waits.collect() == due
                seen.add(due)
            assert seen == {1, 2}
    finally:
        gc.set_threshold(*thresholds)


class _Event:
    def __init__(self) -> None:
        self.synced = False

    def synchronize(self) -> None:
        self.synced = True


def test_a_wait_for_the_device_collects_first():
    tokens = torch.arange(6, dtype=torch.int64)
    with gc_waits.deferred():
        ref = _garbage_cycle()
        on_cpu = DeviceResult([tokens])  # computed already: no wait, no collection
        assert on_cpu.wait()[0].tolist() == list(range(6))
        assert ref() is not None
        pending = DeviceResult([tokens])
        pending.event = _Event()  # as on a GPU: the host waits for queued work
        values, _ = pending.wait()
        assert pending.event.synced and values.tolist() == list(range(6))
        assert ref() is None


def test_the_worker_executes_plans_with_collections_deferred(tiny_model_dir, monkeypatch):
    seen = []
    execute = Worker._execute

    def spy(self, plan):
        seen.append(gc.isenabled())
        return execute(self, plan)

    monkeypatch.setattr(Worker, "_execute", spy)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for on in (True, False):
        seen.clear()
        with LLM(model=tiny_model_dir("llama"), calibrate="off", num_pages=64,
                 spec_mode="aspire", gc_at_waits=on) as llm:  # fmt: skip
            assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 4
        assert seen and set(seen) == {not on}
        assert gc.isenabled()

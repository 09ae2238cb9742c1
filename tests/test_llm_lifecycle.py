"""``LLM`` releases what it holds (issue 16, item 6): on ``shutdown()`` (idempotent), on leaving
a ``with`` block, and when garbage-collected; so two ``LLM(tp_size=2)`` made one after the other
in one process both run, on a Ray instance where only one 2-bundle placement group fits."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
from helpers import local_ray, random_prompts, use_eager_graphs

from aspire_ray import LLM, SamplingParams

ray = pytest.importorskip("ray")

KW = dict(spec_mode="ar", calibrate="off", num_pages=64)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
START_TIMEOUT_S = 120  # a tp=2 start takes seconds; waiting on a held group takes forever


@pytest.fixture(scope="module")
def ray_one_group():
    # two logical CPUs: room for exactly one tp=2 group of {CPU: 1} bundles
    with local_ray(num_cpus=2):
        yield


def _held(llm: LLM) -> tuple:
    """(placement group, shard actors) of a tp=2 LLM; no reference to its executor."""
    executor = llm.engine.executor
    assert executor.placement.owned and len(executor.actors) == 2
    return executor.placement.pg, list(executor.actors)


def _assert_released(pg, actors: list, timeout_s: float = 20.0) -> None:
    """The placement group is removed and every shard actor is dead (pings fail)."""
    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout_s
    while placement_group_table(pg)["state"] != "REMOVED":
        assert time.monotonic() < deadline, f"placement group {placement_group_table(pg)}"
        time.sleep(0.1)
    for rank, actor in enumerate(actors):
        while True:
            try:
                ray.get(actor.ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, f"shard actor of rank {rank} is still alive"
            time.sleep(0.1)


def _start(model_dir: str) -> LLM:
    """LLM(tp_size=2), failing (not hanging) if its placement group cannot be placed; on a
    daemon thread, which a failed test leaves behind without waiting for it."""
    result: list = []  # the LLM, or what its start raised

    def start() -> None:
        try:
            result.append(LLM(model_dir, tp_size=2, **KW))
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
            result.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(START_TIMEOUT_S)
    if not result:
        pytest.fail(f"LLM(tp_size=2) did not start in {START_TIMEOUT_S} s")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def test_tp1_context_manager_and_shutdown_twice(tiny_model_dir):
    with LLM(tiny_model_dir("llama"), **KW) as llm:
        assert len(llm.generate([[1, 2, 3]], PARAMS)[0].token_ids) == 6
    assert llm.engine.executor.worker is None  # the model and the KV pool are let go
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], PARAMS)


@pytest.mark.parametrize("mode", ["ar", "aspire"])
def test_tp1_shutdown_frees_the_model_and_the_kv_pool(tiny_model_dir, mode):
    # freed by the shutdown itself, reference cycles and the frozen heap included: the GPU
    # memory can then go back to the device for the next engine (heap.return_device_memory)
    with LLM(tiny_model_dir("llama_2l"), **dict(KW, spec_mode=mode, max_num_seqs=2)) as llm:
        use_eager_graphs(llm.engine, graph_tokens=8)  # captured steps: closures, cycles
        assert len(llm.generate([[1, 2, 3]], PARAMS)[0].token_ids) == 6
        worker = weakref.ref(llm.engine.executor.worker)
        kv = weakref.ref(llm.engine.executor.worker.kv_caches[0])
    assert worker() is None and kv() is None


def test_tp2_context_manager_releases_group_and_actors(ray_one_group, tiny_model_dir):
    prompts = random_prompts(2, [20, 35], vocab=256, seed=3)
    with LLM(tiny_model_dir("llama"), tp_size=2, **KW) as llm:
        assert [len(o.token_ids) for o in llm.generate(prompts, PARAMS)] == [6, 6]
        pg, actors = _held(llm)
    _assert_released(pg, actors)
    llm.shutdown()  # again: nothing left to release, no error
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompts, PARAMS)


def test_a_collected_tp2_llm_leaves_room_for_the_next(ray_one_group, tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(2, [20, 35], vocab=256, seed=4)
    llm = _start(model_dir)
    first = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    pg, actors = _held(llm)  # handles held here: the finalizer, not refcounting, kills them
    del llm
    gc.collect()
    _assert_released(pg, actors)
    with _start(model_dir) as second:
        assert [o.token_ids for o in second.generate(prompts, PARAMS)] == first

"""The engine core (serving/engine_core.py): one call a step carries every add and abort and
returns every output; in a driver actor it serves the tokens of the in-process engine, its
death fails the replica's streams within a second, and the replica's death ends it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import time

import psutil
import pytest
from helpers import local_ray

from aspire_ray import SamplingParams
from aspire_ray.llm import build_engine_config
from aspire_ray.outputs import RequestMetrics, RequestOutput
from aspire_ray.sampling_params import InvalidRequestError
from aspire_ray.serving.async_engine import AsyncLLMEngine
from aspire_ray.serving.engine_core import (
    ActorCore,
    CoreStep,
    DriverPlacementError,
    EngineCore,
    NewRequest,
    _Driver,
)
from aspire_ray.serving.errors import EngineDeadError
from aspire_ray.serving.settings import AppArgs

from .server_utils import wait_until

ENGINE_KW = dict(spec_mode="aspire", num_pages=128, max_num_batched_tokens=256, d_max=4,
                 calibrate="off")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["Hello there", "The quick brown fox", "a"]


def _generate(engine: AsyncLLMEngine, prompts, params) -> list[list[int]]:
    async def one(rid, prompt):
        return [o async for o in engine.generate(rid, prompt, params)][-1].token_ids

    async def run_all():
        return await asyncio.gather(*(one(f"r{i}", p) for i, p in enumerate(prompts)))

    return asyncio.run(run_all())


def test_a_step_carries_a_batch_of_adds_and_aborts(tiny_chat_model):
    core = EngineCore(build_engine_config(tiny_chat_model, **ENGINE_KW))
    try:
        bad = SamplingParams(max_tokens=10**6)  # beyond the context: refused, typed
        first = core.step([NewRequest("a", "Hello there", GREEDY),
                           NewRequest("b", "The quick brown fox", GREEDY),
                           NewRequest("bad", "x", bad)], [])  # fmt: skip
        assert set(first.rejected) == {"bad"}
        assert isinstance(first.rejected["bad"], InvalidRequestError)
        assert {o.request_id for o in first.outputs} <= {"a", "b"} and first.busy
        second = core.step([], ["b"])  # an abort, then one step
        assert "b" not in {o.request_id for o in second.outputs}
        while core.step([], []).busy:
            pass
        assert core.engine.blocks.num_used == 0  # every page back, the aborted one's too
        assert core.dead() is None and second.error is None
    finally:
        core.shutdown()


def test_a_prompt_crosses_the_channel_once(tiny_chat_model):
    """A request's first output carries its prompt token ids, later ones none, and each
    output token crosses once: a step's outputs stay small however long the prompts and the
    outputs (64 x 16k-token prompts: megabytes a step to pickle in the driver and unpickle in
    the replica, the served path's lost 18% on an H200)."""
    core = EngineCore(build_engine_config(tiny_chat_model, **ENGINE_KW))
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        step = core.step([NewRequest("a", "Hello there", params),
                          NewRequest("b", [5, 6, 7, 8], params)], [])  # fmt: skip
        outputs: dict[str, list] = {"a": [], "b": []}
        while True:
            for out in step.outputs:
                outputs[out.request_id].append(out)
            if not step.busy:
                break
            step = core.step([], [])
        for rid, want in (("a", core.engine.tokenize("Hello there")), ("b", [5, 6, 7, 8])):
            first, *rest = outputs[rid]
            assert first.prompt_token_ids == want and rest and rest[-1].finished
            assert all(o.prompt_token_ids == [] for o in rest)
            # and each output token once: the outputs' token ids, joined, are the request's 8
            joined = [t for o in outputs[rid] for t in o.token_ids]
            assert len(joined) == 8 and all(0 < len(o.token_ids) <= 8 for o in rest)
        assert not core._tokens_sent  # nothing kept for finished requests
    finally:
        core.shutdown()


def test_a_step_crosses_as_plain_values_and_unfinished_outputs_without_metrics():
    """A pickled CoreStep (the driver's results to the replica) keeps every output's fields;
    a finished output keeps its metrics, an unfinished one crosses without them (an empty
    RequestMetrics arrives), so that what a step costs to pickle does not grow with the
    requests' histories."""
    def step(history: int) -> CoreStep:
        metrics = RequestMetrics(prompt_tokens=9, verifications=history, accepted=3,
                                 gamma_history=[7] * history, arrival_time=1.5)
        running = RequestOutput("a", [1, 2], [3, 4], "", False, None, metrics)
        done = RequestOutput("b", [], [5], "text", True, "error", metrics, error="shard died")
        return CoreStep([running, done], {"c": ValueError("bad")}, True, {"steps": 4}, None)

    sent = step(history=40)
    got = pickle.loads(pickle.dumps(sent))
    assert isinstance(got, CoreStep) and (got.busy, got.stats, got.error) == (True, {"steps": 4},
                                                                             None)
    assert isinstance(got.rejected["c"], ValueError)
    for mine, theirs in zip(sent.outputs, got.outputs, strict=True):  # every field but metrics
        assert isinstance(theirs, RequestOutput)
        assert dataclasses.replace(theirs, metrics=None) == dataclasses.replace(mine, metrics=None)
    assert got.outputs[1].metrics == sent.outputs[1].metrics  # finished: all of them
    assert got.outputs[0].metrics == RequestMetrics()  # unfinished: none
    # the unfinished output's history does not cross: its bytes grow with the finished one's
    grows = len(pickle.dumps(step(history=1000))) - len(pickle.dumps(step(history=0)))
    finished_only = len(pickle.dumps(step(history=1000).outputs[1].metrics)) - len(
        pickle.dumps(step(history=0).outputs[1].metrics))
    assert grows <= finished_only + 16


def test_the_driver_steps_on_without_being_called(tiny_chat_model):
    """The driver's loop runs every step of a request after one exchange (none waits for the
    replica to call again); the next exchange takes all of their outputs at once, and they
    give the tokens of a core stepped call by call."""
    cfg = build_engine_config(tiny_chat_model, **ENGINE_KW)
    core = EngineCore(cfg)
    try:
        steps = [core.step([NewRequest("a", "Hello there", GREEDY)], [])]
        while steps[-1].busy:
            steps.append(core.step([], []))
        want = [t for step in steps for o in step.outputs for t in o.token_ids]
    finally:
        core.shutdown()
    driver = _Driver()
    driver.start(cfg, None)
    try:
        first = driver.exchange([NewRequest("a", "Hello there", GREEDY),
                                 NewRequest("bad", "x", SamplingParams(max_tokens=10**6))], [])
        assert set(first.rejected) == {"bad"}  # known when the exchange returns
        assert wait_until(lambda: driver.engine.requests == {}, timeout=60)
        rest = driver.exchange([], [])  # every step since the first exchange, merged
        outputs = first.outputs + rest.outputs
        assert len(rest.outputs) > 1 and not rest.busy
        assert outputs[-1].finished and [t for o in outputs for t in o.token_ids] == want
        assert outputs[0].prompt_token_ids and all(not o.prompt_token_ids for o in outputs[1:])
        assert driver.exchange([], []).outputs == []  # idle: returns at once, empty
    finally:
        driver.shutdown()


@pytest.fixture(scope="module")
def ray_instance():
    with local_ray(num_cpus=4) as ray:
        yield ray


def test_driver_actor_gives_the_tokens_of_the_replica_thread(tiny_chat_model, ray_instance):
    from aspire_ray.engine.engine import LLMEngine, load_tokenizer

    cfg = build_engine_config(tiny_chat_model, **ENGINE_KW)
    local = AsyncLLMEngine(LLMEngine(cfg))
    try:
        want = _generate(local, PROMPTS, GREEDY)
    finally:
        local.shutdown()
    remote = AsyncLLMEngine(ActorCore(cfg), tokenizer=load_tokenizer(cfg))
    try:
        assert remote.engine is None  # no engine in this process: it lives in the driver
        assert remote.max_model_len == local.max_model_len
        assert remote.max_request_tokens == local.max_request_tokens
        assert _generate(remote, PROMPTS, GREEDY) == want
        assert remote.stats()["steps"] > 0 and remote.stats()["pages_used"] == 0
        _check_driver_rss(remote, local)
        with pytest.raises(InvalidRequestError):  # a refused add crosses the actor typed
            _generate(remote, ["x"], SamplingParams(max_tokens=10**6))
        assert remote.healthy
    finally:
        remote.shutdown()


def _check_driver_rss(remote: AsyncLLMEngine, local: AsyncLLMEngine) -> None:
    """The driver actor's stats carry its own process's RSS under "driver" (not this
    process's: the replica's, which the metrics read themselves); an in-process core's carry
    none."""
    import ray

    pid = ray.get(remote.core.actor.__ray_call__.remote(lambda driver: os.getpid()))
    rss = remote.stats()["rss_bytes"]
    assert pid != os.getpid() and set(rss) == {"driver"}
    assert rss["driver"] == pytest.approx(psutil.Process(pid).memory_info().rss, rel=0.25)
    assert local.stats()["rss_bytes"] == {}


def test_driver_death_fails_open_streams_within_a_second(tiny_chat_model, ray_instance):
    from aspire_ray.engine.engine import load_tokenizer

    core = ActorCore(core_cfg(tiny_chat_model))
    engine = AsyncLLMEngine(core, tokenizer=load_tokenizer(core_cfg(tiny_chat_model)))
    try:
        async def stream_until_killed():
            params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
            killed_at = None
            with pytest.raises(EngineDeadError):
                async for out in engine.generate("long", "Once upon a time", params):
                    if killed_at is None and len(out.token_ids) >= 2:
                        import ray

                        ray.kill(core.actor)
                        killed_at = time.monotonic()
            return time.monotonic() - killed_at

        assert asyncio.run(stream_until_killed()) < 1.0
        assert not engine.healthy and "step failed" in engine.error
        with pytest.raises(EngineDeadError):  # new requests fail fast, they do not hang
            _generate(engine, ["hi"], GREEDY)
    finally:
        engine.shutdown()


def test_driver_death_while_idle_is_found_by_the_health_probe(tiny_chat_model, ray_instance):
    import ray

    core = ActorCore(core_cfg(tiny_chat_model))
    engine = AsyncLLMEngine(core, tokenizer=None)
    try:
        ray.kill(core.actor)
        assert wait_until(lambda: (engine.probe_workers(), not engine.healthy)[1], timeout=10)
        assert "driver actor died" in engine.error
    finally:
        engine.shutdown()


def test_the_replica_takes_its_driver_with_it(tiny_chat_model, ray_instance):
    """A replica in a placement group of a bundle for itself and one for its driver (the CPU
    form of serve_configs/autoscale.yaml): the driver takes bundle 1's CPU, and ends with the
    replica that owns it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0.5)
    class Replica:  # a stand-in for a Serve replica: it owns the driver it starts
        def __init__(self, cfg):
            self.core = ActorCore(cfg, num_cpus=0.5, bundle=1)

        def driver(self):
            return self.core.actor

    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}], strategy="STRICT_PACK")
    ray.get(pg.ready())
    bundle_1_free = f"CPU_group_1_{pg.id.hex()}"  # listed while any of it is free
    assert wait_until(lambda: bundle_1_free in ray.available_resources())
    try:
        replica = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True),
        ).remote(core_cfg(tiny_chat_model))  # fmt: skip
        driver = ray.get(replica.driver.remote())
        assert ray.get(driver.ping.remote())
        assert wait_until(lambda: bundle_1_free not in ray.available_resources())
        ray.kill(replica)

        def gone() -> bool:
            try:
                ray.get(driver.ping.remote(), timeout=1)
            except ray.exceptions.RayActorError:
                return True
            except ray.exceptions.GetTimeoutError:
                pass
            return False

        assert wait_until(gone, timeout=20)
    finally:
        remove_placement_group(pg)


def test_a_driver_ray_cannot_place_fails_the_replica_in_time(tiny_chat_model, ray_instance):
    """The replica's constructor fails with the driver's resources instead of waiting forever:
    at once where no node can hold the driver, after the timeout where its bundle stays
    taken."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cfg = core_cfg(tiny_chat_model)
    with pytest.raises(DriverPlacementError, match=r"num_gpus=1\) cannot be placed on the"):
        ActorCore(cfg, num_gpus=1)  # beside the replica, on a node without a GPU

    @ray.remote(num_cpus=0.5)
    class Holder:  # something else in the driver's bundle
        def ping(self):
            return True

    @ray.remote(num_cpus=0.5)
    class Replica:
        def start_driver(self, cfg):
            ActorCore(cfg, num_cpus=0.5, bundle=1, placement_timeout_s=2)

    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}], strategy="STRICT_PACK")
    try:
        in_bundle = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i,
                                                      placement_group_capture_child_tasks=True)
                     for i in (0, 1)]  # fmt: skip
        holder = Holder.options(scheduling_strategy=in_bundle[1]).remote()
        assert ray.get(holder.ping.remote())
        replica = Replica.options(scheduling_strategy=in_bundle[0]).remote()
        t0 = time.monotonic()
        with pytest.raises(DriverPlacementError, match=r"not started within 2 s in bundle 1"):
            ray.get(replica.start_driver.remote(cfg))
        assert time.monotonic() - t0 < 30
    finally:
        remove_placement_group(pg)


def core_cfg(model_dir: str):
    return build_engine_config(model_dir, **ENGINE_KW)


def test_a_gpu_driver_gets_the_gpu_bundle_not_the_replica():
    args = AppArgs.model_validate({"engine": {"device": "cuda", "load_format": "dummy"}})
    assert args.deployment.engine_driver == "actor"  # the default
    opts = args.deployment.options(args.engine)
    assert opts["placement_group_bundles"] == [{"CPU": 1}, {"GPU": 1}]
    assert "ray_actor_options" not in opts
    assert args.deployment.driver_placement(args.engine) == {"bundle": 1, "num_gpus": 1,
                                                             "num_cpus": 0}  # fmt: skip
    tp2 = AppArgs.model_validate({"engine": {"device": "cuda", "load_format": "dummy",
                                             "tp_size": 2}})  # fmt: skip
    assert tp2.deployment.driver_placement(tp2.engine) == {"bundle": 0}
    thread = AppArgs.model_validate({"engine": {"device": "cuda", "load_format": "dummy"},
                                     "deployment": {"engine_driver": "replica"}})  # fmt: skip
    assert thread.deployment.options(thread.engine)["ray_actor_options"] == {"num_cpus": 1,
                                                                             "num_gpus": 1}
    with pytest.raises(ValueError, match="driver actor holds the GPU"):
        AppArgs.model_validate({"engine": {"device": "cuda", "load_format": "dummy"},
                                "deployment": {"ray_actor_options": {"num_gpus": 1}}})
    with pytest.raises(ValueError, match="'replica' the replica runs the engine"):  # gpu.yaml's
        AppArgs.model_validate({"engine": {"device": "cuda", "load_format": "dummy"},
                                "deployment": {"engine_driver": "replica",
                                               "ray_actor_options": {"num_cpus": 1},
                                               "placement_group_bundles": [{"CPU": 1},
                                                                           {"GPU": 1}]}})


@pytest.mark.parametrize("bundles,placement", [
    (None, {}),  # no group: beside the replica, nothing reserved
    ([{"CPU": 1}], {"bundle": 0}),  # the replica's own bundle
    ([{"CPU": 0.5}, {"CPU": 0.5}], {"bundle": 1, "num_cpus": 0.5, "num_gpus": 0}),
], ids=["no-group", "one-bundle", "own-bundle"])
def test_a_cpu_driver_takes_the_bundle_after_the_replicas(bundles, placement):
    args = AppArgs.model_validate({"deployment": {"placement_group_bundles": bundles}})
    assert args.deployment.driver_placement(args.engine) == placement


def test_gpu_bundles_on_a_cpu_engine_fail_at_start():
    # Ray never places such a group on CPU-only nodes: serve.run used to wait forever
    with pytest.raises(ValueError, match=r"placement_group_bundles .* reserve a GPU .*'cpu'"):
        AppArgs.model_validate({"engine": {"device": "cpu"}, "deployment": {
            "placement_group_bundles": [{"CPU": 1}, {"GPU": 1}]}})


def test_the_replica_decodes_streamed_text_not_the_step_loop(tiny_chat_model):
    # the step loop decodes no unfinished request's text (host time on the GPU's critical
    # path); the replica decodes it from the token ids; stop strings stay the engine's
    cfg = build_engine_config(tiny_chat_model, **ENGINE_KW)
    core = EngineCore(cfg)
    tok = core.engine.tokenizer
    try:
        out = core.step([NewRequest("a", "Hello there", GREEDY)], []).outputs
        tokens = []
        while not any(o.finished for o in out):
            assert all(o.text == "" for o in out)  # unfinished: no text from the core
            tokens += [t for o in out for t in o.token_ids]
            out = core.step([], []).outputs
        tokens += out[-1].token_ids  # (the core sends each token once)
        assert out[-1].text == tok.decode(tokens, skip_special_tokens=True)
    finally:
        core.engine.shutdown()
    engine = AsyncLLMEngine(EngineCore(cfg).engine)
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def outputs(rid, params):
        return [o async for o in engine.generate(rid, "Hello there", params)]

    try:
        streamed = asyncio.run(outputs("s", free))
        # cumulative token ids rebuilt from the core's new-tokens-only outputs; an output
        # already handed out is never changed after
        lengths = [len(o.token_ids) for o in streamed]
        assert lengths == sorted(set(lengths)) and lengths[-1] == 24
        assert all(o.token_ids == streamed[-1].token_ids[: len(o.token_ids)] for o in streamed)
        texts = [o.text for o in streamed]
        assert len(streamed) > 2 and texts[-2]  # text before the end
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
        assert texts[-1] == tok.decode(streamed[-1].token_ids, skip_special_tokens=True)
        # a stop string: the engine finds it, the replica streams the engine's text
        word = texts[-1][len(texts[-1]) // 2 :].split()[0]
        stopped = asyncio.run(outputs("t", SamplingParams(max_tokens=24, temperature=0.0,
                                                          stop=[word])))  # fmt: skip
        assert stopped[-1].finish_reason == "stop" and word not in stopped[-1].text
        assert texts[-1].startswith(stopped[-1].text)
    finally:
        engine.shutdown()

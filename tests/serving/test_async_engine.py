"""AsyncLLMEngine: the engine thread streams outputs to asyncio consumers, aborts requests whose
consumer goes away (pages back to the pool), and fails everything clearly when a step raises."""

from __future__ import annotations

import asyncio

import pytest

from aspire_ray import LLM, SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.executor.base import WorkerDiedError
from aspire_ray.llm import build_engine_config
from aspire_ray.sampling_params import InvalidRequestError
from aspire_ray.serving.async_engine import AsyncLLMEngine
from aspire_ray.serving.engine_core import EngineCore
from aspire_ray.serving.errors import EngineDeadError

from .server_utils import fail_after, wait_until

ENGINE_KW = dict(spec_mode="aspire", num_pages=128, max_num_batched_tokens=256, d_max=4,
                 calibrate="off")


def make_engine(model_dir: str) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(build_engine_config(model_dir, **ENGINE_KW)))


async def _collect(engine: AsyncLLMEngine, rid: str, prompt, params) -> list:
    return [out async for out in engine.generate(rid, prompt, params)]


def test_streams_equal_offline_generate(tiny_chat_model):
    prompts = ["Hello there", "The quick brown fox", "a"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_chat_model, **ENGINE_KW)
    offline = llm.generate(prompts, params)
    expected = [o.token_ids for o in offline]
    engine = make_engine(tiny_chat_model)
    try:
        async def run_all():
            return await asyncio.gather(*(_collect(engine, f"r{i}", p, params)
                                          for i, p in enumerate(prompts)))

        streams = asyncio.run(run_all())
    finally:
        engine.shutdown()
    for stream, want, off in zip(streams, expected, offline, strict=True):
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        # the core sends a prompt's ids once; every output the consumer sees has them
        assert all(o.prompt_token_ids == off.prompt_token_ids for o in stream)
        lengths = [len(o.token_ids) for o in stream]
        assert lengths == sorted(lengths)  # cumulative outputs only grow
        assert stream[-1].token_ids == want
        assert stream[-1].finish_reason == "length"


class _QueuedCore(EngineCore):
    """A core whose steps run when collected, in the order submitted (a driver actor's queued
    calls); it records how many calls were submitted and not collected at each collect."""

    pipeline_depth = 2

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        self.queued: list[tuple] = []
        self.in_flight: list[int] = []

    def submit(self, adds, aborts) -> tuple:
        handle = (adds, aborts)
        self.queued.append(handle)
        return handle

    def collect(self, handle: tuple):
        assert self.queued[0] is handle  # in the order submitted
        self.in_flight.append(len(self.queued))
        self.queued.pop(0)
        return self.step(*handle)


def test_a_pipelined_core_has_the_next_step_queued_and_streams_the_same(tiny_chat_model):
    """With a driver actor (pipeline_depth 2) the engine thread queues the next step before it
    waits for the last one, so that the driver never idles while the replica delivers: the
    tokens are those of the in-process engine, aborts still free their pages."""
    prompts = ["Hello there", "The quick brown fox", "a"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_chat_model, **ENGINE_KW).generate(prompts, params)]
    llm_engine = LLMEngine(build_engine_config(tiny_chat_model, **ENGINE_KW))
    core = _QueuedCore(llm_engine)
    engine = AsyncLLMEngine(core, tokenizer=llm_engine.tokenizer)
    try:
        async def run_all():
            return await asyncio.gather(*(_collect(engine, f"r{i}", p, params)
                                          for i, p in enumerate(prompts)))

        streams = asyncio.run(run_all())
        assert [s[-1].token_ids for s in streams] == want
        busy_collects = core.in_flight[:-2]  # the last ones may drain the pipeline
        assert busy_collects and all(n == 2 for n in busy_collects), core.in_flight

        async def consume_then_leave():
            gen = engine.generate("long", "Once upon a time",
                                  SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))
            async for _ in gen:
                break
            await gen.aclose()

        asyncio.run(consume_then_leave())
        assert wait_until(lambda: not core.queued and llm_engine.blocks.num_used == 0
                          and not llm_engine.has_unfinished())
    finally:
        engine.shutdown()
    assert not core.queued


def test_cancelled_consumer_aborts_and_frees_pages(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    try:
        async def consume_then_leave():
            gen = engine.generate("long", "Once upon a time",
                                  SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))
            seen = 0
            async for _ in gen:
                seen += 1
                if seen == 2:
                    break
            await gen.aclose()  # what a disconnecting HTTP client does to the stream
            return seen

        assert asyncio.run(consume_then_leave()) == 2
        assert wait_until(lambda: engine.stats()["pages_used"] == 0 and not engine.engine.requests)
        assert engine.engine.blocks.num_used == 0
        assert not engine.engine.has_unfinished()
        # and the engine keeps serving
        outs = asyncio.run(_collect(engine, "after", "hi", SamplingParams(max_tokens=3,
                                                                           temperature=0.0)))
        assert outs[-1].finished
    finally:
        engine.shutdown()


def test_refused_request_raises_and_engine_keeps_serving(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    try:
        with pytest.raises(InvalidRequestError, match="empty"):
            asyncio.run(_collect(engine, "empty", [], SamplingParams(max_tokens=4)))
        with pytest.raises(InvalidRequestError, match="context"):
            asyncio.run(_collect(engine, "long", "x", SamplingParams(max_tokens=5000)))
        assert engine.healthy
        outs = asyncio.run(_collect(engine, "ok", "hi", SamplingParams(max_tokens=3)))
        assert outs[-1].finished and len(outs[-1].token_ids) <= 3
    finally:
        engine.shutdown()


@pytest.mark.parametrize("error", [RuntimeError, WorkerDiedError])
def test_step_failure_fails_inflight_requests_and_marks_unhealthy(tiny_chat_model, error):
    """A step that raises, or a worker death the engine reports as "error" outputs."""
    engine = make_engine(tiny_chat_model)
    fail_after(engine, 3, error, "GPU fell off the bus")
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

        async def two_requests():
            return await asyncio.gather(_collect(engine, "a", "one", params),
                                        _collect(engine, "b", "two", params),
                                        return_exceptions=True)

        results = asyncio.run(two_requests())
        for r in results:
            assert isinstance(r, EngineDeadError)
            assert "GPU fell off the bus" in str(r)
        assert not engine.healthy
        assert "GPU fell off the bus" in engine.error
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(engine, "c", "three", params))
    finally:
        engine.shutdown()

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
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    engine = make_engine(tiny_chat_model)
    try:
        async def run_all():
            return await asyncio.gather(*(_collect(engine, f"r{i}", p, params)
                                          for i, p in enumerate(prompts)))

        streams = asyncio.run(run_all())
    finally:
        engine.shutdown()
    for stream, want in zip(streams, expected, strict=True):
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        lengths = [len(o.token_ids) for o in stream]
        assert lengths == sorted(lengths)  # cumulative outputs only grow
        assert stream[-1].token_ids == want
        assert stream[-1].finish_reason == "length"


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

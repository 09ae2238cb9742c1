"""Cancellation storms: requests aborted at every moment of their life leave no pages behind
and no request stuck, and the requests after the storm are exact. Engine level (each moment
hit on purpose by inspecting ``engine.requests``) and HTTP level (streaming clients that hang
up at random)."""

from __future__ import annotations

import asyncio
import random
import re

import httpx
from helpers import random_prompts
from serving.server_utils import serving, tiny_args, wait_until

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.engine.request import Request, Status
from aspire_ray.llm import build_engine_config

SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6)
NUM_STORM = 200
MAX_STEPS = 4000
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _engine(model_dir: str, num_pages: int = 32) -> LLMEngine:
    # no admission headroom: requests must really be preempted (one of the abort moments)
    cfg = build_engine_config(model_dir, spec_mode="aspire", num_pages=num_pages, page_size=16,
                              max_num_batched_tokens=64, calibrate="off",
                              admission_headroom_tokens=0, **SPARSE)  # fmt: skip
    return LLMEngine(cfg)


# moment -> "abort now?" for a request the engine still holds
MOMENTS = {
    "mid_prefill": lambda r: r.status == Status.RUNNING and 0 < r.num_computed and r.in_prefill,
    "after_draft": lambda r: r.status == Status.RUNNING and bool(r.drafts),
    "after_verify": lambda r: (r.status == Status.RUNNING and not r.drafts
                               and r.metrics.verifications > 0),
    "preempted": lambda r: r.status == Status.WAITING and r.metrics.preemptions > 0,
}


def _run_fresh(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"fresh{i}", p, GREEDY)
    done = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.blocks.check()
    assert not engine.has_unfinished() and engine.blocks.num_used == 0
    return done


def test_engine_cancellation_storm(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    rng = random.Random(5)
    engine = _engine(model_dir)
    prompts = random_prompts(NUM_STORM, [3, 20, 40, 70], vocab=256, seed=9)
    # Each request gets a moment to die at; "never" ones run to the end, "random" ones die
    # after a random number of steps, "before_prefill" ones right after add_request.
    kinds = ["before_prefill", "random", "never", *MOMENTS]
    target = {f"s{i}": rng.choice(kinds) for i in range(NUM_STORM)}
    deadline = {rid: rng.randrange(1, 12) for rid in target}
    hits = dict.fromkeys(kinds, 0)
    pending = list(enumerate(prompts))
    for _ in range(MAX_STEPS):
        if not pending and not engine.has_unfinished():
            break
        for _ in range(rng.randrange(0, 9)):  # arrivals while others run
            if pending:
                i, prompt = pending.pop(0)
                rid = f"s{i}"
                max_tokens = rng.choice([1, 4, 8, 16])
                engine.add_request(rid, prompt, SamplingParams(
                    max_tokens=max_tokens, temperature=rng.choice([0.0, 0.8]), ignore_eos=True))
                if target[rid] == "before_prefill":
                    engine.abort_request(rid)
                    hits["before_prefill"] += 1
        engine.step()
        engine.blocks.check()
        for rid, req in list(engine.requests.items()):
            kind = target.get(rid)
            check = MOMENTS.get(kind)
            due = kind == "random" and _age(req, deadline, rid)
            if due or (check is not None and check(req)):
                engine.abort_request(rid)
                engine.abort_request(rid)  # a second abort is a no-op
                hits[kind] += 1
        engine.blocks.check()
    assert not pending and not engine.has_unfinished(), f"stuck after {MAX_STEPS} steps"
    assert engine.blocks.num_used == 0, "pages leaked"
    assert not engine.requests
    for kind in kinds:
        if kind not in ("never", "preempted"):  # preemption depends on timing
            assert hits[kind] > 0, f"no request was aborted at {kind}: {hits}"
    engine.abort_request("s0")  # aborting a long-gone request is harmless

    fresh = random_prompts(5, [12, 40, 90], vocab=256, seed=21)
    got = _run_fresh(engine, fresh)
    expected = _run_fresh(_engine(model_dir), fresh)
    assert got == expected


def _age(req: Request, deadline: dict[str, int], rid: str) -> bool:
    deadline[rid] -= 1
    return deadline[rid] <= 0


STREAM_BODY = {"model": "tiny", "prompt": "storm", "stream": True, "temperature": 0.7,
               "ignore_eos": True}


async def _hang_up(client: httpx.AsyncClient, rng: random.Random, path: str) -> str:
    """One streaming client that goes away after a random number of chunks (or none)."""
    body = dict(STREAM_BODY, max_tokens=rng.choice([8, 32, 64]),
                prompt="storm " * rng.randrange(1, 30))
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    keep = rng.choice([0, 1, 2, 5, 1000])
    try:
        async with client.stream("POST", path, json=body,
                                 timeout=httpx.Timeout(30, read=rng.choice([0.01, 30]))) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n >= keep:
                    return "hung up"
            return "finished"
    except httpx.ReadTimeout:
        return "read timeout"


async def _storm(url: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        paths = ["/v1/completions", "/v1/chat/completions"]
        return await asyncio.gather(*(_hang_up(client, rng, rng.choice(paths))
                                      for _ in range(n)))


def _pages_used(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(float(re.search(r"^aspire_kv_pages_used\{[^}]*\} (\S+)$", text, re.M).group(1)))


def test_http_disconnect_storm(tiny_chat_model):
    with serving(tiny_args(tiny_chat_model)) as (_, aengine, live):
        results = asyncio.run(asyncio.wait_for(_storm(live.url, 40, seed=3), timeout=120))
        assert not [r for r in results if r.startswith("status")], results
        assert "hung up" in results
        assert wait_until(lambda: _pages_used(live.url) == 0, timeout=30), _pages_used(live.url)
        assert wait_until(lambda: not aengine.engine.has_unfinished(), timeout=30)
        assert aengine.engine.blocks.num_used == 0
        ok = httpx.post(f"{live.url}/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": "after", "max_tokens": 4})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert aengine.healthy

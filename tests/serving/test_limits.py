"""The configurable caps of ``ServerArgs`` (aspire_ray/serving/limits.py): each one exceeded gives
a 4xx OpenAI error body naming the field, a request right at the cap succeeds, and the
concurrency cap's in-flight count returns to 0 after streams that finish, hang up or fail."""

from __future__ import annotations

import asyncio
import re
import threading

import httpx
import pytest

from .server_utils import fail_after, serving, tiny_args, wait_until

C, CH = "/v1/completions", "/v1/chat/completions"
CAPS = dict(max_prompt_tokens=40, max_output_tokens=8, max_n=2, max_stop_strings=2)
GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
LONG = "y" * 41  # the byte-level tokenizer: one token per byte


@pytest.fixture(scope="module")
def live(tiny_chat_model):
    with serving(tiny_args(tiny_chat_model, **CAPS)) as (_, _, server):
        yield server


def _post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=60)


# (id, path, body, param)
OVER = [
    ("prompt-text", C, {**GOOD, "prompt": LONG}, "prompt"),
    ("prompt-token-ids", C, {**GOOD, "prompt": [65] * 41}, "prompt"),
    ("prompt-one-of-several", C, {**GOOD, "prompt": ["ok", LONG]}, "prompt"),
    ("chat-messages", CH, {**CHAT, "messages": [{"role": "user", "content": LONG}]},
     "messages"),
    ("max-tokens", C, {**GOOD, "max_tokens": 9}, "max_tokens"),
    ("chat-max-tokens", CH, {**CHAT, "max_tokens": 9}, "max_tokens"),
    ("chat-max-completion-tokens", CH, {**CHAT, "max_tokens": None,
                                        "max_completion_tokens": 9}, "max_completion_tokens"),
    ("n", C, {**GOOD, "n": 3}, "n"),
    ("n-times-prompts", C, {**GOOD, "n": 2, "prompt": ["a", "b"]}, "n"),
    ("chat-n", CH, {**CHAT, "n": 3}, "n"),
    ("stop-strings", C, {**GOOD, "stop": ["a", "b", "c"]}, "stop"),
    ("chat-stop-strings", CH, {**CHAT, "stop": ["a", "b", "c"]}, "stop"),
]


@pytest.mark.parametrize("name,path,body,param", OVER, ids=[c[0] for c in OVER])
def test_over_a_cap_names_the_field(live, name, path, body, param):
    r = _post(live, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert "this server's limit" in err["message"], err


def test_right_at_every_cap_succeeds(live):
    body = {**GOOD, "prompt": "z" * 40, "max_tokens": 8, "n": 2, "stop": ["\x00", "\x01"],
            "ignore_eos": True}
    r = _post(live, C, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 40
    assert r.json()["usage"]["completion_tokens"] == 16  # 2 choices of 8


@pytest.mark.parametrize("path,body", [(C, {**GOOD, "max_tokens": ...}),
                                       (C, {**GOOD, "max_tokens": None}),
                                       (CH, {**CHAT, "max_tokens": ...})],
                         ids=["completions-default-16", "completions-null", "chat-default"])
def test_unset_max_tokens_is_capped_not_refused(live, path, body):
    body = {k: v for k, v in body.items() if v is not ...}
    r = _post(live, path, {**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == CAPS["max_output_tokens"]


def _in_flight(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(float(re.search(r"^aspire_http_requests_in_flight\{[^}]*\} (\S+)$", text,
                               re.M).group(1)))


STREAM = {"model": "tiny", "prompt": "long", "max_tokens": 600, "stream": True,
          "temperature": 0, "ignore_eos": True}
CHAT_STREAM = {**{k: v for k, v in STREAM.items() if k != "prompt"},
               "messages": [{"role": "user", "content": "x"}]}


async def _over_the_concurrency_cap(url: str, steps: threading.Semaphore) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        # Slot 1: a stream that has started but cannot finish (the engine gets 20 steps).
        steps.release(20)
        async with client.stream("POST", C, json=STREAM) as a:
            lines = a.aiter_lines()  # kept: a dropped iterator would close the connection
            assert a.status_code == 200 and await anext(lines)
            # Slot 2: a chat stream still waiting for its first output.
            b = asyncio.create_task(client.post(CH, json=CHAT_STREAM))
            assert await asyncio.to_thread(wait_until, lambda: _in_flight(url) == 2, 30)
            for path, body in ((C, GOOD), (CH, CHAT)):
                r = await client.post(path, json=body)
                assert r.status_code == 429, r.text
                assert r.headers["retry-after"] == "1"
                err = r.json()["error"]
                assert err["code"] == "rate_limit_exceeded" and "at most 2" in err["message"]
            # Other endpoints are not generation requests and are not capped.
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/v1/models")).status_code == 200
            b.cancel()  # hangs up before its first chunk; `a` hangs up mid-stream below
        steps.release(10_000)
        # Both slots come back once the server has seen the clients go.
        assert await asyncio.to_thread(wait_until, lambda: _in_flight(url) == 0, 30)
        # Refused and failed requests do not hold a slot either.
        for body in ({**GOOD, "max_tokens": 9}, {**GOOD, "model": "nope"}, GOOD):
            await client.post(C, json=body)
        assert _in_flight(url) == 0
        r = await client.post(C, json=GOOD)
        assert r.status_code == 200, r.text


def test_concurrency_cap_gives_429_and_releases_every_slot(tiny_chat_model):
    args = tiny_args(tiny_chat_model, max_concurrent_requests=2)
    with serving(args) as (_, aengine, live):
        execute, steps = aengine.engine.executor.execute, threading.Semaphore(0)

        def held(plan):  # each engine step takes a permit: the test decides how far it gets
            steps.acquire(timeout=60)
            return execute(plan)

        aengine.engine.executor.execute = held
        try:
            asyncio.run(asyncio.wait_for(_over_the_concurrency_cap(live.url, steps), 120))
        finally:
            steps.release(10_000)
        assert wait_until(lambda: aengine.stats()["pages_used"] == 0, timeout=30)


def test_slot_released_when_the_engine_fails_mid_stream(tiny_chat_model):
    args = tiny_args(tiny_chat_model, max_concurrent_requests=1)
    with serving(args) as (_, aengine, live):
        fail_after(aengine, 3)
        with httpx.stream("POST", live.url + C, json=STREAM, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"engine_unhealthy"' in lines[-2] and lines[-1] == "data: [DONE]"
        assert _in_flight(live.url) == 0
        # the slot is free: the next request reaches the (dead) engine, a 503 not a 429
        assert _post(live, C, GOOD).status_code == 503
        assert _in_flight(live.url) == 0

"""The HTTP server on a tiny random model, driven with the official ``openai`` client:
completions and chat, streamed and not, stop strings, n, concurrency, disconnects, API keys."""

from __future__ import annotations

import asyncio
import re
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aspire_ray.serving.metrics import ServingMetrics

from .server_utils import fail_after, serving, tiny_args, wait_until

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with serving(tiny_args(tiny_chat_model)) as (app, engine, live):
        yield engine, live


@pytest.fixture(scope="module")
def client(server):
    _, live = server
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def test_completion_streamed_equals_unstreamed(client):
    full = client.completions.create(model="tiny", prompt="Hello world", max_tokens=24, **GREEDY)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert choice.index == 0 and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.prompt_tokens == len(b"Hello world")  # byte-level tokenizer
    assert full.usage.total_tokens == 24 + full.usage.prompt_tokens

    chunks = list(client.completions.create(model="tiny", prompt="Hello world", max_tokens=24,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_chat_streamed_equals_unstreamed(client, tiny_chat_model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                          **GREEDY)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 16
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))

    stream = client.chat.completions.create(model="tiny", messages=messages,
                                            max_completion_tokens=16, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_output(client):
    full = client.completions.create(model="tiny", prompt="Stop test", max_tokens=40, **GREEDY)
    text = full.choices[0].text
    # a two-character ASCII stop string from the middle of the greedy output
    match = re.search(r"[ -~]{2}", text[3:])
    assert match, f"no ASCII pair in {text!r}"
    stop = match.group(0)
    want = text[: text.find(stop)]
    for stream in (False, True):
        res = client.completions.create(model="tiny", prompt="Stop test", max_tokens=40,
                                        stop=[stop, "\x00never"], stream=stream, **GREEDY)
        if stream:
            chunks = list(res)
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = res.choices[0].text, res.choices[0].finish_reason
        assert got == want and reason == "stop"


def test_n_and_seed(client):
    kw = dict(model="tiny", prompt="Sample me", max_tokens=12, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # choice i samples with seed + i
    assert a.usage.completion_tokens == 36
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
                for i in range(3)]
    assert streamed == [c.text for c in a.choices]


def test_several_prompts(client):
    prompts = ["first prompt", "second"]
    res = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, n=2, **GREEDY)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model="tiny", prompt=p, max_tokens=5, **GREEDY)
               .choices[0].text for p in prompts]
    assert [c.text for c in res.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert res.usage.prompt_tokens == sum(len(p.encode()) for p in prompts)


def test_sixteen_concurrent_streams(client, server):
    _, live = server
    prompts = [f"client {i} says" + " hi" * (i % 5) for i in range(16)]
    expected = [client.completions.create(model="tiny", prompt=p, max_tokens=20, **GREEDY)
                .choices[0].text for p in prompts]

    async def one(ac: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
        stream = await ac.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                             stream=True, **GREEDY)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused",
                                      max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [t for t, _ in results] == expected
    assert all(r == "length" for _, r in results)


@contextmanager
def slow_steps(engine, seconds: float = 0.02):
    """Every step takes at least ``seconds``: a 900-token request then outlives any client."""
    execute = engine.engine.executor.execute

    def slow(plan):
        time.sleep(seconds)
        return execute(plan)

    engine.engine.executor.execute = slow
    try:
        yield
    finally:
        engine.engine.executor.execute = execute


def _pages_returned(engine) -> bool:
    return (engine.engine.blocks.num_used == 0 and engine.stats()["pages_used"] == 0
            and not engine.engine.requests)


def _finished(metrics: ServingMetrics) -> int:
    return sum(metrics._finished.values())


def test_disconnect_mid_stream_returns_pages(client, server):
    engine, _ = server
    finished_before = _finished(engine.metrics)
    with slow_steps(engine):
        stream = client.completions.create(model="tiny", prompt="Tell me a long story",
                                           max_tokens=900, stream=True, **GREEDY)
        got = 0
        for chunk in stream:
            got += bool(chunk.choices[0].text)
            if got >= 2:
                break
        assert engine.stats()["pages_used"] > 0
        stream.close()
        assert wait_until(lambda: _pages_returned(engine))
    assert _finished(engine.metrics) == finished_before  # aborted, not run to the end
    # the server keeps serving
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


def test_disconnect_while_waiting_for_json_returns_pages(server):
    engine, live = server
    finished_before = _finished(engine.metrics)
    body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 900,
            "ignore_eos": True}
    with slow_steps(engine):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json=body,
                       timeout=httpx.Timeout(10.0, read=0.5))
        assert wait_until(lambda: _pages_returned(engine))
    assert _finished(engine.metrics) == finished_before


def test_models_health_metrics(client, server):
    _, live = server
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    text = httpx.get(f"{live.url}/metrics").text
    for name in ("aspire_http_requests_total", "aspire_generation_tokens_total",
                 "aspire_generation_tokens_per_second", "aspire_num_requests_waiting",
                 "aspire_kv_pages_used", "aspire_kv_pages_total", "aspire_spec_acceptance_rate",
                 "aspire_spec_mean_gamma"):
        assert re.search(rf"^{name}{{[^}}]*}} [0-9.e+-]+$", text, re.M), name
    assert 'spec_mode="aspire"' in text
    # matched on parsed labels: prometheus_client writes them sorted by name, not as declared
    completions = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "aspire_http_requests_total"
                   and s.labels["endpoint"] == "/v1/completions" and s.labels["status"] == "200"]
    assert completions and completions[0] >= 1


def test_api_key(tiny_chat_model):
    with serving(tiny_args(tiny_chat_model, api_key="s3cret")) as (app, _, live):
        # every route the app has (a new endpoint is covered without editing this test)
        routes = [(m, r.path) for r in app.routes if r.path != "/health"
                  for m in getattr(r, "methods", ()) if m != "HEAD"]
        assert {p for _, p in routes} >= {"/v1/models", "/metrics", "/v1/completions",
                                          "/v1/chat/completions"}
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.request(method, live.url + path, headers=headers,
                                  json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 401, (method, path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{live.url}/health").status_code == 200  # probes need no key
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key="s3cret", max_retries=0) as good:
            assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).choices


def test_engine_failure_mid_stream_is_reported(tiny_chat_model):
    with serving(tiny_args(tiny_chat_model)) as (_, engine, live):
        fail_after(engine, 5)
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0) as c:
            stream = c.completions.create(model="tiny", prompt="x", max_tokens=500, stream=True,
                                          **GREEDY)
            with pytest.raises(openai.APIError, match="device lost"):
                for _ in stream:
                    pass
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and "device lost" in health.json()["error"]["message"]


def test_an_sse_line_survives_lenient_line_splitters():
    # generated text may hold U+0085, U+2028, U+2029: raw in JSON (ensure_ascii=False), but
    # str.splitlines (httpx's aiter_lines) breaks lines there; the server escapes them
    import json

    from aspire_ray.serving.openai_serving import _sse

    text = "a\u2028b\x85c\u2029d\x1ce\u00e9"
    line = _sse({"choices": [{"text": text}]})
    body = line.removeprefix("data: ").removesuffix("\n\n")
    assert body.splitlines() == [body] and "\u00e9" in body  # other non-ASCII stays raw
    assert json.loads(body)["choices"][0]["text"] == text

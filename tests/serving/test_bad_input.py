"""Bad requests get an OpenAI error body with a 4xx status, and the server keeps serving: every
case is followed by a good request that must succeed. In-process (httpx ASGI transport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from aspire_ray.engine.engine import LLMEngine
from aspire_ray.serving.app import create_app
from aspire_ray.serving.async_engine import AsyncLLMEngine

from .server_utils import fail_after, tiny_args

CAP = 4096  # max_body_bytes of the app under test
GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
C, CH = "/v1/completions", "/v1/chat/completions"


def with_(base: dict, **changes) -> dict:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not ...}


# (id, path, body (dict -> JSON, str/bytes -> raw), status, param, code)
CASES = [
    ("malformed-json", C, '{"model": "tiny", "prompt": ', 400, None, "invalid_json"),
    ("empty-body", C, b"", 400, None, "invalid_json"),
    ("not-an-object", C, "[1, 2]", 400, None, None),
    ("missing-prompt", C, with_(GOOD, prompt=...), 400, "prompt", None),
    ("missing-model", C, with_(GOOD, model=...), 400, "model", None),
    ("missing-messages", CH, with_(CHAT, messages=...), 400, "messages", None),
    ("prompt-wrong-type", C, with_(GOOD, prompt=5), 400, "prompt", None),
    ("max-tokens-string", C, with_(GOOD, max_tokens="16"), 400, "max_tokens", None),
    ("stream-wrong-type", C, with_(GOOD, stream="yes"), 400, "stream", None),
    ("unknown-model", C, with_(GOOD, model="gpt-4"), 404, "model", "model_not_found"),
    ("empty-prompt", C, with_(GOOD, prompt=""), 400, "prompt", None),
    ("empty-prompt-list", C, with_(GOOD, prompt=[]), 400, "prompt", None),
    ("empty-messages", CH, with_(CHAT, messages=[]), 400, "messages", None),
    ("bad-role", CH, with_(CHAT, messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages.0.role", None),
    ("over-context", C, with_(GOOD, max_tokens=1020), 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt-over-context", C, with_(GOOD, prompt="x" * 1100), 400, "prompt",
     "context_length_exceeded"),
    ("chat-over-context", CH, with_(CHAT, max_completion_tokens=5000), 400,
     "max_completion_tokens",
     "context_length_exceeded"),
    ("token-out-of-vocab", C, with_(GOOD, prompt=[1, 2, 99999]), 400, "prompt", None),
    ("temperature-negative", C, with_(GOOD, temperature=-0.5), 400, "temperature", None),
    ("temperature-too-high", C, with_(GOOD, temperature=2.5), 400, "temperature", None),
    ("temperature-nan", C, '{"model": "tiny", "prompt": "x", "temperature": NaN}', 400,
     "temperature", None),
    ("top-p-zero", C, with_(GOOD, top_p=0), 400, "top_p", None),
    ("top-p-too-high", C, with_(GOOD, top_p=1.5), 400, "top_p", None),
    ("top-k-negative", C, with_(GOOD, top_k=-2), 400, "top_k", None),
    ("max-tokens-zero", C, with_(GOOD, max_tokens=0), 400, "max_tokens", None),
    ("n-zero", C, with_(GOOD, n=0), 400, "n", None),
    ("n-too-many", C, with_(GOOD, n=17), 400, "n", None),
    ("seed-negative", C, with_(GOOD, seed=-1), 400, "seed", None),
    ("too-many-stops", C, with_(GOOD, stop=[f"s{i}" for i in range(17)]), 400, "stop", None),
    ("empty-stop-string", C, with_(GOOD, stop=[""]), 400, "stop", None),
    ("logprobs-unsupported", C, with_(GOOD, logprobs=2), 400, "logprobs", None),
    ("penalty-unsupported", CH, with_(CHAT, presence_penalty=0.5), 400, "presence_penalty",
     None),
    ("oversized-body", C, with_(GOOD, prompt="y" * (2 * CAP)), 413, None, "request_too_large"),
]


@pytest.fixture(scope="module")
def app(tiny_chat_model):
    args = tiny_args(tiny_chat_model, max_body_bytes=CAP)
    engine = AsyncLLMEngine(LLMEngine(args.engine.to_engine_config()))
    yield create_app(engine, args)
    engine.shutdown()


def _send(app, method: str, path: str, body=None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            if body is None:
                return await c.request(method, path)
            raw = body if isinstance(body, bytes | str) else json.dumps(body)
            return await c.request(method, path, content=raw,
                                   headers={"Content-Type": "application/json"})

    return asyncio.run(go())


def _assert_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert err["param"] == param, err
    assert err["code"] == code, err
    return err


def _assert_still_serving(app) -> None:
    ok = _send(app, "POST", C, GOOD)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_request(app, name, path, body, status, param, code):
    _assert_error(_send(app, "POST", path, body), status, param, code)
    _assert_still_serving(app)


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nope", 404),
                                                ("GET", C, 405), ("POST", "/v1/models", 405)])
def test_bad_route(app, method, path, status):
    _assert_error(_send(app, method, path), status)
    _assert_still_serving(app)


def test_good_chat(app):
    r = _send(app, "POST", CH, CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_engine_failure_gives_503(tiny_chat_model):
    args = tiny_args(tiny_chat_model)
    engine = AsyncLLMEngine(LLMEngine(args.engine.to_engine_config()))
    app = create_app(engine, args)

    fail_after(engine, 0)
    try:
        err = _assert_error(_send(app, "POST", C, GOOD), 503, code="engine_unhealthy")
        assert "device lost" in err["message"]
        _assert_error(_send(app, "GET", "/health"), 503, code="engine_unhealthy")
        _assert_error(_send(app, "POST", C, GOOD), 503, code="engine_unhealthy")
        metrics = _send(app, "GET", "/metrics").text
        assert 'aspire_engine_healthy{model="tiny"} 0' in metrics
    finally:
        engine.shutdown()

"""The real thing: Ray Serve runs the application built from serve_configs/local.yaml's args
(with a tiny model) and answers an OpenAI completion over HTTP on a free loopback port; two
replicas of it both take traffic. One application (two replicas) serves both tests: starting
Ray, Serve and the replicas costs most of their time."""

from __future__ import annotations

import httpx
import openai
import pytest

from .server_utils import config_args, ray_serve_app


@pytest.fixture(scope="module")
def served(tiny_chat_model):
    """The local config's application, two replicas (each its own engine driver) behind one
    proxy, on a private Ray instance -> its base URL."""
    pytest.importorskip("ray")
    args = config_args("local", model=tiny_chat_model, calibrate="off", num_pages=64)
    args["server"].update(served_model_name="tiny", cpu_threads=1)
    args["deployment"].update(num_replicas=2, ray_actor_options={"num_cpus": 1})
    with ray_serve_app(args, num_cpus=4) as url:
        yield url


@pytest.mark.timeout(420)  # the first test to ask for `served` also starts it
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_serve_run_local_config(served):
    base = served
    assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ok"}
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 8
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": ""},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.timeout(420)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_two_replicas_both_take_traffic(served):
    """Two Serve replicas (each its own engine driver) behind one proxy: concurrent requests
    reach both, and every answer is the same greedy completion."""
    import concurrent.futures

    base = served
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}

    def ask(_):
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.headers["x-aspire-replica"], r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(32)))
    replicas = {rep for rep, _ in answers}
    assert len(replicas) == 2, f"traffic reached only {replicas}"
    assert len({text for _, text in answers}) == 1

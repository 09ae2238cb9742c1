"""GET /metrics: Prometheus text that prometheus_client's own parser reads back, figures that
move with the requests served, and one registry per app (two apps in one process never share
figures, and nothing lands in the global registry). In-process (httpx ASGI transport)."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import httpx
import prometheus_client
import psutil
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from aspire_ray.engine.engine import LLMEngine
from aspire_ray.process_memory import RSS_KEY
from aspire_ray.serving.app import create_app
from aspire_ray.serving.async_engine import AsyncLLMEngine
from aspire_ray.serving.metrics import ServingMetrics, make_registry

from .server_utils import tiny_args

C = "/v1/completions"
GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0,
        "ignore_eos": True}
COUNTERS = ("aspire_http_requests_total", "aspire_requests_finished_total",
            "aspire_prompt_tokens_total", "aspire_generation_tokens_total",
            "aspire_engine_steps_total", "aspire_engine_step_seconds_total",
            "aspire_engine_step_wall_seconds_total", "aspire_preemptions_total",
            "aspire_spec_draft_tokens_verified_total", "aspire_spec_accepted_tokens_total",
            "aspire_spec_verifications_total", "aspire_engine_steps_by_kind_total",
            "aspire_engine_step_seconds_by_kind_total", "aspire_engine_phase_seconds_total")
GAUGES = ("aspire_generation_tokens_per_second", "aspire_http_requests_in_flight",
          "aspire_num_requests_waiting", "aspire_num_requests_running", "aspire_kv_pages_used",
          "aspire_kv_pages_total", "aspire_kv_cache_usage_ratio", "aspire_engine_healthy",
          "aspire_spec_acceptance_rate", "aspire_spec_mean_gamma",
          "aspire_spec_mean_accepted_length", "aspire_request_latency_seconds_mean",
          "aspire_time_to_first_token_seconds_mean", "aspire_process_resident_memory_bytes")
MEMORY = "aspire_process_resident_memory_bytes"


@contextmanager
def tiny_app(model_dir: str):
    args = tiny_args(model_dir)
    metrics = ServingMetrics(args.served_name, args.engine.spec_mode)
    engine = AsyncLLMEngine(LLMEngine(args.engine.to_engine_config()), metrics)
    try:
        yield create_app(engine, args, metrics)
    finally:
        engine.shutdown()


def _send(app, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.request(method, path, json=body)

    return asyncio.run(go())


def _scrape(app) -> dict[str, Metric]:
    """Family name -> family; the parser names a counter family without its ``_total``."""
    r = _send(app, "GET", "/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _value(families: dict, sample: str, **labels: str) -> float:
    """The value of ``sample`` with (at least) ``labels``; 0 when no such series exists yet."""
    family = families[sample.removesuffix("_total")]
    found = [s.value for s in family.samples
             if s.name == sample and labels.items() <= s.labels.items()]
    assert len(found) <= 1, found
    return found[0] if found else 0.0


def test_metrics_parse_and_count_a_request(tiny_chat_model):
    with tiny_app(tiny_chat_model) as app:
        before = _scrape(app)
        expected = ({(n.removesuffix("_total"), "counter") for n in COUNTERS}
                    | {(n, "gauge") for n in GAUGES})
        assert {(f.name, f.type) for f in before.values()} == expected
        assert _value(before, "aspire_engine_healthy", model="tiny") == 1
        assert _value(before, "aspire_spec_acceptance_rate", spec_mode="aspire") == 0

        r = _send(app, "POST", C, GOOD)
        assert r.status_code == 200, r.text
        after = _scrape(app)
        rss = _own_rss()  # before the app's shutdown frees the engine (its KV pool: ~1 GiB)

    def grew(sample: str, **labels: str) -> float:
        return _value(after, sample, **labels) - _value(before, sample, **labels)

    # on_finished runs before the response is delivered, so these are exact, not eventual.
    assert grew("aspire_requests_finished_total", finish_reason="length") == 1
    assert grew("aspire_prompt_tokens_total") == r.json()["usage"]["prompt_tokens"] > 0
    assert grew("aspire_engine_steps_total") >= 1 and grew("aspire_engine_step_seconds_total") > 0
    # the engine's whole step holds its workers' part
    assert grew("aspire_engine_step_wall_seconds_total") >= grew("aspire_engine_step_seconds_total")
    # the breakdowns add up to the totals: steps and worker seconds by kind, phases
    kinds = {s.labels["kind"] for s in after["aspire_engine_steps_by_kind"].samples}
    assert kinds and sum(grew("aspire_engine_steps_by_kind_total", kind=k) for k in kinds) >= 1
    assert sum(grew("aspire_engine_step_seconds_by_kind_total", kind=k) for k in kinds) == \
        pytest.approx(grew("aspire_engine_step_seconds_total"))
    assert sum(grew("aspire_engine_phase_seconds_total", phase=p)
               for p in ("schedule", "execute", "commit")) == \
        pytest.approx(grew("aspire_engine_step_wall_seconds_total"))
    assert grew("aspire_engine_phase_seconds_total", phase="forward") > 0
    # the first scrape itself is counted too: responses are counted once they are sent
    assert _value(after, "aspire_http_requests_total", endpoint=C, status="200") == 1
    assert _value(after, "aspire_http_requests_total", endpoint="/metrics", status="200") == 1
    # the engine steps in this process (the replica's thread, tp = 1): one process, one role
    assert _by_role(after) == {"replica": pytest.approx(rss, rel=0.25)}


def _by_role(families: dict) -> dict[str, float]:
    return {s.labels["role"]: s.value for s in families[MEMORY].samples}


def _own_rss() -> int:
    return psutil.Process().memory_info().rss


def test_each_process_rss_is_a_gauge_by_role():
    """The engine's stats carry the RSS of its processes apart from the replica's (the driver
    actor, the shard workers); the collector adds the replica's own, read at the scrape."""
    mib = 2**20
    stats = {"pages_used": 3, RSS_KEY: {"driver": 300 * mib, "shard0": 500 * mib,
                                        "shard1": 510 * mib}}  # fmt: skip
    registry = make_registry(ServingMetrics("m", "aspire"), lambda: stats, lambda: True)
    text = prometheus_client.generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families[MEMORY].type == "gauge"
    assert _by_role(families) == {"replica": pytest.approx(_own_rss(), rel=0.25),
                                  "driver": 300 * mib, "shard0": 500 * mib, "shard1": 510 * mib}
    assert {s.labels["model"] for s in families[MEMORY].samples} == {"m"}
    assert _value(families, "aspire_kv_pages_used") == 3  # the other figures as before
    assert "replica" not in stats[RSS_KEY]  # the engine's stats are not written to


def test_two_apps_keep_separate_registries(tiny_chat_model):
    with tiny_app(tiny_chat_model) as served, tiny_app(tiny_chat_model) as idle:
        assert _send(served, "POST", C, GOOD).status_code == 200
        busy, quiet = _scrape(served), _scrape(idle)
    assert _value(busy, "aspire_http_requests_total", endpoint=C, status="200") == 1
    assert _value(busy, "aspire_requests_finished_total", finish_reason="length") == 1
    assert _value(quiet, "aspire_http_requests_total", endpoint=C, status="200") == 0
    assert _value(quiet, "aspire_requests_finished_total", finish_reason="length") == 0
    assert _value(quiet, "aspire_prompt_tokens_total") == 0
    assert not [f.name for f in prometheus_client.REGISTRY.collect()
                if f.name.startswith("aspire_")]

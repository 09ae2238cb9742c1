"""Serving counters exposed as Prometheus metrics (``GET /metrics``).

Two writers: the engine thread (tokens generated each step, finished requests' speculation
figures) and the event loop (HTTP responses). One lock guards all counters. Speculation figures
(acceptance rate, mean draft length gamma) are computed from the ``RequestMetrics`` of finished
requests and labelled with the engine's spec mode.

``prometheus_client`` renders the text; ``ServingCollector`` builds the metric families at
scrape time, because ratios such as the acceptance rate must come from one locked copy of the
counters, the engine's queue and page figures only exist as ``LLMEngine.stats()``, and
``prometheus_client.Counter`` objects would add ``*_created`` series this endpoint never had.
Each app gets its own ``CollectorRegistry`` (``make_registry``), never the global one: several
apps in one process (tests, ``aspire-ray serve``) neither collide nor see each other's figures.

Memory: ``aspire_process_resident_memory_bytes{role=...}``, one series a process serving the
replica: ``replica`` (read at each scrape), and where they are processes of their own the
engine's ``driver`` actor and its ``shard<rank>`` workers (``aspire_ray.process_memory``; from
the engine's stats, as of its last step, sampled at most once a second), so that a leak in any
of them shows.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from functools import partial

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from aspire_ray.outputs import RequestOutput
from aspire_ray.process_memory import RSS_KEY, resident_bytes

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ServingMetrics:
    def __init__(self, model: str, spec_mode: str, window_s: float = 10.0) -> None:
        self.model = model
        self.spec_mode = spec_mode
        self.window_s = window_s  # tokens/s is measured over this trailing window
        self._lock = threading.Lock()
        self._http: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> responses
        self._finished: Counter[str] = Counter()  # finish reason -> requests
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        # Speculation totals over finished requests.
        self._verified_drafts = 0  # draft tokens that went through verification
        self._accepted = 0
        self._verifications = 0
        self._gamma_sum = 0  # sum of draft lengths d over verifications
        self._latency_sum = 0.0
        self._ttft_sum = 0.0
        self._ttft_count = 0
        # Generation requests being served (limits.ConcurrencyLimit; event loop only).
        self.in_flight = 0

    # ---- writers -----------------------------------------------------------------------------
    def on_http(self, endpoint: str, status: int) -> None:
        if endpoint not in ENDPOINTS:
            endpoint = "other"  # bounded label values, whatever paths clients probe
        with self._lock:
            self._http[(endpoint, status)] += 1

    def on_tokens(self, n: int) -> None:
        """Called by the engine thread once per step with the tokens committed in it."""
        if n <= 0:
            return
        t = time.monotonic()
        with self._lock:
            self._generation_tokens += n
            self._recent.append((t, n))
            self._trim(t)

    def on_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        with self._lock:
            self._finished[out.finish_reason or "unknown"] += 1
            self._prompt_tokens += len(out.prompt_token_ids)
            self._verified_drafts += sum(m.drafted_by_position)
            self._accepted += m.accepted
            self._verifications += m.verifications
            self._gamma_sum += sum(m.gamma_history)
            if m.finish_time is not None and m.arrival_time:
                self._latency_sum += m.finish_time - m.arrival_time
            if m.first_token_time is not None and m.arrival_time:
                self._ttft_sum += m.first_token_time - m.arrival_time
                self._ttft_count += 1

    def _trim(self, t: float) -> None:
        while self._recent and self._recent[0][0] < t - self.window_s:
            self._recent.popleft()

    # ---- reader ------------------------------------------------------------------------------
    def tokens_per_second(self) -> float:
        with self._lock:
            self._trim(time.monotonic())
            return sum(n for _, n in self._recent) / self.window_s

    def families(self, stats: dict, healthy: bool) -> list[Metric]:
        """Every metric family at this instant; ``stats`` is ``LLMEngine.stats()``."""
        tps = self.tokens_per_second()
        with self._lock:
            http = dict(self._http)
            finished = dict(self._finished)
            verified, accepted = self._verified_drafts, self._accepted
            verifications, gamma_sum = self._verifications, self._gamma_sum
            prompt_tokens, gen_tokens = self._prompt_tokens, self._generation_tokens
            latency_sum, ttft_sum, ttft_count = self._latency_sum, self._ttft_sum, self._ttft_count
        base = {"model": self.model}
        spec = {"model": self.model, "spec_mode": self.spec_mode}
        out: list[Metric] = []

        def metric(kind: type, name: str, help_: str, labels: dict[str, str],
                   value: float) -> None:
            family = kind(name, help_, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            out.append(family)

        counter, gauge = partial(metric, CounterMetricFamily), partial(metric, GaugeMetricFamily)

        by_status = CounterMetricFamily("aspire_http_requests_total",
                                        "HTTP responses by endpoint and status.",
                                        labels=["model", "endpoint", "status"])
        for (endpoint, status), n in sorted(http.items()):
            by_status.add_metric([self.model, endpoint, str(status)], n)
        by_reason = CounterMetricFamily("aspire_requests_finished_total",
                                        "Finished requests by finish reason.",
                                        labels=["model", "finish_reason"])
        for reason, n in sorted(finished.items()):
            by_reason.add_metric([self.model, reason], n)
        out += [by_status, by_reason]
        total_finished = sum(finished.values())
        counter("aspire_prompt_tokens_total", "Prompt tokens of finished requests.", base,
                prompt_tokens)
        counter("aspire_generation_tokens_total", "Committed output tokens.", base, gen_tokens)
        gauge("aspire_generation_tokens_per_second",
              f"Committed output tokens per second over the last {self.window_s:g} s.", base, tps)
        gauge("aspire_http_requests_in_flight",
              "Completion and chat requests being served, streams included.", base,
              self.in_flight)
        gauge("aspire_num_requests_waiting", "Requests queued for admission.", base,
              stats.get("waiting", 0))
        gauge("aspire_num_requests_running", "Requests in the running batch.", base,
              stats.get("running", 0))
        used, total = stats.get("pages_used", 0), stats.get("pages_total", 0)
        gauge("aspire_kv_pages_used", "KV cache pages in use.", base, used)
        gauge("aspire_kv_pages_total", "KV cache pages in the pool.", base, total)
        gauge("aspire_kv_cache_usage_ratio", "Fraction of KV pages in use.", base,
              used / total if total else 0.0)
        counter("aspire_engine_steps_total", "Engine steps run.", base, stats.get("steps", 0))
        counter("aspire_engine_step_seconds_total",
                "Worker seconds of the engine's steps (a step: one plan, its forwards).", base,
                sum(stats.get("step_seconds", {}).values()))
        timings = stats.get("timings", {})
        counter("aspire_engine_step_wall_seconds_total",
                "Wall seconds of the engine's steps: scheduling, the workers' step and the "
                "commit of its tokens.", base,
                sum(timings.get(k, 0.0) for k in ("schedule", "execute", "commit")))
        out += self._step_breakdown(stats)
        counter("aspire_preemptions_total", "Requests preempted for lack of pages.", base,
                stats.get("preemptions", 0))
        gauge("aspire_engine_healthy", "1 while the engine loop is alive.", base, int(healthy))
        counter("aspire_spec_draft_tokens_verified_total",
                "Draft tokens verified (finished requests).", spec, verified)
        counter("aspire_spec_accepted_tokens_total",
                "Draft tokens accepted by verification (finished requests).", spec, accepted)
        counter("aspire_spec_verifications_total",
                "Verification steps with at least one draft (finished requests).", spec,
                verifications)
        gauge("aspire_spec_acceptance_rate",
              "Accepted / verified draft tokens over finished requests.", spec,
              accepted / verified if verified else 0.0)
        gauge("aspire_spec_mean_gamma",
              "Mean draft length per verification over finished requests.", spec,
              gamma_sum / verifications if verifications else 0.0)
        gauge("aspire_spec_mean_accepted_length",
              "Tokens committed per verification (accepted drafts + 1), finished requests.",
              spec, (accepted + verifications) / verifications if verifications else 0.0)
        gauge("aspire_request_latency_seconds_mean",
              "Mean arrival-to-finish time of finished requests.", base,
              latency_sum / total_finished if total_finished else 0.0)
        gauge("aspire_time_to_first_token_seconds_mean",
              "Mean arrival-to-first-token time of finished requests.", base,
              ttft_sum / ttft_count if ttft_count else 0.0)
        out.append(self._resident_memory(stats.get(RSS_KEY, {})))
        return out

    def _step_breakdown(self, stats: dict) -> list[Metric]:
        """The engine's steps and worker seconds by step kind, and its seconds by phase: where
        a step's time goes (a slower step of one kind, or more steps of a costlier kind)."""
        steps = CounterMetricFamily("aspire_engine_steps_by_kind_total",
                                    "Engine steps by kind (a draft chain counts its steps).",
                                    labels=["model", "kind"])
        seconds = CounterMetricFamily("aspire_engine_step_seconds_by_kind_total",
                                      "Worker seconds of the engine's steps by kind.",
                                      labels=["model", "kind"])
        for kind, n in sorted(stats.get("step_kinds", {}).items()):
            steps.add_metric([self.model, kind], n)
            seconds.add_metric([self.model, kind], stats.get("step_seconds", {}).get(kind, 0.0))
        phases = CounterMetricFamily(
            "aspire_engine_phase_seconds_total",
            "Seconds of the engine's steps by phase: the driver's schedule, execute and commit; "
            "the worker's prepare, forward, sample and refresh (parts of execute).",
            labels=["model", "phase"])
        for phase, s in sorted(stats.get("timings", {}).items()):
            if phase != "total":  # the sum of the by-kind worker seconds
                phases.add_metric([self.model, phase], s)
        return [steps, seconds, phases]

    def _resident_memory(self, by_role: dict[str, int]) -> Metric:
        family = GaugeMetricFamily(
            "aspire_process_resident_memory_bytes",
            "Resident memory (RSS) of each process serving this replica, by role: the replica; "
            "its engine driver actor and shard workers where they run in processes of their "
            "own, as of the engine's last step (sampled at most once a second).",
            labels=["model", "role"])
        for role, n in by_role.items():
            family.add_metric([self.model, role], n)
        return family


class ServingCollector(Collector):
    """Reads ``ServingMetrics`` and the engine's live stats on every scrape (nothing cached)."""

    def __init__(self, metrics: ServingMetrics, stats: Callable[[], dict],
                 healthy: Callable[[], bool]) -> None:
        self.metrics = metrics
        self.stats = stats  # LLMEngine.stats of the engine this app serves
        self.healthy = healthy

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        # the engine's stats hold the RSS of its processes apart from this one (the driver
        # actor, the shards); this process, the replica, is read now
        by_role = {"replica": resident_bytes(), **stats.get(RSS_KEY, {})}
        yield from self.metrics.families({**stats, RSS_KEY: by_role}, self.healthy())


def make_registry(metrics: ServingMetrics, stats: Callable[[], dict],
                  healthy: Callable[[], bool]) -> CollectorRegistry:
    """A registry for one app alone: render it with ``prometheus_client.generate_latest``."""
    registry = CollectorRegistry()
    registry.register(ServingCollector(metrics, stats, healthy))
    return registry

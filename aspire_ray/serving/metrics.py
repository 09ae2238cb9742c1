"""Serving counters rendered as Prometheus text (``GET /metrics``).

Two writers: the engine thread (tokens generated each step, finished requests' speculation
figures) and the event loop (HTTP responses). One lock guards all counters; rendering takes a
consistent copy. Speculation figures (acceptance rate, mean draft length gamma) are computed
from the ``RequestMetrics`` of finished requests and labelled with the engine's spec mode.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

from aspire_ray.outputs import RequestOutput

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


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

    def render(self, stats: dict, healthy: bool) -> str:
        """Prometheus text exposition format 0.0.4; ``stats`` is ``LLMEngine.stats()``."""
        tps = self.tokens_per_second()
        with self._lock:
            http = dict(self._http)
            finished = dict(self._finished)
            verified, accepted = self._verified_drafts, self._accepted
            verifications, gamma_sum = self._verifications, self._gamma_sum
            prompt_tokens, gen_tokens = self._prompt_tokens, self._generation_tokens
            latency_sum, ttft_sum, ttft_count = self._latency_sum, self._ttft_sum, self._ttft_count
        base = f'model="{_escape(self.model)}"'
        spec = f'{base},spec_mode="{_escape(self.spec_mode)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{{{labels}}} {value:.10g}")

        metric("aspire_http_requests_total", "counter", "HTTP responses by endpoint and status.",
               [(f'{base},endpoint="{e}",status="{s}"', n) for (e, s), n in sorted(http.items())])
        metric("aspire_requests_finished_total", "counter", "Finished requests by finish reason.",
               [(f'{base},finish_reason="{_escape(r)}"', n) for r, n in sorted(finished.items())])
        total_finished = sum(finished.values())
        metric("aspire_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
               [(base, prompt_tokens)])
        metric("aspire_generation_tokens_total", "counter", "Committed output tokens.",
               [(base, gen_tokens)])
        metric("aspire_generation_tokens_per_second", "gauge",
               f"Committed output tokens per second over the last {self.window_s:g} s.",
               [(base, tps)])
        metric("aspire_http_requests_in_flight", "gauge",
               "Completion and chat requests being served, streams included.",
               [(base, self.in_flight)])
        metric("aspire_num_requests_waiting", "gauge", "Requests queued for admission.",
               [(base, stats.get("waiting", 0))])
        metric("aspire_num_requests_running", "gauge", "Requests in the running batch.",
               [(base, stats.get("running", 0))])
        used, total = stats.get("pages_used", 0), stats.get("pages_total", 0)
        metric("aspire_kv_pages_used", "gauge", "KV cache pages in use.", [(base, used)])
        metric("aspire_kv_pages_total", "gauge", "KV cache pages in the pool.", [(base, total)])
        metric("aspire_kv_cache_usage_ratio", "gauge", "Fraction of KV pages in use.",
               [(base, used / total if total else 0.0)])
        metric("aspire_engine_steps_total", "counter", "Engine steps run.",
               [(base, stats.get("steps", 0))])
        metric("aspire_preemptions_total", "counter", "Requests preempted for lack of pages.",
               [(base, stats.get("preemptions", 0))])
        metric("aspire_engine_healthy", "gauge", "1 while the engine loop is alive.",
               [(base, int(healthy))])
        metric("aspire_spec_draft_tokens_verified_total", "counter",
               "Draft tokens verified (finished requests).", [(spec, verified)])
        metric("aspire_spec_accepted_tokens_total", "counter",
               "Draft tokens accepted by verification (finished requests).", [(spec, accepted)])
        metric("aspire_spec_verifications_total", "counter",
               "Verification steps with at least one draft (finished requests).",
               [(spec, verifications)])
        metric("aspire_spec_acceptance_rate", "gauge",
               "Accepted / verified draft tokens over finished requests.",
               [(spec, accepted / verified if verified else 0.0)])
        metric("aspire_spec_mean_gamma", "gauge",
               "Mean draft length per verification over finished requests.",
               [(spec, gamma_sum / verifications if verifications else 0.0)])
        metric("aspire_spec_mean_accepted_length", "gauge",
               "Tokens committed per verification (accepted drafts + 1), finished requests.",
               [(spec, (accepted + verifications) / verifications if verifications else 0.0)])
        metric("aspire_request_latency_seconds_mean", "gauge",
               "Mean arrival-to-finish time of finished requests.",
               [(base, latency_sum / total_finished if total_finished else 0.0)])
        metric("aspire_time_to_first_token_seconds_mean", "gauge",
               "Mean arrival-to-first-token time of finished requests.",
               [(base, ttft_sum / ttft_count if ttft_count else 0.0)])
        return "\n".join(lines) + "\n"

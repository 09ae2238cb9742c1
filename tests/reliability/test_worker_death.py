"""Process death under Ray Serve (issue 9, item 4): a tp_size=2 CPU engine (gloo) served by one
Serve replica; while requests stream, a shard worker process, and separately the replica (the
engine driver) itself, is killed with SIGKILL; last, a shard worker dies while nothing runs.

Checked: the in-flight streams end within seconds and never look complete; a dead worker turns
/health into a 503 (so the deployment's check_health fails too); Serve replaces the replica; the
dead replica's other shard processes go away with it; a new request succeeds afterwards.
Only processes this test's own Ray instance started are looked up and killed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from serving.server_utils import ray_serve_app, wait_until

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

STREAM = {"model": "tiny", "prompt": "go", "max_tokens": 900, "stream": True,
          "temperature": 0, "ignore_eos": True}
SMALL = {"model": "tiny", "prompt": "after", "max_tokens": 4, "temperature": 0}
ENDS_WITHIN_S = 10.0  # "within a few seconds", with room for 2 shared cores
RECOVERY_S = 180.0  # health checks + a new replica and its two shard processes


@pytest.fixture(scope="module")
def base_url(tiny_chat_model):
    pytest.importorskip("ray")
    args = {
        "engine": {"model": tiny_chat_model, "spec_mode": "aspire", "tp_size": 2,
                   "device": "cpu", "calibrate": "off", "num_pages": 128,
                   "max_num_batched_tokens": 256, "spec_options": {"d_max": 4}},
        "server": {"served_model_name": "tiny", "cpu_threads": 1},
        # Health checked every second: a failed engine is noticed (and replaced) quickly.
        "deployment": {"num_replicas": 1, "health_check_period_s": 1,
                       "health_check_timeout_s": 10, "graceful_shutdown_timeout_s": 1},
    }
    # a private local instance; 8 logical CPUs so the replica's 3 bundles fit on 2 cores
    with ray_serve_app(args, num_cpus=8) as url:
        yield url


def _our_ray_processes(title: str) -> list[int]:
    """Pids of the Ray actor processes named ``title`` under THIS process (our Ray instance's
    raylet is our child); other Ray clusters on the machine are never touched."""
    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue  # exited meanwhile
        # Ray's process title: "ray::<actor class>" or, while busy, "ray::<class>.<method>"
        if cmdline and cmdline[0].strip().split(".")[0] == f"ray::{title}":
            pids.append(proc.pid)
    return sorted(pids)


def _serving_replica(url: str) -> str:
    """x-aspire-replica ("host:pid") of the replica that answers a small request."""
    r = httpx.post(f"{url}/v1/completions", json=SMALL, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-aspire-replica"]


class _Stream(threading.Thread):
    """One streaming completion; records its SSE data lines, how it ended and when."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.lines, self.error, self.ended = url, [], None, None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=STREAM,
                              timeout=60) as r:
                assert r.status_code == 200, r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[len("data: "):])
                        self.started.set()
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            self.error = exc
        finally:
            self.ended = time.monotonic()
            self.started.set()

    def error_chunk(self) -> dict | None:
        bodies = [json.loads(x) for x in self.lines if x != "[DONE]"]
        return next((b["error"] for b in bodies if "error" in b), None)

    def finished_normally(self) -> bool:
        bodies = [json.loads(x) for x in self.lines if x != "[DONE]"]
        return any(c.get("finish_reason") for b in bodies for c in b.get("choices", ()))


def _start_streams(url: str, n: int = 3) -> list[_Stream]:
    streams = [_Stream(url) for _ in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60) and s.error is None and s.lines, "the stream never started"
    return streams


def _join(streams: list[_Stream], killed_at: float) -> None:
    for s in streams:
        s.join(ENDS_WITHIN_S + 30)
        assert not s.is_alive(), "a stream still runs after its engine died"
        assert s.ended - killed_at < ENDS_WITHIN_S, f"ended {s.ended - killed_at:.1f} s late"
        assert not s.finished_normally(), "a stream looks complete although its engine died"


def _recover(url: str, old_replica: str, old_workers: list[int]) -> float:
    """Seconds until a new replica answers; its two shard workers replace the old ones."""
    t0 = time.monotonic()
    replica = None

    def answered() -> bool:
        nonlocal replica
        try:
            replica = _serving_replica(url)
        except (httpx.HTTPError, AssertionError):
            return False
        return True

    assert wait_until(answered, timeout=RECOVERY_S, interval=0.5), "no replica came back"
    assert replica != old_replica, "the failed replica was not replaced"
    assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
    # no orphaned shard processes: exactly the new replica's two, none of the old ones
    assert wait_until(lambda: len(_our_ray_processes("ShardWorker")) == 2, timeout=30)
    assert not set(_our_ray_processes("ShardWorker")) & set(old_workers)
    return time.monotonic() - t0


def test_shard_worker_killed_mid_stream(base_url):
    replica = _serving_replica(base_url)
    workers = _our_ray_processes("ShardWorker")
    assert len(workers) == 2, workers
    streams = _start_streams(base_url)
    killed_at = time.monotonic()
    os.kill(workers[1], signal.SIGKILL)
    _join(streams, killed_at)
    for s in streams:
        err = s.error_chunk()
        assert s.error is None and err is not None, (s.error, s.lines[-2:])
        assert err["code"] == "engine_unhealthy" and err["type"] == "server_error"
        assert "shard worker" in err["message"] and "died" in err["message"], err
        assert s.lines[-1] == "[DONE]"
    # /health says 503 until Serve's check_health (which fails the same way) replaces it
    health = httpx.get(f"{base_url}/health", timeout=30)
    assert health.status_code == 503, health.text
    assert health.json()["error"]["code"] == "engine_unhealthy"
    print(f"worker death: recovered in {_recover(base_url, replica, workers):.1f} s")


def test_replica_killed_mid_stream(base_url):
    replica = _serving_replica(base_url)
    workers = _our_ray_processes("ShardWorker")
    pid = int(replica.rsplit(":", 1)[1])
    assert pid in _our_ray_processes("ServeReplica:aspire:AspireServer"), "not our replica"
    streams = _start_streams(base_url)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    _join(streams, killed_at)
    for s in streams:
        # Nobody is left to write an error chunk: Serve's proxy closes the stream without its
        # final chunk, which every HTTP client reports as an error (never as a short answer).
        assert isinstance(s.error, httpx.RemoteProtocolError) or s.error_chunk(), \
            (s.error, s.lines[-2:])
        assert "[DONE]" not in s.lines
    print(f"replica death: recovered in {_recover(base_url, replica, workers):.1f} s")


def test_shard_worker_killed_while_idle(base_url):
    """No step runs, so the health check pings the workers: /health turns 503 naming the dead
    rank before any request arrives, a request gets a fast 503, and the replica is replaced as
    above."""
    replica = _serving_replica(base_url)
    workers = _our_ray_processes("ShardWorker")
    os.kill(workers[0], signal.SIGKILL)
    assert wait_until(lambda: not psutil.pid_exists(workers[0]), timeout=10)
    t0 = time.monotonic()
    health = httpx.get(f"{base_url}/health", timeout=30)
    assert time.monotonic() - t0 < ENDS_WITHIN_S
    if health.status_code == 503:  # (a 200 here would be the replacement, already serving)
        err = health.json()["error"]
        assert err["code"] == "engine_unhealthy" and "shard worker rank" in err["message"], err
        r = httpx.post(f"{base_url}/v1/completions", json={**SMALL, "stream": True}, timeout=60)
        if r.status_code == 503:  # the old replica, failing fast
            assert r.json()["error"]["code"] == "engine_unhealthy", r.text
        else:  # Serve had already routed to the replacement
            assert r.status_code == 200 and r.headers["x-aspire-replica"] != replica, r.text
    else:
        assert replica != _serving_replica(base_url), "a dead rank went unnoticed by /health"
    print(f"idle worker death: recovered in {_recover(base_url, replica, workers):.1f} s")

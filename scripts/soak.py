"""Load and soak test of the OpenAI server: N concurrent streaming clients for a fixed time or
request count, mixed endpoints, prompt lengths, sampling settings and max_tokens, and random
early disconnects. Reports requests/s, p50/p99 latency, errors by status, KV pages in use once
idle (must be 0), and resident memory (RSS) at the start, after ``--warmup`` and at the end with
its growth after the warm-up: of every process the server's /metrics reports
(``aspire_process_resident_memory_bytes``: the replica, its engine driver actor, its shard
workers; ``rss_by_role``), and of one pid (``--server-pid``, or this process when it serves;
the ``rss_*`` keys).

    # against a running server (--server-pid: one process's RSS where /metrics has none)
    python scripts/soak.py --url http://127.0.0.1:8000 --model-name smollm2-135m-instruct \
        --server-pid 1234 --clients 64 --duration 600
    # or start the Serve application of a config in this process on a free loopback port
    python scripts/soak.py --serve-config serve_configs/local.yaml --tp-size 2 --clients 32
    # or the app alone (uvicorn, no Ray) in this process
    python scripts/soak.py --model /path/to/model --clients 16 --duration 60

Every loop is bounded (``--duration`` and ``--max-requests``); traffic goes only to ``--url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import socket
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager

import httpx
import psutil
from local_serve import config_app_args, serve_app
from prometheus_client.parser import text_string_to_metric_families

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "judge boxing matches near the old harbour").split()
PROMPT_WORDS = [2, 12, 40, 120]  # mixed prompt lengths (~6 characters a word)
RSS_GAUGE = "aspire_process_resident_memory_bytes"
PHASES = ("start", "after_warmup", "end")  # when the RSS figures are taken


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="base URL of a running server (default: start one here)")
    where.add_argument("--serve-config",
                       help="start this Serve config's application under Ray Serve here, its "
                            "engine settings overridden by this script's (default: the app "
                            "alone, uvicorn, no Ray)")
    p.add_argument("--server-pid", type=int, help="pid of the running server, for its RSS")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="engine.model for the in-process server")
    p.add_argument("--model-name", default="soak", help="the served model name")
    p.add_argument("--spec-mode", default="aspire")
    p.add_argument("--num-pages", type=int, default=512)
    p.add_argument("--tp-size", type=int, default=1,
                   help="engine.tp_size for the in-process server (> 1: Ray shard actors)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-requests", type=int, default=1_000_000)
    p.add_argument("--disconnect-prob", type=float, default=0.2)
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds of load before the RSS baseline is taken")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the report here")
    return p.parse_args()


def engine_settings(args: argparse.Namespace) -> dict:
    """The engine settings of a server this script starts: not all the engine's defaults (no
    start-up calibration sweep, a fixed KV pool)."""
    return {"model": args.model, "spec_mode": args.spec_mode, "calibrate": "off",
            "num_pages": args.num_pages, "tp_size": args.tp_size}


@contextmanager
def local_server(args: argparse.Namespace):
    """(url, pid) of an in-process uvicorn server on a free loopback port."""
    import uvicorn

    from aspire_ray.serving.app import build_server
    from aspire_ray.serving.settings import AppArgs

    app_args = AppArgs.model_validate({"engine": engine_settings(args),
                                       "server": {"served_model_name": args.model_name}})
    app, engine = build_server(app_args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", os.getpid()
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()
        sock.close()


@contextmanager
def served_config(args: argparse.Namespace):
    """The base URL of ``--serve-config``'s application under Ray Serve in this process, with
    this script's engine settings; Ray gets a CPU for the replica's bundle and one for each
    shard's however few cores the machine has."""
    app_args = config_app_args(args.serve_config)
    app_args["engine"].update(engine_settings(args))
    app_args["server"]["served_model_name"] = args.model_name
    with serve_app(app_args, num_cpus=max(os.cpu_count() or 1, args.tp_size + 1)) as url:
        yield url


def make_request(rng: random.Random, model: str, disconnect_prob: float
                 ) -> tuple[str, dict, int | None]:
    """(path, body, chunks to read before hanging up or None) of one random request."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.choice(PROMPT_WORDS)))
    body = {"model": model, "stream": True, "max_tokens": rng.choice([4, 16, 32, 64]),
            "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([5, 50])
    if rng.random() < 0.2:
        body["seed"] = rng.randrange(1000)
    if rng.random() < 0.1:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
    else:
        path = "/v1/completions"
        body["prompt"] = text
    hang_up = rng.randrange(0, 6) if rng.random() < disconnect_prob else None
    return path, body, hang_up



async def one_request(client: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace,
                      stats: dict) -> None:
    path, body, hang_up = make_request(rng, args.model_name, args.disconnect_prob)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                stats["status"][r.status_code] += 1
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if hang_up is not None and chunks >= hang_up:
                    stats["status"]["disconnected (intended)"] += 1
                    return
                chunks += 1
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                if "error" in json.loads(data):
                    stats["status"]["error chunk"] += 1
                    return
            stats["status"][200] += 1
            stats["latency"].append(time.perf_counter() - t0)
    except httpx.HTTPError as exc:
        stats["status"][type(exc).__name__] += 1


async def client_loop(url: str, args: argparse.Namespace, seed: int, stop_at: float,
                      budget: list[int], stats: dict) -> None:
    rng = random.Random(seed)
    timeout = httpx.Timeout(120.0, connect=10.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        while time.monotonic() < stop_at and budget[0] > 0:
            budget[0] -= 1
            await one_request(client, rng, args, stats)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def idle_pages(url: str, timeout: float = 30.0) -> float:
    """KV pages in use once the server has drained (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        used = metric(url, "aspire_kv_pages_used")
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def rss_mib(pid: int | None) -> float | None:
    return None if pid is None else psutil.Process(pid).memory_info().rss / 2**20


def role_rss_mib(url: str) -> dict[str, float]:
    """Role -> resident MiB of each process the server's /metrics reports ({} without the
    gauge); the driver's and the shards' as of the engine's last step."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == RSS_GAUGE:
            return {s.labels["role"]: s.value / 2**20 for s in family.samples}
    return {}


def memory_now(url: str, pid: int | None) -> tuple[float | None, dict[str, float]]:
    """(the pid's RSS, every role's RSS) in MiB."""
    return rss_mib(pid), role_rss_mib(url)


def rounded(mib: float | None) -> float | None:
    return None if mib is None else round(mib, 1)


def growth_pct(before: float | None, after: float | None) -> float | None:
    return None if not before or after is None else round(100 * (after - before) / before, 2)


def pid_rss_report(mib: dict[str, float | None]) -> dict:
    """The one pid's figures (phase -> MiB), under the report's first keys."""
    return {"rss_start_mib": rounded(mib["start"]), "rss_end_mib": rounded(mib["end"]),
            "rss_after_warmup_mib": rounded(mib["after_warmup"]),
            "rss_growth_after_warmup_pct": growth_pct(mib["after_warmup"], mib["end"])}


def role_rss_report(by_phase: dict[str, dict[str, float]]) -> dict[str, dict]:
    """Role -> its start / after-warm-up / end MiB and growth after the warm-up, for every role
    /metrics reported in any phase (a figure it lacked in a phase: None)."""
    roles = dict.fromkeys(role for phase in PHASES for role in by_phase[phase])
    return {role: {**{f"{phase}_mib": rounded(by_phase[phase].get(role)) for phase in PHASES},
                   "growth_after_warmup_pct": growth_pct(by_phase["after_warmup"].get(role),
                                                         by_phase["end"].get(role))}
            for role in roles}  # fmt: skip


def soak(url: str, pid: int | None, args: argparse.Namespace) -> dict:
    httpx.get(f"{url}/health", timeout=10).raise_for_status()
    memory = {"start": memory_now(url, pid)}  # phase -> (pid MiB, role -> MiB)
    stats = {"status": Counter(), "latency": []}
    budget = [args.max_requests]
    t0 = time.monotonic()
    stop_at = t0 + args.duration

    async def baseline() -> None:  # allocator pools and caches fill during the first requests
        await asyncio.sleep(min(args.warmup, args.duration / 2))
        memory["after_warmup"] = await asyncio.to_thread(memory_now, url, pid)

    async def run() -> None:
        warm = asyncio.create_task(baseline())
        await asyncio.wait_for(asyncio.gather(*(
            client_loop(url, args, args.seed * 10_000 + i, stop_at, budget, stats)
            for i in range(args.clients))), timeout=args.duration + 180)
        await warm

    asyncio.run(run())
    elapsed = time.monotonic() - t0
    pages = idle_pages(url)
    memory["end"] = memory_now(url, pid)
    lat = sorted(stats["latency"])
    total = sum(stats["status"].values())

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None

    return {
        "command": shlex.join(["python", *sys.argv]),
        "clients": args.clients, "duration_s": round(elapsed, 1), "requests": total,
        "requests_per_s": round(total / elapsed, 2),
        "completed_per_s": round(len(lat) / elapsed, 2),
        "latency_p50_s": pct(0.50), "latency_p99_s": pct(0.99),
        "outcomes": {str(k): v for k, v in sorted(stats["status"].items(), key=str)},
        "kv_pages_used_idle": pages,
        "kv_pages_total": metric(url, "aspire_kv_pages_total"),
        "preemptions": metric(url, "aspire_preemptions_total"),
        **pid_rss_report({phase: memory[phase][0] for phase in PHASES}),
        "rss_by_role": role_rss_report({phase: memory[phase][1] for phase in PHASES}),
        "healthy": httpx.get(f"{url}/health", timeout=10).status_code == 200,
    }


def main() -> None:
    args = parse_args()
    if args.url:
        report = soak(args.url.rstrip("/"), args.server_pid, args)
    elif args.serve_config:
        with served_config(args) as url:
            report = soak(url, args.server_pid, args)
    else:
        with local_server(args) as (url, pid):
            report = soak(url, pid, args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if report["kv_pages_used_idle"] != 0:
        raise SystemExit("KV pages leaked: the server is idle but pages are in use")


if __name__ == "__main__":
    main()

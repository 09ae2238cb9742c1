"""Load and soak test of the OpenAI server: N concurrent streaming clients for a fixed time or
request count, mixed endpoints, prompt lengths, sampling settings and max_tokens, and random
early disconnects. Reports requests/s, p50/p99 latency, errors by status, KV pages in use once
idle (must be 0) and the server's RSS at start and end.

    # against a running server (RSS needs its pid)
    python scripts/soak.py --url http://127.0.0.1:8000 --model-name smollm2-135m-instruct \
        --server-pid 1234 --clients 64 --duration 600
    # or start the server in this process on a free loopback port
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
import socket
import threading
import time
from collections import Counter
from contextlib import contextmanager

import httpx
import psutil

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "judge boxing matches near the old harbour").split()
PROMPT_WORDS = [2, 12, 40, 120]  # mixed prompt lengths (~6 characters a word)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="base URL of a running server (default: start one here)")
    p.add_argument("--server-pid", type=int, help="pid of the running server, for its RSS")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="engine.model for the in-process server")
    p.add_argument("--model-name", default="soak", help="the served model name")
    p.add_argument("--spec-mode", default="aspire")
    p.add_argument("--num-pages", type=int, default=512)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-requests", type=int, default=1_000_000)
    p.add_argument("--disconnect-prob", type=float, default=0.2)
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds of load before the RSS baseline is taken")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the report here")
    return p.parse_args()


@contextmanager
def local_server(args: argparse.Namespace):
    """(url, pid) of an in-process uvicorn server on a free loopback port."""
    import uvicorn

    from aspire_ray.serving.app import build_server
    from aspire_ray.serving.settings import AppArgs

    app_args = AppArgs.model_validate({
        "engine": {"model": args.model, "spec_mode": args.spec_mode, "calibrate": "off",
                   "num_pages": args.num_pages},
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


def soak(url: str, pid: int | None, args: argparse.Namespace) -> dict:
    httpx.get(f"{url}/health", timeout=10).raise_for_status()
    rss0 = rss_mib(pid)
    stats = {"status": Counter(), "latency": []}
    budget = [args.max_requests]
    t0 = time.monotonic()
    stop_at = t0 + args.duration

    rss_warm: list[float | None] = [None]

    async def baseline() -> None:  # allocator pools and caches fill during the first requests
        await asyncio.sleep(min(args.warmup, args.duration / 2))
        rss_warm[0] = rss_mib(pid)

    async def run() -> None:
        warm = asyncio.create_task(baseline())
        await asyncio.wait_for(asyncio.gather(*(
            client_loop(url, args, args.seed * 10_000 + i, stop_at, budget, stats)
            for i in range(args.clients))), timeout=args.duration + 180)
        await warm

    asyncio.run(run())
    elapsed = time.monotonic() - t0
    pages = idle_pages(url)
    rss1 = rss_mib(pid)
    lat = sorted(stats["latency"])
    total = sum(stats["status"].values())

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None

    return {
        "clients": args.clients, "duration_s": round(elapsed, 1), "requests": total,
        "requests_per_s": round(total / elapsed, 2),
        "completed_per_s": round(len(lat) / elapsed, 2),
        "latency_p50_s": pct(0.50), "latency_p99_s": pct(0.99),
        "outcomes": {str(k): v for k, v in sorted(stats["status"].items(), key=str)},
        "kv_pages_used_idle": pages,
        "kv_pages_total": metric(url, "aspire_kv_pages_total"),
        "preemptions": metric(url, "aspire_preemptions_total"),
        "rss_start_mib": rss0 and round(rss0, 1), "rss_end_mib": rss1 and round(rss1, 1),
        "rss_after_warmup_mib": rss_warm[0] and round(rss_warm[0], 1),
        "rss_growth_after_warmup_pct": rss_warm[0] and rss1
        and round(100 * (rss1 - rss_warm[0]) / rss_warm[0], 2),
        "healthy": httpx.get(f"{url}/health", timeout=10).status_code == 200,
    }


def main() -> None:
    args = parse_args()
    if args.url:
        report = soak(args.url.rstrip("/"), args.server_pid, args)
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

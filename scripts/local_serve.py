"""A Serve config's application under Ray Serve in this process, on a loopback port: what
bench_serve.py and soak.py measure, started and stopped the same way."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_app_args(path: str | Path) -> dict:
    """The ``args`` of the config's (first) application: engine, server, deployment."""
    return yaml.safe_load(Path(path).read_text())["applications"][0]["args"]


@contextmanager
def serve_app(app_args: dict, port: int = 0, num_cpus: int | None = None,
              address: str | None = None) -> Iterator[str]:
    """Ray (``num_cpus`` logical CPUs, or Ray's default; ``address`` as ``ray.init`` takes it:
    "local" never joins a cluster someone else started), Serve on 127.0.0.1:``port`` (0: a
    free one) and the application of ``app_args`` -> its base URL; Serve and Ray are shut down
    after (a replica's driver and shard actors with them)."""
    import ray
    from ray import serve

    from aspire_ray.serving.deployment import build_app

    port = port or free_port()
    ray.init(address=address, include_dashboard=False, log_to_driver=False,
             **({} if num_cpus is None else {"num_cpus": num_cpus}))
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args), name="aspire", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()

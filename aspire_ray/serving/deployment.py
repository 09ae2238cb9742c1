"""The Ray Serve application: one replica = one engine driver + its FastAPI ingress.

``build_app`` is what ``serve run`` calls
(``import_path: aspire_ray.serving.deployment:build_app``).

The replica builds the engine in its constructor (a tp > 1 engine starts its shard workers in
the replica's placement group, see ``DeploymentArgs.options``), serves the app from
``create_app`` and reports unhealthy to Serve once the engine loop has failed, so Serve
replaces the replica.
"""

from __future__ import annotations

from pathlib import Path

from ray import serve

from .app import build_server
from .settings import AppArgs


@serve.ingress()
class AspireServer:
    def __init__(self, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.asgi_app, self.engine = build_server(self.args)

    def __serve_build_asgi_app__(self):
        return self.asgi_app

    def check_health(self) -> None:
        self.engine.probe_workers()  # an idle replica's dead shard worker counts too
        if not self.engine.healthy:
            raise RuntimeError(f"engine unhealthy: {self.engine.error or 'not running'}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def bind(args: AppArgs):
    """The bound Serve application for validated ``args``."""
    options = args.deployment.options(args.engine)
    deployment = serve.deployment(AspireServer).options(**options)
    return deployment.bind(args.model_dump(mode="json"))


def build_app(args: dict):
    """Serve application builder (``import_path: aspire_ray.serving.deployment:build_app``).

    ``args`` is validated here, before any replica starts, so a bad config fails ``serve run``
    with an error naming the field.
    """
    parsed = AppArgs.model_validate(args or {})
    check_model_exists(parsed)
    return bind(parsed)


def check_model_exists(args: AppArgs) -> None:
    """Fail fast (before Ray starts a replica) when engine.model cannot be found."""
    from aspire_ray.model import registry

    if args.engine.load_format == "dummy":
        return
    try:
        path = Path(registry.resolve_alias(args.engine.model)).expanduser()
    except FileNotFoundError as exc:
        raise ValueError(f"engine.model: {exc}") from None
    if not path.exists():
        raise ValueError(f"engine.model: {args.engine.model!r} is neither a known alias nor an "
                         f"existing file or directory")

"""The Ray Serve application: one replica = its FastAPI ingress + one engine core.

``build_app`` is what ``serve run`` calls
(``import_path: aspire_ray.serving.deployment:build_app``).

The replica starts the engine core in its constructor: by default in a driver actor of its
own (``engine_core.ActorCore``, in the replica's placement group; a tp > 1 engine's shard
workers go to the group's other bundles, see ``DeploymentArgs.options`` and
``driver_placement``; a driver Ray cannot place fails the constructor after
``deployment.driver_placement_timeout_s``), or in a thread of the replica
(``deployment.engine_driver: replica``).
It serves the app from ``create_app`` and reports unhealthy to Serve once the engine loop has
failed or its driver died, so Serve replaces the replica (and the replica's driver and shard
workers, which it owns, end with it).
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
        driver_actor = self.args.deployment.engine_driver == "actor"
        self.asgi_app, self.engine = build_server(self.args, driver_actor=driver_actor)

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
    check_model_shardable(parsed)
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


def check_model_shardable(args: AppArgs) -> None:
    """Fail fast when engine.tp_size does not divide the model's heads or MLP: in a replica
    the error would only show as Serve's retries of a constructor that cannot succeed."""
    if args.engine.tp_size == 1:
        return
    from aspire_ray.executor.ray_executor import check_shardable

    try:
        check_shardable(args.engine.to_engine_config())
    except ValueError as exc:
        raise ValueError(f"engine.tp_size: {exc}") from None

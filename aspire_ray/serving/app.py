"""The HTTP face of a replica: a FastAPI app over one ``AsyncLLMEngine``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE),
``GET /v1/models``, ``GET /health`` (503 once the engine has failed), ``GET /metrics``
(Prometheus text). Every error is an OpenAI error body; with ``server.api_key`` set, every
endpoint but /health needs ``Authorization: Bearer <key>``; the caps of ``limits.py`` apply.

``serve run serve_configs/local.yaml`` calls ``deployment.build_app(args)``, whose replicas
serve this app; ``create_app`` is the same app without Ray (tests).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from contextlib import suppress

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as P
from .async_engine import AsyncLLMEngine
from .errors import APIError, from_validation_error, internal_error
from .limits import ConcurrencyLimit
from .metrics import METRICS_CONTENT_TYPE, ServingMetrics, make_registry
from .openai_serving import OpenAIServing
from .settings import AppArgs


def create_app(engine: AsyncLLMEngine, args: AppArgs,
               metrics: ServingMetrics | None = None) -> FastAPI:
    """The OpenAI-compatible app; the caller owns (and shuts down) ``engine``."""
    metrics = metrics or engine.metrics or ServingMetrics(args.served_name, args.engine.spec_mode)
    serving = OpenAIServing(engine, args.served_name, aliases=(args.engine.model,),
                            limits=args.server)
    cap = args.server.max_body_bytes
    api_key = args.server.api_key
    registry = make_registry(metrics, engine.stats, lambda: engine.healthy)
    app = FastAPI(title="aspire_ray", docs_url=None, redoc_url=None, openapi_url=None)
    replica = f"{socket.gethostname()}:{os.getpid()}"

    @app.middleware("http")
    async def _tag_replica(request: Request, call_next):
        # which engine driver answered: load balancing across replicas is observable
        response = await call_next(request)
        response.headers["x-aspire-replica"] = replica
        return response

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc).response()

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    auth = [Depends(authorize)]

    @app.get("/health")
    async def health() -> Response:
        await asyncio.to_thread(engine.probe_workers)  # pings idle shard workers (Ray)
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        return APIError(503, f"the engine is unhealthy: {engine.error or 'not running'}",
                        type="server_error", code="engine_unhealthy").response()

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return serving.models()

    @app.get("/metrics", dependencies=auth)
    async def prometheus() -> Response:
        # the 0.0.4 text format's type (newer prometheus_client releases name 1.0.0 as the
        # latest, which older Prometheus servers do not know); the body is valid under both
        return Response(generate_latest(registry), media_type=METRICS_CONTENT_TYPE)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        req = await _parse(request, P.CompletionRequest, cap)
        return await _respond(request, serving.completions(req))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request) -> Response:
        req = await _parse(request, P.ChatCompletionRequest, cap)
        return await _respond(request, serving.chat(req))

    # Outermost last: responses refused for concurrency are still counted by status.
    app.add_middleware(ConcurrencyLimit, cap=args.server.max_concurrent_requests,
                       metrics=metrics)
    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    return app


async def _parse(request: Request, model: type[BaseModel], cap: int) -> BaseModel:
    """Read at most ``cap`` bytes (413 beyond) and validate them strictly (400 on errors)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise _too_large(cap)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > cap:
            raise _too_large(cap)
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(bytes(body), strict=True)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {err['msg']}",
                           code="invalid_json") from None
        raise from_validation_error(exc) from None


def _too_large(cap: int) -> APIError:
    return APIError(413, f"the request body exceeds {cap} bytes", code="request_too_large")


async def _respond(request: Request, work) -> Response:
    """Run ``work`` until it returns or the client goes away (which cancels it, aborting the
    engine requests); a dict becomes JSON, an async iterator an SSE stream."""
    result = await _until_disconnect(request, work)
    if result is None:
        return Response(status_code=499)  # client closed the connection; nobody reads this
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _until_disconnect(request: Request, work):
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return None
    return task.result()


class _MetricsMiddleware:
    """Counts responses by endpoint and status (pure ASGI: streaming stays unbuffered)."""

    def __init__(self, app, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.on_http(scope.get("path", ""), status)


def build_server(args: AppArgs, driver_actor: bool = False) -> tuple[FastAPI, AsyncLLMEngine]:
    """Load the engine for ``args`` and wrap it in the app (the caller shuts the engine down).

    driver_actor: the engine core runs in a Ray actor of its own (``engine_core.ActorCore``,
    placed by ``DeploymentArgs.driver_placement``), not in this process."""
    from aspire_ray.engine.engine import LLMEngine, load_tokenizer

    metrics = ServingMetrics(args.served_name, args.engine.spec_mode)
    cfg = args.engine.to_engine_config()
    if driver_actor:
        from .engine_core import ActorCore

        # the driver first: it resolves (and, for a GGUF, converts) the model once
        core = ActorCore(cfg, cpu_threads=args.server.cpu_threads,
                         placement_timeout_s=args.deployment.driver_placement_timeout_s,
                         **args.deployment.driver_placement(args.engine))  # fmt: skip
        try:
            engine = AsyncLLMEngine(core, metrics, tokenizer=load_tokenizer(cfg))
        except Exception:
            core.shutdown()
            raise
        return create_app(engine, args, metrics), engine
    if args.server.cpu_threads is not None:
        import torch

        torch.set_num_threads(args.server.cpu_threads or os.cpu_count() or 1)
    engine = AsyncLLMEngine(LLMEngine(cfg), metrics)
    return create_app(engine, args, metrics), engine

"""Per-replica caps (``ServerArgs``): how much one request may ask for, and how many
generation requests a replica serves at once.

A request over a cap gets a 400 naming the field it must shrink; a request beyond the
concurrency cap gets a 429 before any work is done. The body-size cap (413) is applied while
reading the body (``app._parse``); prompt + max_tokens against the context and the KV pool is
checked in ``OpenAIServing`` (400 ``context_length_exceeded``).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .errors import APIError, bad_request
from .metrics import ServingMetrics
from .settings import ServerArgs

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def check_choices(server: ServerArgs, n: int, num_prompts: int, num_stops: int) -> None:
    """n (per prompt) and stop strings; before tokenizing, as they cost nothing to check."""
    if n * num_prompts > server.max_n:
        what = f"n * number of prompts ({n} * {num_prompts})" if num_prompts > 1 else "n"
        raise bad_request(f"n: {what} = {n * num_prompts} exceeds this server's limit of "
                          f"{server.max_n} choices per request", param="n")
    if num_stops > server.max_stop_strings:
        raise bad_request(f"stop: {num_stops} stop strings exceed this server's limit of "
                          f"{server.max_stop_strings}", param="stop")


def check_max_tokens(server: ServerArgs, value: int | None, param: str) -> None:
    cap = server.max_output_tokens
    if value is not None and cap is not None and value > cap:
        raise bad_request(f"{param}: {value} exceeds this server's limit of {cap} output "
                          f"tokens per request", param=param)


def default_max_tokens(server: ServerArgs, room: int) -> int:
    """max_tokens of a request that sets none: the rest of the context, at most the cap."""
    cap = server.max_output_tokens
    return room if cap is None else min(room, cap)


def check_prompt(server: ServerArgs, num_tokens: int, param: str) -> None:
    cap = server.max_prompt_tokens
    if cap is not None and num_tokens > cap:
        raise bad_request(f"{param}: {num_tokens} prompt tokens exceed this server's limit of "
                          f"{cap}", param=param)


class ConcurrencyLimit:
    """ASGI middleware: at most ``cap`` generation requests in flight; more get a 429.

    A request counts from its arrival until the inner app returns, which is after the last
    body chunk of a stream, after a client disconnect and after an error alike (the count is
    released in ``finally``). Only the event loop touches the count, so it needs no lock; it
    is published as the ``aspire_http_requests_in_flight`` gauge.
    """

    def __init__(self, app, cap: int | None, metrics: ServingMetrics) -> None:
        self.app = app
        self.cap = cap
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.cap is not None and self.metrics.in_flight >= self.cap:
            err = APIError(429, f"too many concurrent requests: this replica serves at most "
                           f"{self.cap} at once; retry later", type="requests",
                           code="rate_limit_exceeded")
            await JSONResponse(err.body(), status_code=429,
                               headers={"Retry-After": "1"})(scope, receive, send)
            return
        self.metrics.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.metrics.in_flight -= 1

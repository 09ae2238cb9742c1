"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every failure the server reports goes through ``APIError`` so clients (the ``openai`` package
included) see the shape they expect, and a bad request never takes the server down.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    """A request-level failure that becomes one OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an exception; every in-flight and new request fails."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, naming the offending field (``messages.0.content``)."""
    errors = exc.errors(include_url=False)
    # Inside a union every member reports; a value error (too long, out of range) says more
    # than "should be a valid string" from a member the value was never meant to match.
    err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    # pydantic appends the union member it tried (``str``, ``list[int]``); drop those for
    # a readable field name.
    loc = [p for p in loc if not any(ch in p for ch in "[]") and p not in ("str", "int")]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    depth = len(err["loc"])
    tried = [e["loc"][-1] for e in errors
             if depth >= 2 and len(e["loc"]) == depth and e["loc"][:-1] == err["loc"][:-1]]
    if err["type"].endswith("_type") and len(tried) > 1:  # no member of a union matched
        msg = "Input should be one of: " + ", ".join(str(t) for t in tried)
    if "input" in err and err.get("type") != "missing":
        shown = repr(err["input"])
        msg = f"{msg} (got {shown[:80] + '...' if len(shown) > 80 else shown})"
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is unavailable: {reason}", type="server_error",
                    code="engine_unhealthy")


def internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")

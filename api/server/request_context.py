"""The request id: accepted from `X-Request-Id` or generated, carried in a contextvar so that
every log line (api/server/logs.py), usage row (api/usage/accounting.py) and span (api/server/tracing.py) of the
request names it, and returned on every response, errors included.

    app.asgi_handler = RequestIdMiddleware(app.asgi_handler, tracing=None)   # api/server/app.py
    current_request_id() -> str | None          # inside a request's task (and its children)
    bind_tenant(name)                           # the authenticated tenant, for logs and spans
    snapshot() -> RequestRef                    # what the metrics keep per engine request

A client's id is used as sent when it is 1 to 128 characters of [A-Za-z0-9._:/+=@-]; any other
value (too long, spaces, control characters, non-ASCII) is replaced by a generated one rather
than refused: a bad correlation id must not fail a request, and a value that could forge log
lines never reaches them. The response's X-Request-Id always says which id was used.
"""

from __future__ import annotations

import contextvars
import re
import uuid
from dataclasses import dataclass
from typing import Any

HEADER = b"x-request-id"
MAX_LEN = 128
_VALID = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tessera_request_id", default=None
)
_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("tessera_tenant", default=None)


def current_request_id() -> str | None:
    return _request_id.get()


def current_tenant() -> str | None:
    return _tenant.get()


def bind_tenant(name: str | None) -> None:
    """Called once the request's key is known (it runs in the request's own context)."""
    _tenant.set(name)


def accept_request_id(raw: bytes | None) -> str:
    """The client's id if it is well-formed, else a new one."""
    if raw is not None and _VALID.fullmatch(raw):
        return raw.decode("ascii")
    return uuid.uuid4().hex


@dataclass(slots=True, frozen=True)
class RequestRef:
    """A request's ids as seen when its engine request started (the console, spans)."""

    x_request_id: str | None
    tenant: str | None
    trace_context: Any = None  # the OpenTelemetry context of its server span, if tracing


def snapshot(trace_context: Any = None) -> RequestRef:
    return RequestRef(_request_id.get(), _tenant.get(), trace_context)


class RequestIdMiddleware:
    """Outermost ASGI wrapper: sets the request id for the request's task, opens its server
    span (when tracing is on) and adds X-Request-Id to the response head."""

    def __init__(self, app: Any, tracing: Any = None) -> None:
        self.app = app
        self.tracing = tracing  # api.server.tracing.Tracing or None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = None
        for name, value in scope.get("headers", ()):
            if name == HEADER:
                raw = value
                break
        request_id = accept_request_id(raw)
        scope.setdefault("state", {})["request_id"] = request_id
        header = (HEADER, request_id.encode("ascii"))

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != HEADER]
                message = {**message, "headers": [*headers, header]}
                if span is not None:
                    self.tracing.response_started(span, message["status"])
            await send(message)

        token = _request_id.set(request_id)
        tenant_token = _tenant.set(None)
        span = None
        try:
            if self.tracing is None:
                await self.app(scope, receive, send_with_id)
                return
            with self.tracing.server_span(scope, request_id) as span:
                await self.app(scope, receive, send_with_id)
        finally:
            _tenant.reset(tenant_token)
            _request_id.reset(token)


__all__ = [
    "RequestIdMiddleware",
    "RequestRef",
    "accept_request_id",
    "bind_tenant",
    "current_request_id",
    "current_tenant",
    "snapshot",
]

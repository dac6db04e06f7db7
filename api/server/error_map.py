"""Every exception a route can end with, as an APIError: the one mapping behind the error
envelopes (the app's OpenAI one, and any other surface's, e.g. api/anthropic/).

    handlers = error_handlers(render)   # Litestar exception_handlers rendering bodies with
                                        # render(APIError) -> dict

Litestar's own errors (bad JSON, validation, 404 route, 405, 413, 415) get a message that
says what to change; the engine's refusals are 503; a database outage is 503, never 401;
anything unexpected is a logged 500. A request whose client left gets an empty 499. Each
error response of a generation route that an authenticated key sent gets its ledger row
(api/usage/refusals.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from sqlalchemy.exc import SQLAlchemyError

from api.openai.streaming import ClientDisconnected
from api.server.errors import APIError, unavailable
from api.usage.refusals import record_refusal
from engine.errors import EngineDeadError, QueueFullError

logger = logging.getLogger("tessera.api")

STATUS_CODES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_denied", "permission_denied"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("rate_limit_exceeded", "rate_limit_exceeded"),
}
CLIENT_GONE = 499


def as_api_error(request: Request, exc: BaseException) -> APIError | None:
    """The APIError `exc` is answered with; None for a client that left (nobody reads it)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, HTTPException):
        return _http_error(request, exc)
    if isinstance(exc, QueueFullError | EngineDeadError):
        return unavailable(str(exc) or "The engine cannot take requests now; retry shortly.", 1)
    if isinstance(exc, ClientDisconnected):
        return None
    if isinstance(exc, TimeoutError | SQLAlchemyError):  # --db-timeout (admin REST, console)
        logger.warning("Database unavailable on %s (%s)", request.url.path, type(exc).__name__)
        return unavailable("The database is unavailable; try again shortly.")
    logger.error("Unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, "Internal server error.", "server_error", code="internal_error")


def error_handlers(render: Callable[[APIError], Any]) -> dict[type[BaseException], Any]:
    """Litestar exception handlers answering every exception as `render(as_api_error(...))`
    with the error's status and headers."""

    def handle(request: Request, exc: Exception) -> Response:
        err = as_api_error(request, exc)
        if err is None:
            return Response(b"", status_code=CLIENT_GONE)
        record_refusal(request, err.status_code)  # a generation refused before admission
        return Response(render(err), status_code=err.status_code, headers=err.headers)

    kinds = (APIError, HTTPException, QueueFullError, EngineDeadError, ClientDisconnected)
    return {kind: handle for kind in (*kinds, TimeoutError, SQLAlchemyError, Exception)}


def _http_error(request: Request, exc: HTTPException) -> APIError:
    """Litestar's own errors (bad JSON, validation, 404 route, 405, 413) with a message."""
    status = exc.status_code
    type_, code = STATUS_CODES.get(status, ("server_error", None))
    message, param = exc.detail, None
    if isinstance(exc, ValidationException):
        message, param = _validation_message(exc)
    elif status == 413:
        limit = request.app.state.server.settings.max_body_size
        message = (
            f"The request body is larger than this server accepts ({limit} bytes); "
            "send a smaller body or raise --max-body-size."
        )
    elif status == 404:
        message = f"No route for {request.method} {request.url.path}."
    return APIError(status, message, type_, code=code, param=param, headers=dict(exc.headers or {}))


def _validation_message(exc: ValidationException) -> tuple[str, str | None]:
    extra = exc.extra if isinstance(exc.extra, list) else []
    problems, param = [], None
    for item in extra:
        if not isinstance(item, dict):
            continue
        key = item.get("key")
        msg = item.get("message", "invalid value")
        if key == "data" and str(msg).strip("'") == "data":  # Litestar's: a missing body
            return "The request body is empty: send a JSON object.", None
        if key and key != "body":
            param = param or key.removeprefix("$.")
            problems.append(f"`{key.removeprefix('$.')}`: {msg}")
        else:
            problems.append(str(msg))
    if not problems:
        return f"Invalid request: {exc.detail}", None
    return "Invalid request body: " + "; ".join(problems) + ".", param

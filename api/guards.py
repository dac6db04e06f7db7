"""Litestar guards and dependencies for authentication.

Guards run on the matched route handler, so access is decided by the route Litestar
matched, never by a path rebuilt from the Host header or the raw URL. Routes deny by
default: every controller of inference, tokenizer and admin routes declares a guard.

    guards=[require_api_key]          # inference / tokenizer routes
    guards=[require_admin]            # /admin/v1, and /metrics when it is protected
    dependencies={"principal": Provide(provide_principal, sync_to_thread=False)}
    async def handler(principal: NamedDependency[Principal]) -> ...

Both guards read `app.state.authenticator` (an api.auth.Authenticator) and raise
api.errors.APIError (401, or 503 on a database outage), which the app's exception handler
renders as the OpenAI error envelope. require_api_key stores the Principal in the
connection's state, where provide_principal (and check_model) find it.
"""

from __future__ import annotations

from litestar.connection import ASGIConnection, Request
from litestar.handlers.base import BaseRouteHandler

from api.auth import Authenticator, Principal

PRINCIPAL_STATE_KEY = "principal"


def _authenticator(connection: ASGIConnection) -> Authenticator:
    return connection.app.state.authenticator


async def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    principal = await _authenticator(connection).authenticate(
        connection.headers.get("authorization")
    )
    connection.state[PRINCIPAL_STATE_KEY] = principal


def require_admin(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    principal = _authenticator(connection).authenticate_admin(
        connection.headers.get("authorization")
    )
    connection.state[PRINCIPAL_STATE_KEY] = principal


def principal_of(connection: ASGIConnection) -> Principal:
    principal = connection.state.get(PRINCIPAL_STATE_KEY)
    assert isinstance(principal, Principal), "route is missing an authentication guard"
    return principal


def provide_principal(request: Request) -> Principal:
    """Dependency: the Principal a guard authenticated for this request."""
    return principal_of(request)


def check_model(connection: ASGIConnection, model: str) -> None:
    """403 permission_denied unless the caller's key may use `model`."""
    _authenticator(connection).check_model(principal_of(connection), model)

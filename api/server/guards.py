"""Litestar guards and dependencies for authentication.

Guards run on the matched route handler, so access is decided by the route Litestar
matched, never by a path rebuilt from the Host header or the raw URL. Routes deny by
default: every controller of inference, tokenizer and admin routes declares a guard.

    guards=[require_api_key]          # inference / tokenizer routes
    guards=[require_admin]            # /admin/v1, and /metrics when it is protected
    dependencies={"principal": Provide(provide_principal, sync_to_thread=False)}
    async def handler(principal: NamedDependency[Principal]) -> ...

Both guards read `app.state.authenticator` (an api.keys.auth.Authenticator) and raise
api.server.errors.APIError (401, or 503 on a database outage; require_admin 429 while the client is
locked out after wrong admin tokens), which the app's exception handler renders as the
OpenAI error envelope. require_api_key stores the Principal in the
connection's state, where provide_principal (and check_model) find it.
"""

from __future__ import annotations

from litestar.connection import ASGIConnection, Request
from litestar.handlers.base import BaseRouteHandler

from api.keys.auth import Authenticator, Principal, key_shaped, parse_bearer
from api.server.errors import APIError
from api.server.login_throttle import api_throttle_of, check_secret, client_address

PRINCIPAL_STATE_KEY = "principal"


def _authenticator(connection: ASGIConnection) -> Authenticator:
    return connection.app.state.authenticator


async def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """An API key, or the admin token: so the API routes have a lockout of their own
    (api/server/login_throttle.py): a wrong token that is not shaped like a database key counts
    as a failure, and while the client is locked out the admin token is not compared (401,
    like any wrong key); database keys are never held back."""
    await authenticate_header(connection, connection.headers.get("authorization"))


async def authenticate_header(connection: ASGIConnection, header: str | None) -> None:
    """require_api_key's work on an `Authorization`-style header (`Bearer <key>`), wherever
    the caller found the key (api/anthropic/ also reads `x-api-key`)."""
    auth = _authenticator(connection)
    throttle = api_throttle_of(connection.app)
    token = _bearer_token(header) if header else None
    if (
        throttle is None
        or auth.mode == "none"
        or not auth.has_admin_token
        or token is None
        or key_shaped(token)  # a database key (most requests): no throttle work at all
    ):
        connection.state[PRINCIPAL_STATE_KEY] = await auth.authenticate(header)
        return
    client = client_address(connection)
    locked = throttle.locked_for(client)
    try:
        principal = await auth.authenticate(header, admin=locked <= 0)
    except APIError as exc:
        if exc.status_code == 401 and locked <= 0:
            throttle.failure(client, "api")
        raise
    if principal.is_admin:
        throttle.success(client)
    connection.state[PRINCIPAL_STATE_KEY] = principal


def _bearer_token(header: str) -> str | None:
    try:
        return parse_bearer(header)
    except APIError:
        return None  # malformed: it could not have been the admin token either


def require_admin(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """The admin token, under the per-client lockout of wrong ones (api/server/login_throttle.py):
    429 with Retry-After during a lockout, the token unchecked."""
    header = connection.headers.get("authorization")
    principal = check_secret(
        connection,
        "admin_api",
        lambda: _authenticator(connection).authenticate_admin(header),
        attempted=bool(header),
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

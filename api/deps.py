"""Who is calling, and the server state: the dependencies every /v1 route shares.

Authentication happens in one place, the `require_principal` guard (guards run before the
body is read, so a bad key gets 401 before any 400/413). It stores the Principal on the
connection; handlers receive it through the `principal` dependency.

Plug-in point for database keys: put an api.auth.Authenticator on `app.state.authenticator`
and the guard delegates to it. Without one, `authenticate` below checks the static
`--api-key` keys, vLLM-compatible: `Authorization: Bearer <one of the keys>`.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection, Request

from api.errors import invalid_api_key
from api.lifespan import ServerState


@dataclass(slots=True, frozen=True)
class Principal:
    """The caller of a /v1 request, as the engine and the usage records need it."""

    name: str  # for logs and usage records
    key_id: str | None = None
    priority: int = 0  # lower runs first under the "priority" scheduling policy
    cache_salt: str | None = None  # isolates this tenant's prefix-cache entries


ANONYMOUS = Principal(name="anonymous")
STATIC_KEY = Principal(name="static-key")


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def authenticate(connection: ASGIConnection, state: ServerState) -> Principal:
    settings = state.settings
    if settings.auth == "none":
        return ANONYMOUS
    token = bearer_token(connection.headers.get("authorization"))
    if token is None:
        raise invalid_api_key(
            "Missing API key: send it as `Authorization: Bearer <key>` "
            "(the OpenAI SDK's api_key does this)."
        )
    # Compare against every key so the time taken does not tell which key almost matched.
    matched = False
    for key in settings.api_key:
        matched |= hmac.compare_digest(token.encode(), key.encode())
    if matched:
        return STATIC_KEY
    if not settings.api_key:
        raise invalid_api_key(
            "No API keys are configured on this server: start it with --api-key KEY "
            "(or TESSERA_API_KEY), or with --auth none for an open server."
        )
    raise invalid_api_key("Incorrect API key provided.")


def server_state(connection: ASGIConnection) -> ServerState:
    return connection.app.state.server


async def require_principal(connection: ASGIConnection, _handler: Any) -> None:
    """Guard for the /v1 routes (and /tokenize, /detokenize).

    When the app carries an api.auth.Authenticator (database keys, quotas), it decides;
    otherwise the static-key check above does."""
    authenticator = connection.app.state.get("authenticator")
    if authenticator is not None:
        principal = await authenticator.authenticate(connection.headers.get("authorization"))
    else:
        principal = await authenticate(connection, server_state(connection))
    connection.state.principal = principal


def check_model_access(connection: ASGIConnection, principal: Any, model: str) -> None:
    """403 permission_denied when the caller's key may not use `model` (database keys)."""
    authenticator = connection.app.state.get("authenticator")
    if authenticator is not None:
        authenticator.check_model(principal, model)


def provide_principal(request: Request) -> Any:
    return request.state.principal


def provide_server(request: Request) -> ServerState:
    return server_state(request)

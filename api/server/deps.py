"""Who is calling, and the server state: the dependencies every /v1 route shares.

Authentication happens in one place, the `require_principal` guard (api/server/guards.py's
require_api_key: guards run on the matched route, before the body is read, so a bad key gets
401 before any 400/413). It asks `app.state.authenticator` (api.keys.auth.Authenticator, built by
api/server/access.py for every auth mode: database keys, static --api-key keys, or none) and stores
the api.keys.auth.Principal on the connection; handlers receive it as the `principal` dependency.
"""

from __future__ import annotations

from litestar import Controller
from litestar.connection import ASGIConnection, Request
from litestar.di import Provide

from api.server.body import require_json_body
from api.server.guards import check_model as check_model_access
from api.server.guards import provide_principal
from api.server.guards import require_api_key as require_principal
from api.server.lifespan import ServerState


def server_state(connection: ASGIConnection) -> ServerState:
    return connection.app.state.server


def provide_server(request: Request) -> ServerState:
    return server_state(request)


class ClientController(Controller):
    """A controller of the client API (/v1): the caller's key checked first, then the JSON
    body (api/server/body.py), so a bad key gets 401 before any 400/413; handlers take the
    `principal` and `server` dependencies. A surface with its own key header (Anthropic's
    x-api-key) replaces the first guard."""

    guards = [require_principal, require_json_body]
    dependencies = {
        "principal": Provide(provide_principal, sync_to_thread=False),
        "server": Provide(provide_server, sync_to_thread=False),
    }


__all__ = [
    "ClientController",
    "check_model_access",
    "provide_principal",
    "provide_server",
    "require_principal",
    "server_state",
]

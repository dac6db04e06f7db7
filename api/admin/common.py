"""What the admin API's controllers share: the base controller (the /admin/v1 path, the admin
guard, the tag and the security requirement), the services on app.state, and service errors
as HTTP errors. The routes are listed in api/admin/routes.py.

Needs on app.state: `keys` (KeyService), `tenants` (TenantService), `authenticator`
(Authenticator; its cache is dropped after every change so this replica applies edits at
once, other replicas within the cache TTL) and `engine_stats` (a zero-argument callable
returning a dict). They are read as `state["keys"]` (key_service, tenant_service):
`state.keys` is State's own Mapping method. Errors are api.server.errors.APIError (the app
renders the OpenAI envelope). OpenAPI: the routes carry the security requirement
ADMIN_SECURITY_NAME; the app registers ADMIN_SECURITY_SCHEME under that name in its
OpenAPIConfig components.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from litestar import Controller
from litestar.datastructures import State
from litestar.openapi.spec import Operation, SecurityScheme

from api.keys.auth import DB_ERRORS
from api.keys.service import KeyNotFound, KeyService
from api.server.body import require_json_body
from api.server.errors import APIError, invalid_request, unavailable
from api.server.guards import require_admin
from api.tenants.service import TenantNotFound, TenantService

log = logging.getLogger("api.admin.routes")  # the name its lines have always carried

ADMIN_SECURITY_NAME = "AdminToken"
ADMIN_SECURITY_SCHEME = SecurityScheme(
    type="http",
    scheme="bearer",
    description="The admin token (--admin-token or TESSERA_ADMIN_TOKEN).",
)


def not_found(key_id: str) -> APIError:
    return APIError(404, f"No API key with id `{key_id}`.", code="not_found", param="id")


def tenant_not_found(tenant_id: str, param: str = "id") -> APIError:
    """404 for the tenant a path names; 400 for one a body field names (the route exists,
    the request is what is wrong)."""
    if param == "id":
        return APIError(404, f"No tenant with id `{tenant_id}`.", code="not_found", param=param)
    return invalid_request(f"No tenant with id `{tenant_id}`.", param)


@dataclass
class OptionalBodyOperation(Operation):
    """The OpenAPI operation of a route whose JSON body may be left out (Litestar marks every
    body required)."""

    def __post_init__(self) -> None:
        if self.request_body is not None:
            self.request_body.required = False


class AdminController(Controller):
    """The base of the admin API's controllers: no routes of its own."""

    path = "/admin/v1"
    guards = [require_admin, require_json_body]  # auth first, then the body (api/server/body.py)
    tags = ["admin"]
    security = [{ADMIN_SECURITY_NAME: []}]


def key_service(state: State) -> KeyService:
    # Item access: `state.keys` is State's Mapping method, not the service.
    return state["keys"]


def tenant_service(state: State) -> TenantService:
    return state["tenants"]


def changed(state: State) -> None:
    """After a change: drop the authenticator's cache, so this replica applies it at once."""
    authenticator = state.get("authenticator")
    if authenticator is not None:
        authenticator.invalidate()


async def call(awaitable: Any, key_id: str | None = None, tenant_param: str = "id") -> Any:
    """Service errors -> HTTP errors: unknown id 404, bad input 400, database down 503."""
    try:
        return await awaitable
    except KeyNotFound:
        raise not_found(key_id or "") from None
    except TenantNotFound as exc:
        raise tenant_not_found(exc.tenant_id, tenant_param) from None
    except ValueError as exc:
        raise invalid_request(str(exc)) from None
    except DB_ERRORS as exc:
        log.warning("admin API: database unavailable (%s)", type(exc).__name__)
        raise unavailable("The database is unavailable; try again shortly.") from None

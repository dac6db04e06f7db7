"""The admin REST API under /admin/v1, behind the admin token (Bearer).

    POST   /admin/v1/keys                 create -> 201 KeyWithSecret (the only time `key` shows)
    GET    /admin/v1/keys                 list (no secrets); ?include_revoked=false to hide revoked
                                          (a key created with `tenant_id` joins that tenant,
                                          else it gets a tenant of its own)
    GET    /admin/v1/keys/{id}            one key
    PATCH  /admin/v1/keys/{id}            change fields; null = unlimited
    DELETE /admin/v1/keys/{id}            revoke (200, the revoked key)
    POST   /admin/v1/keys/{id}/rotate     new secret -> 200 KeyWithSecret; old one valid for
                                          {"grace_seconds"} (the body is optional: 3600)
    POST   /admin/v1/tenants              create -> 201 TenantInfo
    GET    /admin/v1/tenants              list; ?include_disabled=false to hide disabled ones
    GET    /admin/v1/tenants/{id}         one tenant
    PATCH  /admin/v1/tenants/{id}         change weight, limits, scope, name; disabled: bool
    DELETE /admin/v1/tenants/{id}         disable (200, the tenant): its keys are refused
    GET    /admin/v1/tenants/{id}/keys    its keys (no secrets)
    GET    /admin/v1/usage                ?key_id=&tenant_id=&since=&until=&group_by=day|hour
                                          (since/until: RFC 3339 with an offset, or Unix
                                          seconds from 2000 to 2100; else 400)
    GET    /admin/v1/engine               engine state (running/waiting, KV usage)

Needs on app.state: `keys` (KeyService), `tenants` (TenantService), `authenticator` (Authenticator; its cache is
dropped after every change so this replica applies edits at once, other replicas within
the cache TTL) and `engine_stats` (a zero-argument callable returning a dict). They are
read as `state["keys"]`: `state.keys` is State's own Mapping method. Errors are
api.server.errors.APIError (the app renders the OpenAI envelope). OpenAPI: the routes carry the
security requirement ADMIN_SECURITY_NAME; the app registers ADMIN_SECURITY_SCHEME under
that name in its OpenAPIConfig components.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

import msgspec
from litestar import Controller, delete, get, patch, post
from litestar.datastructures import State
from litestar.openapi.spec import Operation, SecurityScheme
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter

from api.admin.schemas import (
    TIME_QUERY_SCHEMA,
    KeyCreate,
    KeyInfo,
    KeyList,
    KeyRotate,
    KeyUpdate,
    KeyWithSecret,
    TenantCreate,
    TenantInfo,
    TenantList,
    TenantUpdate,
    UsageReport,
    key_info,
    key_with_secret,
    parse_time,
    tenant_info,
    usage_item,
)
from api.keys.auth import DB_ERRORS
from api.keys.service import GROUP_BY, KeyNotFound, KeyService
from api.server.body import require_json_body
from api.server.errors import APIError, invalid_request, unavailable
from api.server.guards import require_admin
from api.tenants.service import TenantNotFound, TenantService

log = logging.getLogger(__name__)

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
    path = "/admin/v1"
    guards = [require_admin, require_json_body]  # auth first, then the body (api/server/body.py)
    tags = ["admin"]
    security = [{ADMIN_SECURITY_NAME: []}]

    @post("/keys", status_code=201, summary="Create an API key")
    async def create_key(self, state: State, data: JSONBody[KeyCreate]) -> KeyWithSecret:
        fields = msgspec.structs.asdict(data)
        name = fields.pop("name")
        record, plaintext = await _call(_keys(state).create(name, **fields), None, "tenant_id")
        return key_with_secret(record, plaintext)

    @get("/keys", summary="List API keys (never their secrets)")
    async def list_keys(self, state: State, include_revoked: FromQuery[bool] = True) -> KeyList:
        records = await _call(_keys(state).list(include_revoked=include_revoked))
        return KeyList(data=[key_info(r) for r in records])

    @get("/keys/{key_id:str}", summary="Get an API key")
    async def get_key(self, state: State, key_id: FromPath[str]) -> KeyInfo:
        record = await _call(_keys(state).get(key_id))
        if record is None:
            raise not_found(key_id)
        return key_info(record)

    @patch("/keys/{key_id:str}", summary="Change an API key's name, limits or metadata")
    async def update_key(
        self, state: State, key_id: FromPath[str], data: JSONBody[KeyUpdate]
    ) -> KeyInfo:
        record = await _call(_keys(state).update(key_id, **data.changes()), key_id, "tenant_id")
        _changed(state)
        return key_info(record)

    @delete("/keys/{key_id:str}", status_code=200, summary="Revoke an API key")
    async def revoke_key(self, state: State, key_id: FromPath[str]) -> KeyInfo:
        record = await _call(_keys(state).revoke(key_id), key_id)
        _changed(state)
        return key_info(record)

    @post(
        "/keys/{key_id:str}/rotate",
        status_code=200,
        summary="Rotate an API key's secret",
        description="The body is optional: without one (or with null) the old secret stays "
        "valid for 3600 s.",
        operation_class=OptionalBodyOperation,
    )
    async def rotate_key(
        self, state: State, key_id: FromPath[str], data: JSONBody[KeyRotate | None] = None
    ) -> KeyWithSecret:
        grace = (data or KeyRotate()).grace_seconds
        record, plaintext = await _call(_keys(state).rotate(key_id, grace_seconds=grace), key_id)
        _changed(state)
        return key_with_secret(record, plaintext)

    @post("/tenants", status_code=201, summary="Create a tenant")
    async def create_tenant(self, state: State, data: JSONBody[TenantCreate]) -> TenantInfo:
        fields = msgspec.structs.asdict(data)
        name = fields.pop("name")
        return tenant_info(await _call(_tenants(state).create(name, **fields)))

    @get("/tenants", summary="List tenants")
    async def list_tenants(
        self, state: State, include_disabled: FromQuery[bool] = True
    ) -> TenantList:
        records = await _call(_tenants(state).list(include_disabled=include_disabled))
        return TenantList(data=[tenant_info(r) for r in records])

    @get("/tenants/{tenant_id:str}", summary="Get a tenant")
    async def get_tenant(self, state: State, tenant_id: FromPath[str]) -> TenantInfo:
        record = await _call(_tenants(state).get(tenant_id))
        if record is None:
            raise tenant_not_found(tenant_id)
        return tenant_info(record)

    @patch("/tenants/{tenant_id:str}", summary="Change a tenant's weight, limits or scope")
    async def update_tenant(
        self, state: State, tenant_id: FromPath[str], data: JSONBody[TenantUpdate]
    ) -> TenantInfo:
        record = await _call(_tenants(state).update(tenant_id, **data.changes()))
        _changed(state)
        return tenant_info(record)

    @delete("/tenants/{tenant_id:str}", status_code=200, summary="Disable a tenant")
    async def disable_tenant(self, state: State, tenant_id: FromPath[str]) -> TenantInfo:
        record = await _call(_tenants(state).disable(tenant_id))
        _changed(state)
        return tenant_info(record)

    @get("/tenants/{tenant_id:str}/keys", summary="A tenant's API keys (never their secrets)")
    async def tenant_keys(self, state: State, tenant_id: FromPath[str]) -> KeyList:
        if await _call(_tenants(state).get(tenant_id)) is None:
            raise tenant_not_found(tenant_id)
        records = await _call(_keys(state).list(tenant_id=tenant_id))
        return KeyList(data=[key_info(r) for r in records])

    @get("/usage", summary="Usage per key and per day or hour (UTC)")
    async def usage(
        self,
        state: State,
        key_id: FromQuery[str | None] = None,
        since: Annotated[str | None, _time_query("inclusive")] = None,
        until: Annotated[str | None, _time_query("exclusive")] = None,
        group_by: Annotated[str, QueryParameter(description="day or hour (UTC)")] = "day",
        tenant_id: FromQuery[str | None] = None,
    ) -> UsageReport:
        if group_by not in GROUP_BY:
            raise invalid_request("group_by must be `day` or `hour`.", param="group_by")
        start, end = _time(since, "since"), _time(until, "until")
        buckets = await _call(
            _keys(state).usage(
                key_id=key_id, since=start, until=end, group_by=group_by, tenant_id=tenant_id
            )
        )
        return UsageReport(
            group_by=group_by, since=start, until=end, data=[usage_item(b) for b in buckets]
        )

    @get("/engine", summary="Engine state: running / waiting requests, KV cache usage")
    async def engine(self, state: State) -> dict[str, Any]:
        return dict(state["engine_stats"]())


def _time_query(bound: str) -> QueryParameter:
    return QueryParameter(
        description=f"{bound}: an RFC 3339 date-time with Z or an offset "
        "(2025-06-01T00:00:00Z), or Unix seconds (2000 to 2100)",
        # The schema is this one alone, not also Litestar's oneOf [string, null].
        schema_extra={**TIME_QUERY_SCHEMA, "oneOf": None},
    )


def _time(value: str | None, param: str) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_time(value, param)
    except ValueError as exc:
        raise invalid_request(str(exc), param) from None


def _keys(state: State) -> KeyService:
    # Item access: `state.keys` is State's Mapping method, not the service.
    return state["keys"]


def _tenants(state: State) -> TenantService:
    return state["tenants"]


def _changed(state: State) -> None:
    authenticator = state.get("authenticator")
    if authenticator is not None:
        authenticator.invalidate()


async def _call(awaitable: Any, key_id: str | None = None, tenant_param: str = "id") -> Any:
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

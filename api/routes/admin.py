"""The admin REST API under /admin/v1, behind the admin token (Bearer).

    POST   /admin/v1/keys                 create -> 201 KeyWithSecret (the only time `key` shows)
    GET    /admin/v1/keys                 list (no secrets); ?include_revoked=false to hide revoked
    GET    /admin/v1/keys/{id}            one key
    PATCH  /admin/v1/keys/{id}            change fields; null = unlimited
    DELETE /admin/v1/keys/{id}            revoke (200, the revoked key)
    POST   /admin/v1/keys/{id}/rotate     new secret -> 200 KeyWithSecret; old one valid for
                                          {"grace_seconds"} (default 3600)
    GET    /admin/v1/usage                ?key_id=&since=&until=&group_by=day|hour
    GET    /admin/v1/engine               engine state (running/waiting, KV usage)

Needs on app.state: `keys` (KeyService), `authenticator` (Authenticator; its cache is
dropped after every change so this replica applies edits at once, other replicas within
the cache TTL) and `engine_stats` (a zero-argument callable returning a dict). They are
read as `state["keys"]`: `state.keys` is State's own Mapping method. Errors are
api.errors.APIError (the app renders the OpenAI envelope). OpenAPI: the routes carry the
security requirement ADMIN_SECURITY_NAME; the app registers ADMIN_SECURITY_SCHEME under
that name in its OpenAPIConfig components.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Annotated, Any

import msgspec
from litestar import Controller, delete, get, patch, post
from litestar.datastructures import State
from litestar.openapi.spec import SecurityScheme
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter

from api.auth import DB_ERRORS
from api.body import require_json_body
from api.errors import APIError, invalid_request, unavailable
from api.guards import require_admin
from api.schemas.admin import (
    KeyCreate,
    KeyInfo,
    KeyList,
    KeyRotate,
    KeyUpdate,
    KeyWithSecret,
    UsageReport,
    key_info,
    key_with_secret,
    usage_item,
)
from api.services.keys import GROUP_BY, KeyNotFound, KeyService

log = logging.getLogger(__name__)

ADMIN_SECURITY_NAME = "AdminToken"
ADMIN_SECURITY_SCHEME = SecurityScheme(
    type="http",
    scheme="bearer",
    description="The admin token (--admin-token or TESSERA_ADMIN_TOKEN).",
)


def not_found(key_id: str) -> APIError:
    return APIError(404, f"No API key with id `{key_id}`.", code="not_found", param="id")


class AdminController(Controller):
    path = "/admin/v1"
    guards = [require_admin, require_json_body]  # auth first, then the body (api/body.py)
    tags = ["admin"]
    security = [{ADMIN_SECURITY_NAME: []}]

    @post("/keys", status_code=201, summary="Create an API key")
    async def create_key(self, state: State, data: JSONBody[KeyCreate]) -> KeyWithSecret:
        fields = msgspec.structs.asdict(data)
        name = fields.pop("name")
        record, plaintext = await _call(_keys(state).create(name, **fields))
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
        record = await _call(_keys(state).update(key_id, **data.changes()), key_id)
        _changed(state)
        return key_info(record)

    @delete("/keys/{key_id:str}", status_code=200, summary="Revoke an API key")
    async def revoke_key(self, state: State, key_id: FromPath[str]) -> KeyInfo:
        record = await _call(_keys(state).revoke(key_id), key_id)
        _changed(state)
        return key_info(record)

    @post("/keys/{key_id:str}/rotate", status_code=200, summary="Rotate an API key's secret")
    async def rotate_key(
        self, state: State, key_id: FromPath[str], data: JSONBody[KeyRotate | None] = None
    ) -> KeyWithSecret:
        grace = (data or KeyRotate()).grace_seconds
        record, plaintext = await _call(_keys(state).rotate(key_id, grace_seconds=grace), key_id)
        _changed(state)
        return key_with_secret(record, plaintext)

    @get("/usage", summary="Usage per key and per day or hour (UTC)")
    async def usage(
        self,
        state: State,
        key_id: FromQuery[str | None] = None,
        since: Annotated[datetime | None, QueryParameter(description="inclusive, RFC 3339")] = None,
        until: Annotated[datetime | None, QueryParameter(description="exclusive, RFC 3339")] = None,
        group_by: Annotated[str, QueryParameter(description="day or hour (UTC)")] = "day",
    ) -> UsageReport:
        if group_by not in GROUP_BY:
            raise invalid_request("group_by must be `day` or `hour`.", param="group_by")
        buckets = await _call(
            _keys(state).usage(key_id=key_id, since=since, until=until, group_by=group_by)
        )
        return UsageReport(
            group_by=group_by, since=since, until=until, data=[usage_item(b) for b in buckets]
        )

    @get("/engine", summary="Engine state: running / waiting requests, KV cache usage")
    async def engine(self, state: State) -> dict[str, Any]:
        return dict(state["engine_stats"]())


def _keys(state: State) -> KeyService:
    # Item access: `state.keys` is State's Mapping method, not the service.
    return state["keys"]


def _changed(state: State) -> None:
    authenticator = state.get("authenticator")
    if authenticator is not None:
        authenticator.invalidate()


async def _call(awaitable: Any, key_id: str | None = None) -> Any:
    """Service errors -> HTTP errors: unknown id 404, bad input 400, database down 503."""
    try:
        return await awaitable
    except KeyNotFound:
        raise not_found(key_id or "") from None
    except ValueError as exc:
        raise invalid_request(str(exc)) from None
    except DB_ERRORS as exc:
        log.warning("admin API: database unavailable (%s)", type(exc).__name__)
        raise unavailable("The database is unavailable; try again shortly.") from None

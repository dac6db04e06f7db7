"""The admin API's keys: POST/GET /admin/v1/keys, GET/PATCH/DELETE /admin/v1/keys/{id} and
POST /admin/v1/keys/{id}/rotate (api/admin/routes.py lists them all)."""

from __future__ import annotations

import msgspec
from litestar import delete, get, patch, post
from litestar.datastructures import State
from litestar.params import FromPath, FromQuery, JSONBody

from api.admin.common import (
    AdminController,
    OptionalBodyOperation,
    call,
    changed,
    key_service,
    not_found,
)
from api.admin.schemas import (
    KeyCreate,
    KeyInfo,
    KeyList,
    KeyRotate,
    KeyUpdate,
    KeyWithSecret,
    key_info,
    key_with_secret,
)


class KeysController(AdminController):
    @post("/keys", status_code=201, summary="Create an API key")
    async def create_key(self, state: State, data: JSONBody[KeyCreate]) -> KeyWithSecret:
        fields = msgspec.structs.asdict(data)
        name = fields.pop("name")
        record, plaintext = await call(key_service(state).create(name, **fields), None, "tenant_id")
        return key_with_secret(record, plaintext)

    @get("/keys", summary="List API keys (never their secrets)")
    async def list_keys(self, state: State, include_revoked: FromQuery[bool] = True) -> KeyList:
        records = await call(key_service(state).list(include_revoked=include_revoked))
        return KeyList(data=[key_info(r) for r in records])

    @get("/keys/{key_id:str}", summary="Get an API key")
    async def get_key(self, state: State, key_id: FromPath[str]) -> KeyInfo:
        record = await call(key_service(state).get(key_id))
        if record is None:
            raise not_found(key_id)
        return key_info(record)

    @patch("/keys/{key_id:str}", summary="Change an API key's name, limits or metadata")
    async def update_key(
        self, state: State, key_id: FromPath[str], data: JSONBody[KeyUpdate]
    ) -> KeyInfo:
        record = await call(
            key_service(state).update(key_id, **data.changes()), key_id, "tenant_id"
        )
        changed(state)
        return key_info(record)

    @delete("/keys/{key_id:str}", status_code=200, summary="Revoke an API key")
    async def revoke_key(self, state: State, key_id: FromPath[str]) -> KeyInfo:
        record = await call(key_service(state).revoke(key_id), key_id)
        changed(state)
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
        record, plaintext = await call(
            key_service(state).rotate(key_id, grace_seconds=grace), key_id
        )
        changed(state)
        return key_with_secret(record, plaintext)

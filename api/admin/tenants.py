"""The admin API's tenants: POST/GET /admin/v1/tenants, GET/PATCH/DELETE
/admin/v1/tenants/{id} and GET /admin/v1/tenants/{id}/keys (api/admin/routes.py lists them
all)."""

from __future__ import annotations

import msgspec
from litestar import delete, get, patch, post
from litestar.datastructures import State
from litestar.params import FromPath, FromQuery, JSONBody

from api.admin.common import (
    AdminController,
    call,
    changed,
    key_service,
    tenant_not_found,
    tenant_service,
)
from api.admin.schemas import (
    KeyList,
    TenantCreate,
    TenantInfo,
    TenantList,
    TenantUpdate,
    key_info,
    tenant_info,
)


class TenantsController(AdminController):
    @post("/tenants", status_code=201, summary="Create a tenant")
    async def create_tenant(self, state: State, data: JSONBody[TenantCreate]) -> TenantInfo:
        fields = msgspec.structs.asdict(data)
        name = fields.pop("name")
        return tenant_info(await call(tenant_service(state).create(name, **fields)))

    @get("/tenants", summary="List tenants")
    async def list_tenants(
        self, state: State, include_disabled: FromQuery[bool] = True
    ) -> TenantList:
        records = await call(tenant_service(state).list(include_disabled=include_disabled))
        return TenantList(data=[tenant_info(r) for r in records])

    @get("/tenants/{tenant_id:str}", summary="Get a tenant")
    async def get_tenant(self, state: State, tenant_id: FromPath[str]) -> TenantInfo:
        record = await call(tenant_service(state).get(tenant_id))
        if record is None:
            raise tenant_not_found(tenant_id)
        return tenant_info(record)

    @patch("/tenants/{tenant_id:str}", summary="Change a tenant's weight, limits or scope")
    async def update_tenant(
        self, state: State, tenant_id: FromPath[str], data: JSONBody[TenantUpdate]
    ) -> TenantInfo:
        record = await call(tenant_service(state).update(tenant_id, **data.changes()))
        changed(state)
        return tenant_info(record)

    @delete("/tenants/{tenant_id:str}", status_code=200, summary="Disable a tenant")
    async def disable_tenant(self, state: State, tenant_id: FromPath[str]) -> TenantInfo:
        record = await call(tenant_service(state).disable(tenant_id))
        changed(state)
        return tenant_info(record)

    @get("/tenants/{tenant_id:str}/keys", summary="A tenant's API keys (never their secrets)")
    async def tenant_keys(self, state: State, tenant_id: FromPath[str]) -> KeyList:
        if await call(tenant_service(state).get(tenant_id)) is None:
            raise tenant_not_found(tenant_id)
        records = await call(key_service(state).list(tenant_id=tenant_id))
        return KeyList(data=[key_info(r) for r in records])

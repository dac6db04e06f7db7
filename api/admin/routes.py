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
    GET    /admin/v1/lora_adapters        the served LoRA adapters (api/admin/lora.py)
    POST   /admin/v1/lora_adapters        load {"lora_name", "lora_path", "tenant_id"?} -> 201
    DELETE /admin/v1/lora_adapters/{name} unload (409 while requests run it)
    POST   /v1/load_lora_adapter          vLLM's routes and bodies, under the admin token
    POST   /v1/unload_lora_adapter

A controller per domain, each an AdminController (api/admin/common.py: the path, the admin
guard, the tag, the security requirement, the services on app.state and service errors as
HTTP errors): KeysController (api/admin/keys.py), TenantsController (api/admin/tenants.py),
UsageController (api/admin/usage.py), LoRAController and VLLMLoRAController
(api/admin/lora.py) and EngineController (here). ADMIN_CONTROLLERS lists
them for the app; their wire types are api/admin/schemas.py. The app registers
ADMIN_SECURITY_SCHEME under ADMIN_SECURITY_NAME in its OpenAPIConfig components.
"""

from __future__ import annotations

from typing import Any

from litestar import get
from litestar.datastructures import State

from api.admin.common import ADMIN_SECURITY_NAME, ADMIN_SECURITY_SCHEME, AdminController
from api.admin.keys import KeysController
from api.admin.lora import LoRAController, VLLMLoRAController
from api.admin.tenants import TenantsController
from api.admin.usage import UsageController


class EngineController(AdminController):
    @get("/engine", summary="Engine state: running / waiting requests, KV cache usage")
    async def engine(self, state: State) -> dict[str, Any]:
        return dict(state["engine_stats"]())


# Every admin controller, registered in this order (the OpenAPI document lists their paths so).
ADMIN_CONTROLLERS = (
    KeysController,
    TenantsController,
    UsageController,
    EngineController,
    LoRAController,
    VLLMLoRAController,
)

__all__ = ["ADMIN_CONTROLLERS", "ADMIN_SECURITY_NAME", "ADMIN_SECURITY_SCHEME"]

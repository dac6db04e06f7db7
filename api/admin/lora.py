"""The admin API's LoRA adapters (api/lora/registry.py), behind the admin token:

    GET    /admin/v1/lora_adapters             the served adapters (name, path, owner, in use)
    POST   /admin/v1/lora_adapters             {"lora_name", "lora_path", "tenant_id"?} -> 201
    DELETE /admin/v1/lora_adapters/{name}      unload -> 200 (409 while requests run it)
    POST   /v1/load_lora_adapter               vLLM's route and body (+ tenant_id) -> 200
    POST   /v1/unload_lora_adapter             vLLM's route and body {"lora_name"} -> 200

A refused load (a folder that does not fit the model: rank above --max-lora-rank, target
modules Tessera does not take, tensor shapes of another base model; a name in use; an unknown
tenant) is a 400 whose message names the field; nothing of it is kept. Unloading an adapter
that requests are running is refused with 409 `adapter_in_use` (nothing waits): retry once
they finished. Mounted with the rest of the admin API (a database: owned adapters are rows of
`lora_adapters`, loaded again at start).
"""

from __future__ import annotations

import re

from litestar import Controller, delete, get, post
from litestar.datastructures import State
from litestar.params import FromPath, JSONBody

from api.admin.common import ADMIN_SECURITY_NAME, AdminController, call
from api.admin.schemas import LoRAAdapterInfo, LoRAAdapterList, LoRAAdapterLoad, LoRAAdapterUnload
from api.lora.registry import (
    Adapter,
    AdapterInUse,
    AdapterNotFound,
    AdapterRegistry,
    ModelLoading,
)
from api.server.body import require_json_body
from api.server.errors import APIError, invalid_request, unavailable
from api.server.guards import require_admin

_BODY_FIELD = re.compile(r"^(lora_name|lora_path|tenant_id): ")


def _registry(state: State) -> AdapterRegistry:
    adapters = state["server"].adapters
    if adapters is None:
        raise APIError(  # like vLLM, whose routes are absent then
            404,
            "LoRA is not enabled on this server: start it with --enable-lora.",
            code="not_found",
        )
    return adapters


def _info(adapters: AdapterRegistry, a: Adapter) -> LoRAAdapterInfo:
    return LoRAAdapterInfo(
        name=a.name,
        path=a.path,
        tenant_id=a.tenant_id,
        source=a.source,
        created=int(a.created),
        running=adapters.running(a.name),
    )


async def _load(state: State, data: LoRAAdapterLoad) -> LoRAAdapterInfo:
    adapters = _registry(state)

    async def load() -> Adapter:
        try:
            return await adapters.load(data.lora_name, data.lora_path, data.tenant_id)
        except ModelLoading:
            raise unavailable("The model is still loading; retry shortly.", 5) from None
        except ValueError as exc:  # the message names the field; param: the body's
            m = _BODY_FIELD.match(str(exc))
            raise invalid_request(str(exc), m.group(1) if m else "lora_path") from None

    return _info(adapters, await call(load()))


async def _unload(state: State, name: str) -> LoRAAdapterInfo:
    adapters = _registry(state)
    try:
        adapter = await call(adapters.unload(name))
    except AdapterNotFound:
        raise APIError(
            404, f"No LoRA adapter named `{name}`.", code="not_found", param="lora_name"
        ) from None
    except AdapterInUse as exc:
        raise APIError(
            409,
            f"The LoRA adapter `{name}` is in use by {exc.running} request(s); unload it "
            "once they finished.",
            code="adapter_in_use",
            param="lora_name",
        ) from None
    return _info(adapters, adapter)


class LoRAController(AdminController):
    @get("/lora_adapters", summary="The served LoRA adapters")
    async def list_adapters(self, state: State) -> LoRAAdapterList:
        adapters = _registry(state)
        return LoRAAdapterList(data=[_info(adapters, a) for a in adapters.adapters.values()])

    @post("/lora_adapters", status_code=201, summary="Load a LoRA adapter")
    async def load_adapter(self, state: State, data: JSONBody[LoRAAdapterLoad]) -> LoRAAdapterInfo:
        return await _load(state, data)

    @delete("/lora_adapters/{name:str}", status_code=200, summary="Unload a LoRA adapter")
    async def unload_adapter(self, state: State, name: FromPath[str]) -> LoRAAdapterInfo:
        return await _unload(state, name)


class VLLMLoRAController(Controller):
    """vLLM's runtime LoRA routes, under the admin token here (vLLM gates them behind
    VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

    path = "/v1"
    guards = [require_admin, require_json_body]
    tags = ["admin"]
    security = [{ADMIN_SECURITY_NAME: []}]

    @post("/load_lora_adapter", status_code=200, summary="Load a LoRA adapter (vLLM's route)")
    async def load_lora_adapter(
        self, state: State, data: JSONBody[LoRAAdapterLoad]
    ) -> LoRAAdapterInfo:
        return await _load(state, data)

    @post("/unload_lora_adapter", status_code=200, summary="Unload a LoRA adapter (vLLM's route)")
    async def unload_lora_adapter(
        self, state: State, data: JSONBody[LoRAAdapterUnload]
    ) -> LoRAAdapterInfo:
        return await _unload(state, data.lora_name)

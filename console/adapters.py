"""The LoRA adapters page: the served adapters (api/lora/registry.py) with their owner and
folder, read-only (loading and unloading are the admin API's: README "LoRA adapters over
HTTP")."""

from __future__ import annotations

from litestar import Controller, Request, Response, get

from console.render import page


class AdaptersController(Controller):
    path = "/adapters"

    @get("/")
    async def adapters(self, request: Request) -> Response:
        server = request.app.state.get("server")
        registry = getattr(server, "adapters", None)
        rows = []
        if registry is not None:
            rows = [
                {
                    "name": a.name,
                    "owner": a.tenant_id,
                    "path": a.path,
                    "source": a.source,
                    "running": registry.running(a.name),
                }
                for a in registry.adapters.values()
            ]
        context = {"enabled": registry is not None, "rows": rows}
        return page(request, "adapters.html", "_adapters.html", context)

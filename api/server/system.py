"""System routes: /health and /version (no auth: load balancers and orchestrators call them).

/metrics is the third system route; api/server/metrics.py serves it (create_app mounts its plugin).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from litestar import Controller, Response, get
from litestar.di import NamedDependency, Provide
from litestar.params import FromQuery

import engine
from api.server.deps import provide_server
from api.server.lifespan import ServerState


class SystemController(Controller):
    dependencies = {"server": Provide(provide_server, sync_to_thread=False)}
    tags = ["System"]

    @get("/health", cache=False)
    async def health(
        self, server: NamedDependency[ServerState], verbose: FromQuery[bool] = False
    ) -> Response[dict]:
        """200 while the engine loop is alive and making progress; 503 while loading, draining,
        or when the loop died or is stuck. `?verbose=true` adds the engine's counters and
        `load` (running, waiting, KV usage, draining): what a load-aware proxy reads."""
        ok, status = server.health()
        body: dict[str, Any] = {"status": status}
        if server.load_error or server.engine_error:
            body["error"] = server.load_error or server.engine_error
        if verbose:
            body["inflight_requests"] = server.num_inflight
            if server.engine is not None:
                stats = dataclasses.asdict(server.engine.stats())
                stats.pop("requests", None)
                last = stats.pop("last_step_time")
                stats["seconds_since_last_step"] = round(time.monotonic() - last, 3)
                body["engine"] = stats
            body["load"] = _load(server, status)
        headers = {} if ok else {"Retry-After": "5"}
        return Response(body, status_code=200 if ok else 503, headers=headers)

    @get("/version")
    async def version(self) -> dict[str, str]:
        return {"version": engine.__version__}


def _load(server: ServerState, status: str) -> dict[str, Any]:
    """This replica's load in one flat object (None where the engine has not loaded)."""
    stats = server.engine.stats() if server.engine is not None else None
    return {
        "running": stats.num_running if stats else None,
        "waiting": stats.num_waiting if stats else None,
        "kv_cache_usage": stats.kv_cache_usage if stats else None,
        "inflight_requests": server.num_inflight,
        "draining": status == "draining",
    }

"""The requests page: what runs and what waits (with each one's X-Request-Id and tenant),
an abort button per request, and the queue counted by tenant.

GET  /console/requests                     page; the table alone for htmx (polled every 2 s)
POST /console/requests/{request_id}/abort  abort it (its blocks are freed), then the table
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath

from console.render import page
from console.state import engine_call, engine_of, metrics_of


@dataclass(slots=True, frozen=True)
class RequestRow:
    request_id: str
    status: str
    key_name: str | None
    x_request_id: str | None  # the HTTP request's X-Request-Id (logs, usage rows, traces)
    tenant: str | None
    prompt_tokens: int
    output_tokens: int
    blocks: int
    age_s: float


async def request_rows(app: Any) -> list[RequestRow] | None:
    """Running first, then waiting, oldest first; None when the engine does not answer."""
    engine = engine_of(app)
    if engine is None:
        return []
    infos = await engine_call(engine.request_infos())
    if infos is None:
        return None
    metrics = metrics_of(app)
    now = time.monotonic()
    rows = []
    for i in infos:
        ref = metrics.request_ref(i.request_id) if metrics is not None else None
        row = RequestRow(
            request_id=i.request_id,
            status=i.status,
            key_name=metrics.key_name(i.request_id) if metrics is not None else None,
            x_request_id=ref.x_request_id if ref is not None else None,
            tenant=(ref.tenant if ref is not None else None) or i.tenant,
            prompt_tokens=i.num_prompt_tokens,
            output_tokens=i.num_output_tokens,
            blocks=i.num_blocks,
            age_s=now - i.arrival_time,
        )
        rows.append(row)
    rows.sort(key=lambda r: (r.status != "running", -r.age_s))
    return rows


@dataclass(slots=True, frozen=True)
class TenantQueue:
    tenant: str
    running: int
    waiting: int


def queue_by_tenant(rows: list[RequestRow]) -> list[TenantQueue]:
    """Running and waiting requests per tenant, the most waiting first."""
    counts: dict[str, list[int]] = {}
    for r in rows:
        c = counts.setdefault(r.tenant or "—", [0, 0])
        c[0 if r.status == "running" else 1] += 1
    queues = [TenantQueue(t, run, wait) for t, (run, wait) in counts.items()]
    return sorted(queues, key=lambda q: (-q.waiting, -q.running, q.tenant))


class RequestsController(Controller):
    path = "/requests"

    @get("/")
    async def requests(self, request: Request) -> Response:
        return await self._render(request, notice=None)

    @post("/{request_id:str}/abort", status_code=200)
    async def abort(self, request: Request, request_id: FromPath[str]) -> Response:
        engine = engine_of(request.app)
        notice = "The engine is not running."
        if engine is not None:
            await engine.abort(request_id)
            notice = f"Aborted {request_id}."
        return await self._render(request, notice=notice)

    async def _render(self, request: Request, notice: str | None) -> Response:
        rows = await request_rows(request.app)
        context = {
            "rows": rows,
            "notice": notice,
            "loading": engine_of(request.app) is None,
            "running": sum(r.status == "running" for r in rows or []),
            "waiting": sum(r.status == "waiting" for r in rows or []),
            "by_tenant": queue_by_tenant(rows or []),
        }
        return page(request, "requests.html", "_requests.html", context)

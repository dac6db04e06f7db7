"""The tenants pages: each tenant's weight beside its share of the tokens served over the
last minutes, its limits and keys, and the live queue by tenant.

GET /console/tenants?minutes=5          list; the table alone for htmx (polled every 5 s)
GET /console/tenants/{tenant_id}        one tenant: settings, share, keys, its requests now

Shares come from the usage ledger (queued rows flushed first): tokens (prompt + completion)
of the requests that arrived in the window, per tenant, over all tenants' tokens. The weight
share is the tenant's weight over the weights of the tenants served in the window: what
the fair scheduler aims at while they are all backlogged. Edits go through the admin REST
API or `tessera tenants`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from litestar import Controller, Request, Response, get
from litestar.exceptions import NotFoundException
from litestar.params import FromPath, FromQuery

from console.render import page
from console.requests import request_rows
from console.state import keys_of, tenants_of

MINUTE_CHOICES = (1, 5, 15, 60)


@dataclass(slots=True, frozen=True)
class TenantRow:
    tenant: Any  # api.tenants.service.TenantRecord
    tokens: int
    requests: int
    token_share: float  # 0..1 of all tokens in the window
    weight_share: float | None  # 0..1 among the tenants served in the window; None: idle


async def tenant_rows(app: Any, minutes: int) -> list[TenantRow]:
    from api.usage.service import tenant_shares

    service = tenants_of(app)
    recorder = app.state.get("usage_recorder")
    if recorder is not None:
        await recorder.flush()
    since = datetime.now(UTC) - timedelta(minutes=minutes)
    tenants = await service.list()
    served = {s.tenant_id: s for s in await tenant_shares(service.db, since)}
    total = sum(s.tokens for s in served.values())
    weights = sum(t.weight for t in tenants if t.id in served)
    rows = []
    for t in tenants:
        s = served.get(t.id)
        rows.append(
            TenantRow(
                tenant=t,
                tokens=s.tokens if s else 0,
                requests=s.requests if s else 0,
                token_share=(s.tokens / total) if s and total else 0.0,
                weight_share=(t.weight / weights) if s and weights else None,
            )
        )
    rows.sort(key=lambda r: (-r.tokens, r.tenant.name))
    return rows


class TenantsController(Controller):
    path = "/tenants"

    @get("/")
    async def tenants(self, request: Request, minutes: FromQuery[int] = 5) -> Response:
        minutes = minutes if minutes in MINUTE_CHOICES else 5
        has_db = tenants_of(request.app) is not None
        rows = await tenant_rows(request.app, minutes) if has_db else []
        live = await request_rows(request.app)
        context = {
            "has_db": has_db,
            "rows": rows,
            "minutes": minutes,
            "minute_choices": MINUTE_CHOICES,
            "queue": _queue(live),
        }
        return page(request, "tenants.html", "_tenants.html", context)

    @get("/{tenant_id:str}")
    async def tenant(self, request: Request, tenant_id: FromPath[str]) -> Response:
        service = tenants_of(request.app)
        record = await service.get(tenant_id) if service is not None else None
        if record is None:
            raise NotFoundException(f"No tenant with id {tenant_id}.")
        rows = [r for r in await tenant_rows(request.app, 5) if r.tenant.id == tenant_id]
        keys = await keys_of(request.app).list(tenant_id=tenant_id)
        live = [r for r in (await request_rows(request.app) or []) if r.tenant == record.name]
        context = {"t": record, "row": rows[0] if rows else None, "keys": keys, "live": live}
        return page(request, "tenant.html", "tenant.html", context)


def _queue(rows: Any) -> Any:
    from console.requests import queue_by_tenant

    return queue_by_tenant(rows) if rows else []

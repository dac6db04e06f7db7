"""The admin API's usage report: GET /admin/v1/usage (api/admin/routes.py lists every admin
route)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from litestar import get
from litestar.datastructures import State
from litestar.params import FromQuery, QueryParameter

from api.admin.common import AdminController, call, key_service
from api.admin.schemas import TIME_QUERY_SCHEMA, UsageReport, parse_time, usage_item
from api.keys.service import GROUP_BY
from api.server.errors import invalid_request


class UsageController(AdminController):
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
        buckets = await call(
            key_service(state).usage(
                key_id=key_id, since=start, until=end, group_by=group_by, tenant_id=tenant_id
            )
        )
        return UsageReport(
            group_by=group_by, since=start, until=end, data=[usage_item(b) for b in buckets]
        )


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

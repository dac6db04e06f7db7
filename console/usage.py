"""The usage page: tokens and requests per key per day (UTC), as a table and two charts.

GET /console/usage?key_id=&days=7   page; the results alone for htmx (the filter form swaps
them). Reads the usage ledger through KeyService.usage; queued ledger rows are flushed first
when the app exposes its UsageRecorder as state.usage_recorder.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from litestar import Controller, Request, Response, get
from litestar.params import FromQuery

from console.charts import bar_chart
from console.render import page
from console.state import keys_of

DAY_CHOICES = (1, 7, 30, 90)
MAX_SERIES = 6  # keys drawn separately; the rest are summed as "other"


def usage_charts(buckets: list[Any], days: list[datetime]) -> dict[str, Any]:
    """Stacked bars per day: total tokens and requests, one stack segment per key."""
    index = {d.date(): i for i, d in enumerate(days)}
    totals: dict[str, int] = {}
    for b in buckets:
        name = b.key_name or b.key_id or "(no key)"
        totals[name] = totals.get(name, 0) + b.total_tokens
    ranked = sorted(totals, key=lambda n: -totals[n])
    shown = ranked[:MAX_SERIES]
    names = shown + (["other"] if len(ranked) > MAX_SERIES else [])
    tokens = {n: [0.0] * len(days) for n in names}
    requests = {n: [0.0] * len(days) for n in names}
    for b in buckets:
        i = index.get(b.period_start.date())
        if i is None:
            continue
        name = b.key_name or b.key_id or "(no key)"
        name = name if name in shown else "other"
        tokens[name][i] += b.total_tokens
        requests[name][i] += b.requests
    labels = [d.strftime("%m-%d") for d in days]
    return {
        "series": names,
        "tokens_chart": bar_chart(labels, tokens, title="Tokens per day"),
        "requests_chart": bar_chart(labels, requests, title="Requests per day"),
    }


class UsageController(Controller):
    path = "/usage"

    @get("/")
    async def usage(
        self, request: Request, key_id: FromQuery[str | None] = None, days: FromQuery[int] = 7
    ) -> Response:
        service = keys_of(request.app)
        days = days if days in DAY_CHOICES else 7
        key_id = key_id or None
        today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        since = today - timedelta(days=days - 1)
        day_list = [since + timedelta(days=i) for i in range(days)]
        context: dict[str, Any] = {
            "has_db": service is not None,
            "keys": [],
            "key_id": key_id,
            "days": days,
            "day_choices": DAY_CHOICES,
            "buckets": [],
            "series": [],
            "tokens_chart": "",
            "requests_chart": "",
            "since": since,
        }
        if service is not None:
            recorder = request.app.state.get("usage_recorder")
            if recorder is not None:
                await recorder.flush()
            buckets = await service.usage(key_id=key_id, since=since, group_by="day")
            context.update(
                keys=await service.list(),
                buckets=list(reversed(buckets)),  # newest day first in the table
                **usage_charts(buckets, day_list),
            )
        return page(request, "usage.html", "_usage.html", context)

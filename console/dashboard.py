"""The dashboard: KV-cache usage, queue, throughput, prefix cache, preemptions, block map.

GET /console is the page; with HX-Request it is the live partial the page polls every second.
Each poll also samples the engine's counters into the throughput history.
"""

from __future__ import annotations

import time
from typing import Any

from litestar import Controller, Request, Response, get

from console.charts import block_map, line_chart
from console.render import page
from console.state import HISTORY_S, console_state, engine_call, engine_of, sample_engine


def _phase(app: Any) -> str:
    server = app.state.get("server")
    return str(getattr(server, "phase", "loading"))


async def live_context(app: Any) -> dict[str, Any]:
    engine = engine_of(app)
    if engine is None:
        return {"engine": None, "phase": _phase(app)}
    stats = sample_engine(app, engine)
    history = console_state(app).history
    states = await engine_call(engine.block_states())
    now = time.time()
    rates = history.rates()
    chart = line_chart(
        {
            "prompt tokens/s": [(r.t - now, r.prompt_tps) for r in rates],
            "generation tokens/s": [(r.t - now, r.generation_tps) for r in rates],
        },
        x_span=(-HISTORY_S, 0.0),
        x_labels=[(-HISTORY_S + 60 * i, f"-{5 - i} min") for i in range(5)] + [(0.0, "now")],
        title="Tokens per second over the last five minutes",
    )
    queries = stats.prefix_cache_queries
    return {
        "engine": engine,
        "phase": _phase(app),
        "stats": stats,
        "kv_percent": 100.0 * stats.kv_cache_usage,
        "hit_rate": stats.prefix_cache_hits / queries if queries else None,
        "recent_hit_rate": history.recent_hit_rate(),
        "rate": rates[-1] if rates else None,
        "chart": chart,
        "blocks": block_map(states) if states is not None else None,
        "step_age": time.monotonic() - stats.last_step_time if stats.last_step_time else None,
    }


class DashboardController(Controller):
    path = "/"

    @get("/")
    async def dashboard(self, request: Request) -> Response:
        context = await live_context(request.app)
        return page(request, "dashboard.html", "_live.html", context)

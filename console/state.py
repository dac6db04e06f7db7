"""What the console reads from the app, and the little state it keeps itself.

The app provides (api/server/app.py): `state.server` (api.server.lifespan.ServerState: settings, engine —
None while the model loads), `state.keys` (api.keys.service.KeyService; absent without a
database), `state.tenants` (api.tenants.service.TenantService; likewise),
`state.authenticator` (dropped caches after key edits), `state.metrics`
(api.server.metrics.Metrics: API-key names of requests in flight), `state.login_throttle`
(api.server.login_throttle.LoginThrottle: the lockout after wrong admin tokens, shared with the
admin API; an app without one gets the console's own, from the settings). A plain
`state.engine` / `state.settings` works too, for apps without a ServerState.

The console's own state lives on `state.console` (one per app, nothing global): the session
revocations and a ring buffer of the engine's counters, sampled when the dashboard polls.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from api.server.login_throttle import LoginThrottle
from console.session import SessionRevocations, SessionSigner

ENGINE_TIMEOUT_S = 2.0  # a dead engine loop never answers; the page must still render
HISTORY_S = 300.0
MIN_SAMPLE_GAP_S = 0.5


@dataclass(slots=True, frozen=True)
class Sample:
    t: float  # epoch seconds
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int


@dataclass(slots=True, frozen=True)
class Rate:
    t: float  # end of the interval, epoch seconds
    prompt_tps: float
    generation_tps: float


class ThroughputHistory:
    """Cumulative engine counters over the last few minutes -> tokens/s per interval."""

    def __init__(self, window_s: float = HISTORY_S) -> None:
        self.window_s = window_s
        self._samples: deque[Sample] = deque()

    def add(self, sample: Sample) -> None:
        if self._samples:
            last = self._samples[-1]
            if sample.t - last.t < MIN_SAMPLE_GAP_S:
                return
            if sample.generation_tokens < last.generation_tokens:  # a new engine: start over
                self._samples.clear()
        self._samples.append(sample)
        while self._samples and sample.t - self._samples[0].t > self.window_s:
            self._samples.popleft()

    def rates(self) -> list[Rate]:
        s = list(self._samples)
        return [
            Rate(
                b.t,
                (b.prompt_tokens - a.prompt_tokens) / (b.t - a.t),
                (b.generation_tokens - a.generation_tokens) / (b.t - a.t),
            )
            for a, b in zip(s, s[1:], strict=False)
        ]

    def recent_hit_rate(self, span_s: float = 60.0) -> float | None:
        """Prefix-cache hit rate (tokens) over about the last `span_s`; None without lookups."""
        if len(self._samples) < 2:
            return None
        last = self._samples[-1]
        first = next((x for x in self._samples if last.t - x.t <= span_s), last)
        queries = last.prefix_queries - first.prefix_queries
        return (last.prefix_hits - first.prefix_hits) / queries if queries > 0 else None


@dataclass(slots=True)
class ConsoleState:
    history: ThroughputHistory = field(default_factory=ThroughputHistory)
    revocations: SessionRevocations = field(default_factory=SessionRevocations)
    _signer: tuple[str, SessionSigner] | None = None
    throttle: LoginThrottle | None = None  # only for apps that bring no login_throttle

    def signer(self, admin_token: str | None) -> SessionSigner | None:
        if not admin_token:
            return None
        if self._signer is None or self._signer[0] != admin_token:
            self._signer = (admin_token, SessionSigner(admin_token))
        return self._signer[1]


def console_state(app: Any) -> ConsoleState:
    state = app.state
    existing = state.get("console")
    if existing is None:
        existing = ConsoleState()
        state["console"] = existing
    return existing


def login_throttle_of(app: Any) -> LoginThrottle:
    """The app's throttle of wrong admin tokens (api/server/access.py makes it), else the console's."""
    throttle = app.state.get("login_throttle")
    if throttle is not None:
        return throttle
    state = console_state(app)
    if state.throttle is None:
        settings = settings_of(app)
        state.throttle = LoginThrottle(
            getattr(settings, "login_max_failures", 5),
            getattr(settings, "login_failure_window", 60.0),
            metrics=metrics_of(app),
        )
    return state.throttle


def settings_of(app: Any) -> Any:
    server = app.state.get("server")
    return server.settings if server is not None else app.state.get("settings")


def engine_of(app: Any) -> Any | None:
    server = app.state.get("server")
    return server.engine if server is not None else app.state.get("engine")


def keys_of(app: Any) -> Any | None:
    return app.state.get("keys")


def tenants_of(app: Any) -> Any | None:
    return app.state.get("tenants")


def metrics_of(app: Any) -> Any | None:
    return app.state.get("metrics")


def sample_engine(app: Any, engine: Any) -> Any:
    """The engine's stats now, also recorded in the dashboard's history."""
    stats = engine.stats()
    console_state(app).history.add(
        Sample(
            time.time(),
            stats.prompt_tokens_total,
            stats.generation_tokens_total,
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
        )
    )
    return stats


async def engine_call(awaitable: Any) -> Any | None:
    """An engine snapshot (request_infos, block_states), or None if the loop does not answer."""
    try:
        return await asyncio.wait_for(awaitable, ENGINE_TIMEOUT_S)
    except TimeoutError:
        return None

"""Per-client throttling of failed secret checks: the console login, the admin REST API's
bearer admin token and /metrics' token (--metrics-token, --metrics-require-admin).

    throttle = LoginThrottle(max_failures=5, window_s=60.0, metrics=metrics)
    client = client_address(connection)           # the peer; IPv6 grouped by /64
    if (wait := throttle.locked_for(client)) > 0:  # refuse at once, the secret unchecked
        ...429, Retry-After: ceil(wait)
    if not secret_ok:
        throttle.failure(client, "console")        # may start a lockout (logged, counted)
    else:
        throttle.success(client)                   # the admin token: forgets the failures

A client that fails `max_failures` times within `window_s` seconds is locked out for
`window_s` seconds: every attempt in that time is refused with 429 before the secret is
looked at, so a right guess during a lockout is refused too and guessing runs at no more
than `max_failures` tries per window and address. The lockout is logged once at WARNING
(address, attempts, duration; never what was typed) and counted in
`tessera:login_lockouts_total{surface}`; each failure in `tessera:login_failures_total`.
Only the admin token clears a client's failures: whoever holds a lesser secret (the metrics
token, an API key) must not be able to reset a count of admin-token guesses.

The admin token is also accepted as an API key on the API routes (/v1, /tokenize; api/server/guards.py
require_api_key), which would make a guessing oracle that bypasses the lockout. There a
second throttle of its own (app.state.api_login_throttle, same settings, surface "api")
counts wrong tokens that are not shaped like a database key, and while it holds a client
the admin token is not compared at all: such a request gets the usual 401, and database keys
work as ever. Being separate, a client with a mistyped key locks out only its own use of the
admin token on the API routes, never the console or the admin API.

The client is the peer address of the connection as the ASGI server reports it: uvicorn
replaces it with X-Forwarded-For only when the peer is one of its trusted proxies
(FORWARDED_ALLOW_IPS, loopback by default), so a client cannot pick its own address. IPv6
peers count per /64, the block one host usually holds. The table of clients is an LRU of at
most `max_clients` entries: an attacker rotating addresses evicts old entries instead of
growing memory (and each of its addresses still gets at most `max_failures` tries a window).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api.server.errors import APIError

log = logging.getLogger("tessera.api")

SURFACES = ("console", "admin_api", "metrics", "api")
MAX_CLIENTS = 10_000


@dataclass(slots=True)
class _Client:
    failures: deque[float] = field(default_factory=deque)  # monotonic times, within the window
    locked_until: float = 0.0


class LoginThrottle:
    def __init__(
        self,
        max_failures: int = 5,
        window_s: float = 60.0,
        *,
        max_clients: int = MAX_CLIENTS,
        metrics: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        consequence: str = "refused until then",
    ) -> None:
        if max_failures < 0:
            raise ValueError(f"max_failures must be >= 0 (0: no limit), got {max_failures}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s}")
        if max_clients < 1:
            raise ValueError(f"max_clients must be at least 1, got {max_clients}")
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients
        self.metrics = metrics  # api.server.metrics.Metrics: login_failure / login_lockout
        self.consequence = consequence  # what the lockout's log line says it means
        self._clock = clock
        self._clients: OrderedDict[str, _Client] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_failures > 0

    def __len__(self) -> int:
        return len(self._clients)

    def locked_for(self, client: str) -> float:
        """Seconds left of the client's lockout; 0.0 when it may try."""
        entry = self._clients.get(client)
        if entry is None or not entry.locked_until:
            return 0.0
        left = entry.locked_until - self._clock()
        if left > 0:
            return left
        del self._clients[client]  # the lockout ended: a fresh start
        return 0.0

    def failure(self, client: str, surface: str) -> float:
        """Record a failed attempt; the lockout's length if this one started it, else 0.0."""
        if surface not in SURFACES:
            raise ValueError(f"surface must be one of {', '.join(SURFACES)}; got {surface!r}")
        if self.metrics is not None:
            self.metrics.login_failure(surface)
        if not self.enabled:
            return 0.0
        now = self._clock()
        entry = self._clients.get(client)
        if entry is None:
            entry = self._clients[client] = _Client()
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        if entry.locked_until > now:  # checked before the lockout began, answered after
            return 0.0
        while entry.failures and entry.failures[0] <= now - self.window_s:
            entry.failures.popleft()
        entry.failures.append(now)
        if len(entry.failures) < self.max_failures:
            return 0.0
        attempts = len(entry.failures)
        entry.failures.clear()
        entry.locked_until = now + self.window_s
        log.warning(
            "Locked out client %s for %.0f s after %d failed login attempts (%s) within %.0f s: %s",
            client,
            self.window_s,
            attempts,
            surface,
            self.window_s,
            self.consequence,
        )
        if self.metrics is not None:
            self.metrics.login_lockout(surface)
        return self.window_s

    def success(self, client: str) -> None:
        """A right secret: the client's failures are forgotten."""
        self._clients.pop(client, None)


def retry_after(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


def locked_out(seconds: float) -> APIError:
    """429 in the OpenAI envelope for a client in a lockout."""
    wait = retry_after(seconds)
    return APIError(
        429,
        f"Too many failed attempts from this address; try again in {wait} s.",
        "rate_limit_exceeded",
        code="too_many_failed_attempts",
        headers={"Retry-After": wait},
    )


def client_address(connection: Any) -> str:
    """The throttle's key for a connection: its peer address (IPv6 per /64)."""
    client = getattr(connection, "client", None)
    host = getattr(client, "host", None) if client is not None else None
    if not host:
        return "unknown"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return str(host)[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def throttle_of(app: Any) -> LoginThrottle | None:
    """The console's, the admin API's and /metrics' throttle."""
    return app.state.get("login_throttle")


def api_throttle_of(app: Any) -> LoginThrottle | None:
    """The API routes' own: the admin token presented as an API key."""
    return app.state.get("api_login_throttle")


def check_secret(
    connection: Any,
    surface: str,
    verify: Callable[[], Any],
    *,
    attempted: bool = True,
    clear: bool = True,
) -> Any:
    """Run `verify` (which raises APIError 401 on a wrong secret) under the app's throttle:
    429 without calling it during a lockout; a 401 counts as a failure when `attempted`
    (a secret was sent: a request without credentials is no guess). A success forgets the
    client's failures when `clear`: only for the admin token, since whoever holds a lesser
    secret (the metrics token) must not be able to reset a count of admin-token guesses."""
    throttle = throttle_of(connection.app)
    if throttle is None:
        return verify()
    client = client_address(connection)
    wait = throttle.locked_for(client)
    if wait > 0:
        raise locked_out(wait)
    try:
        result = verify()
    except APIError as exc:
        if exc.status_code == 401 and attempted:
            throttle.failure(client, surface)
        raise
    if clear:
        throttle.success(client)
    return result

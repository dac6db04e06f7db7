"""Per-key and per-tenant quotas, enforced atomically under concurrency and across replicas.

Interface:

    quotas = QuotaService(db, lease_ttl=600)
    lease = await quotas.acquire(principal, reserved_tokens=prompt_tokens + max_tokens)
    try:
        ...                                   # response carries lease.headers
    finally:
        await asyncio.shield(quotas.release(lease, used_tokens=prompt + completion))
    await quotas.aclose()                     # at shutdown: wait for in-flight releases

acquire() raises api.server.errors.APIError: 429 rate_limit_exceeded (Retry-After and
x-ratelimit-* headers) for the rpm, tpm and parallel limits, 429 insufficient_quota
(x-should-retry: false) when the token budget of the period is spent, 401 when the key was
revoked or expired meanwhile, 503 when the database is unreachable. release() reconciles
the reservation to the tokens used and frees the parallel slot; it is idempotent, never
raises (failures are logged) and finishes even if its caller is cancelled.
Principals without a key id (static / none auth, the admin token) and keys without any
limit get a no-op Lease without touching the database.

The SQL (api/quotas/sql.py) runs on the database driver itself, not through the
SQLAlchemy session layer (api/db/raw_store.py says why and how): a limited
request's acquire and release cost well under a millisecond of CPU.

How one acquire() is atomic. A single transaction (SQLite), or a single statement calling
a session-local PL/pgSQL function (Postgres: one round trip, quota_sql.ACQUIRE_FUNCTION):
  1. one conditional UPDATE ... RETURNING on the key's row reserves the tokens against the
     budget of the current period (day / month UTC, or total) only if they fit, and returns
     the key's current limits. The UPDATE row-locks the key on Postgres until commit; on
     SQLite the transaction is BEGIN IMMEDIATE under the Database's writer lock, so
     everything after it is serialised per key as well;
  2. if the key has rpm / tpm / parallel limits, one aggregate SELECT over quota_leases
     (a fresh snapshot, taken after the lock) counts the requests and tokens of the
     sliding 60 s window and the active leases;
  3. if they leave room, a new lease row is inserted (expires_at = now + lease_ttl, so a
     process that dies cannot hold the slot longer than that).
Any refusal undoes the budget reservation in the same transaction / statement.

Tenants. When the key's tenant has limits of its own (principal.tenant_limited), the same
steps run on the tenant's row and on the leases of all its keys, in one transaction on
both databases: the tenant's conditional UPDATE first (it row-locks the tenant, so every
acquire of that tenant is serialised after it; the key's row is locked second, in a fixed
order, so acquires cannot deadlock), then the key's; then the tenant's window and the key's
window are counted after the locks, and the lease row (carrying the tenant id) is inserted.
A refusal at either level rolls back both reservations: the tighter limit wins. Release
reconciles the tenant's budget before the key's (the same lock order).

Windows. rpm counts requests admitted in the last 60 s; tpm counts their tokens, each
request weighing its reservation until it is released and its used tokens after.
x-ratelimit-reset-* is the time until the oldest request in the window leaves it (when
capacity next grows); Retry-After is the time until enough capacity frees for the refused
request. A reservation made in a budget period that has since ended is not reconciled into
the new period. If a process dies, its reservations stay charged (conservative).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any, NoReturn

from api.db.raw_store import STORE_ERRORS, PostgresStore, Tx, raw_store
from api.db.session import Database
from api.keys.auth import Principal
from api.keys.fields import period_start
from api.quotas import sql
from api.server.errors import (
    APIError,
    insufficient_quota,
    invalid_api_key,
    rate_limited,
    unavailable,
)

log = logging.getLogger(__name__)

WINDOW = 60.0
TX_TIMEOUT = 10.0


@dataclass(slots=True)
class QuotaRefused(APIError):
    """A 429 from acquire(); `reason` (rpm, tpm, parallel, budget) labels the metrics."""

    reason: str = ""


def _refused_because(err: APIError, reason: str) -> QuotaRefused:
    return QuotaRefused(
        err.status_code, err.message, err.type, err.code, err.param, err.headers, reason
    )


@dataclass(slots=True)
class Lease:
    key_id: str | None
    reserved_tokens: int
    lease_id: str | None = None  # the quota_leases row, when the key has window limits
    budget_period_start: float | None = None  # budget period the reservation belongs to
    headers: dict[str, str] = field(default_factory=dict)
    released: bool = False
    tenant_id: str | None = None  # set when the tenant's row was charged too
    tenant_period_start: float | None = None


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: 20ms, 1.5s, 6m0s."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:g}s"
    minutes, rest = divmod(ms, 60_000)
    return f"{minutes}m{rest / 1000:g}s"


@dataclass(slots=True)
class _Limits:
    rpm: int | None
    tpm: int | None
    parallel: int | None
    period_start: float


class QuotaService:
    def __init__(
        self,
        db: Database,
        *,
        lease_ttl: float = 600,
        clock: Callable[[], float] = time.time,
        cleanup_interval: float = 30.0,
    ) -> None:
        if lease_ttl <= 0:
            raise ValueError("lease_ttl must be positive seconds")
        self.db = db
        self.store = raw_store(db)
        self.lease_ttl = lease_ttl
        self._clock = clock
        self._cleanup_interval = cleanup_interval
        self._last_cleanup: dict[str, float] = {}
        self._releases: set[asyncio.Task[None]] = set()

    # -- admission ----------------------------------------------------------------------
    async def acquire(self, principal: Principal, *, reserved_tokens: int) -> Lease:
        if isinstance(reserved_tokens, bool) or not isinstance(reserved_tokens, int):
            raise TypeError("reserved_tokens must be an int")
        if reserved_tokens < 0:
            raise ValueError("reserved_tokens must not be negative")
        if principal.key_id is None or not principal.has_limits:
            return Lease(principal.key_id, reserved_tokens)
        tenant_id = principal.tenant_id if principal.tenant_limited else None
        try:
            async with asyncio.timeout(TX_TIMEOUT):
                return await self._acquire(principal.key_id, tenant_id, reserved_tokens)
        except APIError:
            raise
        except STORE_ERRORS as exc:
            log.warning("quota check failed: database unavailable (%s)", type(exc).__name__)
            raise unavailable("The quota database is unavailable; try again shortly.") from None

    async def _acquire(self, key_id: str, tenant_id: str | None, n: int) -> Lease:
        now = self._clock()
        if tenant_id is None and isinstance(self.store, PostgresStore):
            return await self._acquire_in_one_statement(self.store, key_id, n, now)
        async with self.store.transaction() as tx:
            tenant = None
            if tenant_id is not None:  # the tenant's row first: the lock order
                tenant = await self._reserve_tenant(tx, tenant_id, n, now)
            limits = await self._reserve(tx, key_id, n, now)
            headers: dict[str, str] = {}
            lease_id = None
            tenant_windows = tenant is not None and bool(
                tenant.rpm or tenant.tpm or tenant.parallel
            )
            if limits.rpm or limits.tpm or limits.parallel or tenant_windows:
                lease_id = uuid.uuid4().hex
                tenant_stats = None
                if tenant_windows:  # counted before this request's lease row exists
                    tenant_stats = await tx.fetchrow(
                        sql.TENANT_WINDOW_STATS, tenant_id, now - WINDOW, now
                    )
                stats = await self._insert_lease(tx, key_id, tenant_id, lease_id, n, now)
                if tenant is not None and tenant_stats is not None:
                    window = partial(tx.fetch, sql.TENANT_WINDOW_REQUESTS, tenant_id, now - WINDOW)
                    who = "this API key's tenant"
                    headers = await self._check_windows(window, n, now, tenant, tenant_stats, who)
                if limits.rpm or limits.tpm or limits.parallel:
                    window = partial(tx.fetch, sql.WINDOW_REQUESTS, key_id, now - WINDOW)
                    key_headers = await self._check_windows(window, n, now, limits, stats)
                    headers = _tighter(key_headers, headers)
                await self._maybe_cleanup(tx, key_id, now)
        tenant_start = tenant.period_start if tenant is not None else None
        return Lease(
            key_id, n, lease_id, limits.period_start, headers, False, tenant_id, tenant_start
        )

    async def _acquire_in_one_statement(
        self, store: PostgresStore, key_id: str, n: int, now: float
    ) -> Lease:
        """Postgres: steps 1-3 as one server-side function call, one round trip (see
        quota_sql.ACQUIRE_FUNCTION); only a refusal's explanation costs more."""
        now_dt = datetime.fromtimestamp(now, UTC)
        day, month = period_start("day", now_dt), period_start("month", now_dt)
        lease_id = uuid.uuid4().hex
        args = (key_id, n, day, month, now_dt, now, lease_id, now + self.lease_ttl)
        row = await store.call(sql.ACQUIRE_FUNCTION, sql.ACQUIRE, *args)
        assert row is not None  # the function always returns one row
        admitted, rpm, tpm, parallel, start, *stats = row
        if start is None:
            async with store.transaction() as tx:
                await self._refusal(tx, key_id, n, now_dt)
        limits = _Limits(rpm, tpm, parallel, start)
        if not (rpm or tpm or parallel):
            return Lease(key_id, n, None, start)

        async def window() -> list[Sequence[Any]]:  # only a refusal's Retry-After reads it
            async with store.transaction() as tx:
                return await tx.fetch(sql.WINDOW_REQUESTS, key_id, now - WINDOW)

        headers = await self._check_windows(window, n, now, limits, stats)
        if not admitted:  # the function and _check_windows disagree: never admit then
            log.error("quota function refused key %s but the window check passed", key_id)
            raise unavailable("The quota check failed; try again shortly.")
        if now - self._last_cleanup.get(key_id, 0.0) >= self._cleanup_interval:
            self._last_cleanup[key_id] = now
            await store.execute(sql.DELETE_OLD_LEASES, key_id, now - WINDOW, now)
        return Lease(key_id, n, lease_id, start, headers)

    async def _reserve(self, tx: Tx, key_id: str, n: int, now: float) -> _Limits:
        """Step 1: the conditional UPDATE ... RETURNING (reservation + row lock)."""
        now_dt = datetime.fromtimestamp(now, UTC)
        day, month = period_start("day", now_dt), period_start("month", now_dt)
        stamp = self.store.timestamp(now_dt)
        row = await tx.fetchrow(sql.RESERVE, key_id, n, day, month, stamp)
        if row is None:
            await self._refusal(tx, key_id, n, now_dt)
        rpm, tpm, parallel, start = row
        return _Limits(rpm, tpm, parallel, start)

    async def _reserve_tenant(self, tx: Tx, tenant_id: str, n: int, now: float) -> _Limits:
        now_dt = datetime.fromtimestamp(now, UTC)
        day, month = period_start("day", now_dt), period_start("month", now_dt)
        row = await tx.fetchrow(sql.TENANT_RESERVE, tenant_id, n, day, month)
        if row is None:
            await self._tenant_refusal(tx, tenant_id, n, now_dt)
        rpm, tpm, parallel, start = row
        return _Limits(rpm, tpm, parallel, start)

    async def _tenant_refusal(self, tx: Tx, tenant_id: str, n: int, now: datetime) -> NoReturn:
        """Why the tenant's reservation matched no row: disabled, or its budget is spent."""
        tenant = await tx.fetchrow(sql.TENANT_STATE, tenant_id)
        if tenant is None or tenant[0] is not None:
            raise invalid_api_key("This API key's tenant has been disabled.")
        _, token_budget, budget_used, period, start = tenant
        budget = token_budget or 0
        used = budget_used if start == period_start(period, now) else 0
        scope = {"day": "today", "month": "this month", "total": "in total"}[period]
        if n > budget:
            message = (
                f"This request needs up to {n} tokens, more than your tenant's whole token "
                f"budget of {budget}. Lower max_tokens or ask for a larger budget."
            )
        else:
            message = (
                f"You exceeded your tenant's token budget: {used} of {budget} tokens are "
                f"used or reserved {scope} by its keys, and this request needs up to {n} more."
            )
        raise _refused_because(insufficient_quota(message), "budget")

    async def _refusal(self, tx: Tx, key_id: str, n: int, now: datetime) -> NoReturn:
        """Why the reservation UPDATE matched no row: a dead key or a spent budget."""
        key = await tx.fetchrow(sql.KEY_STATE, key_id)
        if key is None or key[0] is not None:
            raise invalid_api_key("This API key has been revoked.")
        _, expires_at, token_budget, budget_used, period, start = key
        expires_at = self.store.datetime(expires_at)
        if expires_at is not None and expires_at <= now:
            raise invalid_api_key("This API key has expired.")
        budget = token_budget or 0
        used = budget_used if start == period_start(period, now) else 0
        scope = {"day": "today", "month": "this month", "total": "in total"}[period]
        if n > budget:
            message = (
                f"This request needs up to {n} tokens, more than this API key's whole "
                f"token budget of {budget}. Lower max_tokens or ask for a larger budget."
            )
        else:
            message = (
                f"You exceeded this API key's token budget: {used} of {budget} tokens are "
                f"used or reserved {scope}, and this request needs up to {n} more."
            )
        raise _refused_because(insufficient_quota(message), "budget")

    async def _insert_lease(
        self, tx: Tx, key_id: str, tenant_id: str | None, lease_id: str, n: int, now: float
    ) -> Sequence[Any]:
        """Steps 2-3: the key window's stats before this request, and this request's lease
        row (rolled back with the transaction if the stats refuse it)."""
        stats = await tx.fetchrow(sql.WINDOW_STATS, key_id, now - WINDOW, now)
        expires = now + self.lease_ttl
        if tenant_id is None:
            await tx.execute(sql.INSERT_LEASE, lease_id, key_id, now, expires, n)
        else:
            await tx.execute(sql.INSERT_TENANT_LEASE, lease_id, key_id, tenant_id, now, expires, n)
        assert stats is not None  # an aggregate always returns a row
        return stats

    async def _check_windows(
        self,
        window: Callable[[], Awaitable[list[Sequence[Any]]]],
        n: int,
        now: float,
        limits: _Limits,
        stats: Sequence[Any],
        who: str = "this API key",
    ) -> dict[str, str]:
        """Step 3: sliding-window rpm / tpm and the parallel-lease count."""
        requests, tokens, oldest, running = int(stats[0]), int(stats[1]), stats[2], int(stats[3])
        reset = format_duration((oldest if oldest is not None else now) + WINDOW - now)
        headers: dict[str, str] = {}
        if limits.rpm:
            headers["x-ratelimit-limit-requests"] = str(limits.rpm)
            headers["x-ratelimit-remaining-requests"] = str(max(0, limits.rpm - requests - 1))
            headers["x-ratelimit-reset-requests"] = reset
        if limits.tpm:
            headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm - tokens - n))
            headers["x-ratelimit-reset-tokens"] = reset

        if limits.rpm and requests + 1 > limits.rpm:
            wait = await self._wait_for(window, now, requests + 1 - limits.rpm, None)
            raise _refused_because(
                rate_limited(
                    f"Rate limit reached: {limits.rpm} requests per minute for {who}.",
                    wait,
                    _refused(headers, "requests"),
                ),
                "rpm",
            )
        if limits.tpm and tokens + n > limits.tpm:
            if n > limits.tpm:
                too_large = rate_limited(
                    f"Request too large: it needs up to {n} tokens but {who} allows "
                    f"{limits.tpm} tokens per minute. Lower max_tokens.",
                    WINDOW,
                    _refused(headers, "tokens"),
                )
                raise _refused_because(too_large, "tpm")
            wait = await self._wait_for(window, now, None, tokens + n - limits.tpm)
            raise _refused_because(
                rate_limited(
                    f"Rate limit reached: {limits.tpm} tokens per minute for {who}.",
                    wait,
                    _refused(headers, "tokens"),
                ),
                "tpm",
            )
        if limits.parallel and running + 1 > limits.parallel:
            raise _refused_because(
                rate_limited(
                    f"Too many parallel requests: {who} allows {limits.parallel} at a time.",
                    1.0,
                    headers,
                ),
                "parallel",
            )
        return headers

    async def _wait_for(
        self,
        window: Callable[[], Awaitable[list[Sequence[Any]]]],
        now: float,
        requests: int | None,
        tokens: int | None,
    ) -> float:
        """Seconds until `requests` requests or `tokens` tokens leave the window."""
        rows = await window()
        freed_tokens = 0
        for freed_requests, (created_at, weight) in enumerate(rows, start=1):
            freed_tokens += int(weight)
            if (requests is not None and freed_requests >= requests) or (
                tokens is not None and freed_tokens >= tokens
            ):
                return max(0.001, created_at + WINDOW - now)
        return WINDOW

    async def _maybe_cleanup(self, tx: Tx, key_id: str, now: float) -> None:
        if now - self._last_cleanup.get(key_id, 0.0) < self._cleanup_interval:
            return
        self._last_cleanup[key_id] = now
        await tx.execute(sql.DELETE_OLD_LEASES, key_id, now - WINDOW, now)

    # -- completion ---------------------------------------------------------------------
    async def release(self, lease: Lease, *, used_tokens: int) -> None:
        if lease.released:
            return
        lease.released = True
        if lease.key_id is None or lease.budget_period_start is None:
            return
        # Its own task: a cancelled caller must not cut the reconciliation short.
        task = asyncio.ensure_future(self._release(lease, used_tokens))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        await asyncio.shield(task)

    async def _release(self, lease: Lease, used_tokens: int) -> None:
        try:
            used = max(0, int(used_tokens))
            delta = used - lease.reserved_tokens
            if lease.lease_id is None and not delta:
                return  # nothing to free, nothing to reconcile
            now = self._clock()
            key, start = lease.key_id, lease.budget_period_start
            async with asyncio.timeout(TX_TIMEOUT):
                if lease.tenant_id is not None:
                    await self._release_with_tenant(lease, now, used, delta)
                elif lease.lease_id is None:
                    await self.store.execute(sql.RECONCILE, key, delta, start)
                elif isinstance(self.store, PostgresStore):
                    await self.store.execute(
                        sql.RELEASE_AND_RECONCILE, lease.lease_id, now, used, key, delta, start
                    )
                else:
                    async with self.store.transaction() as tx:
                        await tx.execute(sql.RELEASE_LEASE, lease.lease_id, now, used)
                        if delta:
                            await tx.execute(sql.RECONCILE, key, delta, start)
        except Exception:
            log.exception(
                "could not release quota lease %s of key %s", lease.lease_id, lease.key_id
            )

    async def _release_with_tenant(self, lease: Lease, now: float, used: int, delta: int) -> None:
        async with self.store.transaction() as tx:
            if delta and lease.tenant_period_start is not None:  # tenant first: lock order
                await tx.execute(
                    sql.TENANT_RECONCILE, lease.tenant_id, delta, lease.tenant_period_start
                )
            if lease.lease_id is not None:
                await tx.execute(sql.RELEASE_LEASE, lease.lease_id, now, used)
            if delta:
                await tx.execute(sql.RECONCILE, lease.key_id, delta, lease.budget_period_start)

    async def aclose(self) -> None:
        """Wait for releases still in flight (call at shutdown, before db.dispose())."""
        while self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)


def _tighter(key: dict[str, str], tenant: dict[str, str]) -> dict[str, str]:
    """x-ratelimit-* of whichever level (key or tenant) has less room left, per kind."""
    out = dict(key)
    for kind in ("requests", "tokens"):
        remaining = f"x-ratelimit-remaining-{kind}"
        if remaining in tenant and (
            remaining not in key or int(tenant[remaining]) < int(key[remaining])
        ):
            for part in ("limit", "remaining", "reset"):
                name = f"x-ratelimit-{part}-{kind}"
                out[name] = tenant[name]
    return out


def _refused(headers: dict[str, str], kind: str) -> dict[str, str]:
    return {**headers, f"x-ratelimit-remaining-{kind}": "0"}


__all__ = ["Lease", "QuotaRefused", "QuotaService", "format_duration"]

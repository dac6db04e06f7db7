"""Per-key quotas, enforced atomically under concurrency and across replicas.

Interface:

    quotas = QuotaService(db, lease_ttl=600)
    lease = await quotas.acquire(principal, reserved_tokens=prompt_tokens + max_tokens)
    try:
        ...                                   # response carries lease.headers
    finally:
        await asyncio.shield(quotas.release(lease, used_tokens=prompt + completion))
    await quotas.aclose()                     # at shutdown: wait for in-flight releases

acquire() raises api.errors.APIError: 429 rate_limit_exceeded (Retry-After and
x-ratelimit-* headers) for the rpm, tpm and parallel limits, 429 insufficient_quota
(x-should-retry: false) when the token budget of the period is spent, 401 when the key was
revoked or expired meanwhile, 503 when the database is unreachable. release() reconciles
the reservation to the tokens used and frees the parallel slot; it is idempotent, never
raises (failures are logged) and finishes even if its caller is cancelled.
Principals without a key id (static / none auth, the admin token) and keys without any
limit get a no-op Lease without touching the database.

How one acquire() is atomic. A single transaction:
  1. one conditional UPDATE ... RETURNING on the key's row reserves the tokens against the
     budget of the current period (day / month UTC, or total) only if they fit, and returns
     the key's current limits. The UPDATE row-locks the key on Postgres until commit; on
     SQLite the transaction is BEGIN IMMEDIATE (see api.db.session), so everything after it
     is serialised per key as well;
  2. if the key has rpm / tpm / parallel limits, one aggregate SELECT over quota_leases
     counts the requests and tokens of the sliding 60 s window and the active leases;
  3. a new lease row is inserted (expires_at = now + lease_ttl, so a process that dies
     cannot hold the slot longer than that).
Any refusal rolls the transaction back, the budget reservation with it.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NoReturn

from sqlalchemy import and_, case, delete, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from api.auth import DB_ERRORS, Principal
from api.db.models import ApiKey, QuotaLease
from api.db.session import Database
from api.errors import APIError, insufficient_quota, invalid_api_key, rate_limited, unavailable
from api.services.key_fields import period_start

log = logging.getLogger(__name__)

# Core tables, not ORM entities: the hot path skips the Session's bookkeeping.
KEYS = ApiKey.__table__.c
LEASES = QuotaLease.__table__.c
_keys_table = ApiKey.__table__
_leases_table = QuotaLease.__table__

WINDOW = 60.0
TX_TIMEOUT = 10.0


@dataclass(slots=True)
class Lease:
    key_id: str | None
    reserved_tokens: int
    lease_id: str | None = None  # the quota_leases row, when the key has window limits
    budget_period_start: float | None = None  # budget period the reservation belongs to
    headers: dict[str, str] = field(default_factory=dict)
    released: bool = False


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
    budget: int | None
    budget_used: int
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
        try:
            async with asyncio.timeout(TX_TIMEOUT):
                return await self._acquire(principal.key_id, reserved_tokens)
        except APIError:
            raise
        except DB_ERRORS as exc:
            log.warning("quota check failed: database unavailable (%s)", type(exc).__name__)
            raise unavailable("The quota database is unavailable; try again shortly.") from None

    async def _acquire(self, key_id: str, n: int) -> Lease:
        now = self._clock()
        async with self.db.transaction(write=True, durable=False) as conn:
            limits = await self._reserve(conn, key_id, n, now)
            headers: dict[str, str] = {}
            lease_id = None
            if limits.rpm or limits.tpm or limits.parallel:
                headers = await self._check_windows(conn, key_id, n, now, limits)
                lease_id = uuid.uuid4().hex
                await conn.execute(
                    insert(_leases_table).values(
                        id=lease_id,
                        key_id=key_id,
                        created_at=now,
                        expires_at=now + self.lease_ttl,
                        reserved_tokens=n,
                    )
                )
                await self._maybe_cleanup(conn, key_id, now)
        return Lease(key_id, n, lease_id, limits.period_start, headers)

    async def _reserve(self, conn: AsyncConnection, key_id: str, n: int, now: float) -> _Limits:
        """Step 1: the conditional UPDATE ... RETURNING (reservation + row lock)."""
        now_dt = datetime.fromtimestamp(now, UTC)
        current_start = case(
            (KEYS.budget_period == "day", period_start("day", now_dt)),
            (KEYS.budget_period == "month", period_start("month", now_dt)),
            else_=period_start("total", now_dt),
        )
        used_now = case((KEYS.budget_period_start == current_start, KEYS.budget_used), else_=0)
        stmt = (
            update(_keys_table)
            .where(
                KEYS.id == key_id,
                KEYS.revoked_at.is_(None),
                or_(KEYS.expires_at.is_(None), KEYS.expires_at > now_dt),
                or_(KEYS.token_budget.is_(None), used_now + n <= KEYS.token_budget),
            )
            .values(budget_used=used_now + n, budget_period_start=current_start)
            .returning(
                KEYS.rpm_limit,
                KEYS.tpm_limit,
                KEYS.max_parallel,
                KEYS.token_budget,
                KEYS.budget_used,
                KEYS.budget_period_start,
            )
        )
        row = (await conn.execute(stmt)).first()
        if row is None:
            await self._refusal(conn, key_id, n, now_dt)
        rpm, tpm, parallel, budget, used, start = row
        return _Limits(rpm, tpm, parallel, budget, used, start)

    async def _refusal(self, conn: AsyncConnection, key_id: str, n: int, now: datetime) -> NoReturn:
        """Why the reservation UPDATE matched no row: a dead key or a spent budget."""
        key = (
            await conn.execute(
                select(
                    KEYS.revoked_at,
                    KEYS.expires_at,
                    KEYS.token_budget,
                    KEYS.budget_used,
                    KEYS.budget_period,
                    KEYS.budget_period_start,
                ).where(KEYS.id == key_id)
            )
        ).first()
        if key is None or key.revoked_at is not None:
            raise invalid_api_key("This API key has been revoked.")
        if key.expires_at is not None and key.expires_at <= now:
            raise invalid_api_key("This API key has expired.")
        budget = key.token_budget or 0
        current = key.budget_period_start == period_start(key.budget_period, now)
        used = key.budget_used if current else 0
        scope = {"day": "today", "month": "this month", "total": "in total"}[key.budget_period]
        if n > budget:
            raise insufficient_quota(
                f"This request needs up to {n} tokens, more than this API key's whole "
                f"token budget of {budget}. Lower max_tokens or ask for a larger budget."
            )
        raise insufficient_quota(
            f"You exceeded this API key's token budget: {used} of {budget} tokens are used "
            f"or reserved {scope}, and this request needs up to {n} more."
        )

    async def _check_windows(
        self, conn: AsyncConnection, key_id: str, n: int, now: float, limits: _Limits
    ) -> dict[str, str]:
        """Step 2: sliding-window rpm / tpm and the parallel-lease count."""
        in_window = LEASES.created_at > now - WINDOW
        active = and_(LEASES.released_at.is_(None), LEASES.expires_at > now)
        weight = func.coalesce(LEASES.used_tokens, LEASES.reserved_tokens)
        stats = (
            await conn.execute(
                select(
                    func.sum(case((in_window, 1), else_=0)),
                    func.sum(case((in_window, weight), else_=0)),
                    func.min(case((in_window, LEASES.created_at))),
                    func.sum(case((active, 1), else_=0)),
                ).where(LEASES.key_id == key_id, or_(in_window, active))
            )
        ).one()
        requests, tokens, oldest, running = (int(stats[0] or 0), int(stats[1] or 0), *stats[2:])
        running = int(running or 0)
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
            wait = await self._wait_for(conn, key_id, now, requests + 1 - limits.rpm, None)
            raise rate_limited(
                f"Rate limit reached: {limits.rpm} requests per minute for this API key.",
                wait,
                _refused(headers, "requests"),
            )
        if limits.tpm and tokens + n > limits.tpm:
            if n > limits.tpm:
                raise rate_limited(
                    f"Request too large: it needs up to {n} tokens but this API key allows "
                    f"{limits.tpm} tokens per minute. Lower max_tokens.",
                    WINDOW,
                    _refused(headers, "tokens"),
                )
            wait = await self._wait_for(conn, key_id, now, None, tokens + n - limits.tpm)
            raise rate_limited(
                f"Rate limit reached: {limits.tpm} tokens per minute for this API key.",
                wait,
                _refused(headers, "tokens"),
            )
        if limits.parallel and running + 1 > limits.parallel:
            raise rate_limited(
                f"Too many parallel requests: this API key allows {limits.parallel} at a time.",
                1.0,
                headers,
            )
        return headers

    async def _wait_for(
        self,
        conn: AsyncConnection,
        key_id: str,
        now: float,
        requests: int | None,
        tokens: int | None,
    ) -> float:
        """Seconds until `requests` requests or `tokens` tokens leave the window."""
        weight = func.coalesce(LEASES.used_tokens, LEASES.reserved_tokens)
        rows = await conn.execute(
            select(LEASES.created_at, weight)
            .where(LEASES.key_id == key_id, LEASES.created_at > now - WINDOW)
            .order_by(LEASES.created_at)
        )
        freed_tokens = 0
        for freed_requests, (created_at, weight_value) in enumerate(rows, start=1):
            freed_tokens += int(weight_value)
            if (requests is not None and freed_requests >= requests) or (
                tokens is not None and freed_tokens >= tokens
            ):
                return max(0.001, created_at + WINDOW - now)
        return WINDOW

    async def _maybe_cleanup(self, conn: AsyncConnection, key_id: str, now: float) -> None:
        if now - self._last_cleanup.get(key_id, 0.0) < self._cleanup_interval:
            return
        self._last_cleanup[key_id] = now
        await conn.execute(
            delete(_leases_table).where(
                LEASES.key_id == key_id,
                LEASES.created_at <= now - WINDOW,
                or_(LEASES.released_at.is_not(None), LEASES.expires_at <= now),
            )
        )

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
            if lease.lease_id is None and used == lease.reserved_tokens:
                return  # nothing to free, nothing to reconcile
            now = self._clock()
            async with (
                asyncio.timeout(TX_TIMEOUT),
                self.db.transaction(write=True, durable=False) as conn,
            ):
                if lease.lease_id is not None:
                    await conn.execute(
                        update(_leases_table)
                        .where(LEASES.id == lease.lease_id, LEASES.released_at.is_(None))
                        .values(released_at=now, used_tokens=used)
                    )
                delta = used - lease.reserved_tokens
                if delta:
                    balance = KEYS.budget_used + delta
                    await conn.execute(
                        update(_keys_table)
                        .where(
                            KEYS.id == lease.key_id,
                            KEYS.budget_period_start == lease.budget_period_start,
                        )
                        .values(budget_used=case((balance < 0, 0), else_=balance))
                    )
        except Exception:
            log.exception(
                "could not release quota lease %s of key %s", lease.lease_id, lease.key_id
            )

    async def aclose(self) -> None:
        """Wait for releases still in flight (call at shutdown, before db.dispose())."""
        while self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)


def _refused(headers: dict[str, str], kind: str) -> dict[str, str]:
    return {**headers, f"x-ratelimit-remaining-{kind}": "0"}


__all__ = ["Lease", "QuotaService", "format_duration"]

"""QuotaService: budgets under concurrency, rpm/tpm/parallel at their bounds, leases."""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import timedelta

import pytest
from sqlalchemy import event, func, select

from api.db.models import ApiKey, QuotaLease
from api.db.session import Database
from api.keys.auth import STATIC, Principal
from api.keys.service import KeyService
from api.quotas.service import Lease, QuotaService, format_duration
from api.server.errors import APIError


async def _key(db: Database, **limits) -> Principal:
    record, _ = await KeyService(db).create("quota-test", **limits)
    return Principal.from_record(record)


async def _budget_used(db: Database, key_id: str) -> int:
    async with db.session() as session:
        return await session.scalar(select(ApiKey.budget_used).where(ApiKey.id == key_id))


async def _try(quotas: QuotaService, principal: Principal, n: int) -> Lease | APIError:
    try:
        return await quotas.acquire(principal, reserved_tokens=n)
    except APIError as exc:
        return exc


async def test_budget_edge_40_concurrent(db: Database) -> None:
    budget = 1000
    principal = await _key(db, token_budget=budget)
    quotas = QuotaService(db)
    sizes = [random.Random(i).randint(60, 140) for i in range(40)]  # ~10 fit
    results = await asyncio.gather(*(_try(quotas, principal, n) for n in sizes))
    admitted = [(n, r) for n, r in zip(sizes, results, strict=True) if isinstance(r, Lease)]
    refused = [(n, r) for n, r in zip(sizes, results, strict=True) if isinstance(r, APIError)]
    total = sum(n for n, _ in admitted)
    assert total <= budget
    assert 6 <= len(admitted) <= 16 and len(admitted) + len(refused) == 40
    assert await _budget_used(db, principal.key_id) == total
    for n, err in refused:
        assert (err.status_code, err.type, err.code) == (
            429,
            "insufficient_quota",
            "insufficient_quota",
        )
        assert err.headers["x-should-retry"] == "false"
        assert total + n > budget  # refused only if it really did not fit

    # Reconcile: each admitted request used 10 tokens; the rest of its reservation returns.
    await asyncio.gather(*(quotas.release(lease, used_tokens=10) for _, lease in admitted))
    assert await _budget_used(db, principal.key_id) == 10 * len(admitted)
    lease = await quotas.acquire(principal, reserved_tokens=budget - 10 * len(admitted))
    with pytest.raises(APIError, match="token budget"):
        await quotas.acquire(principal, reserved_tokens=1)
    await quotas.release(lease, used_tokens=0)
    with pytest.raises(APIError, match="whole token budget of 1000"):
        await quotas.acquire(principal, reserved_tokens=budget + 1)


async def test_disconnected_stream_returns_its_reservation(db: Database) -> None:
    principal = await _key(db, token_budget=500)
    quotas = QuotaService(db)
    started = asyncio.Event()

    async def stream() -> None:
        lease = await quotas.acquire(principal, reserved_tokens=400)
        used = 25
        try:
            started.set()
            await asyncio.sleep(3600)  # streaming until the client goes away
        finally:
            await asyncio.shield(quotas.release(lease, used_tokens=used))

    task = asyncio.create_task(stream())
    await started.wait()
    assert await _budget_used(db, principal.key_id) == 400
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await quotas.aclose()
    assert await _budget_used(db, principal.key_id) == 25


async def test_rpm_bound_and_headers(db: Database, clock) -> None:
    principal = await _key(db, rpm_limit=3)
    quotas = QuotaService(db, clock=clock)
    leases = []
    for remaining, reset in ((2, "1m0s"), (1, "59s"), (0, "58s")):
        lease = await quotas.acquire(principal, reserved_tokens=10)
        assert lease.headers == {
            "x-ratelimit-limit-requests": "3",
            "x-ratelimit-remaining-requests": str(remaining),
            "x-ratelimit-reset-requests": reset,  # when the oldest request leaves the window
        }
        leases.append(lease)
        clock.advance(1)
        await quotas.release(lease, used_tokens=5)  # rpm counts requests, finished or not
    with pytest.raises(APIError) as err:
        await quotas.acquire(principal, reserved_tokens=10)
    e = err.value
    assert (e.status_code, e.type, e.code) == (429, "rate_limit_exceeded", "rate_limit_exceeded")
    assert e.headers["Retry-After"] == "57"  # the first request leaves the window at t=60
    assert e.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.headers["x-ratelimit-reset-requests"] == "57s"
    clock.advance(56.5)
    with pytest.raises(APIError):
        await quotas.acquire(principal, reserved_tokens=10)
    clock.advance(0.5)  # t = 60: exactly one slot free again
    lease = await quotas.acquire(principal, reserved_tokens=10)
    assert lease.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(APIError):
        await quotas.acquire(principal, reserved_tokens=10)


async def test_tpm_bound_reservations_count_until_release(db: Database, clock) -> None:
    principal = await _key(db, tpm_limit=1000)
    quotas = QuotaService(db, clock=clock)
    first = await quotas.acquire(principal, reserved_tokens=400)
    assert first.headers == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "600",
        "x-ratelimit-reset-tokens": "1m0s",
    }
    clock.advance(10)
    second = await quotas.acquire(principal, reserved_tokens=400)
    clock.advance(10)
    with pytest.raises(APIError) as err:
        await quotas.acquire(principal, reserved_tokens=201)
    assert err.value.headers["Retry-After"] == "40"  # when the first 400 leave the window
    assert err.value.headers["x-ratelimit-remaining-tokens"] == "0"
    exact = await quotas.acquire(principal, reserved_tokens=200)  # exactly 1000
    assert exact.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(APIError):
        await quotas.acquire(principal, reserved_tokens=1)
    await quotas.release(first, used_tokens=100)  # 300 of the reservation come back
    fourth = await quotas.acquire(principal, reserved_tokens=300)
    assert fourth.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(APIError, match="Request too large"):
        await quotas.acquire(principal, reserved_tokens=1001)
    for lease in (second, exact, fourth):
        await quotas.release(lease, used_tokens=0)


async def test_max_parallel_bound(db: Database) -> None:
    principal = await _key(db, max_parallel=5)
    quotas = QuotaService(db)
    results = await asyncio.gather(*(_try(quotas, principal, 1) for _ in range(40)))
    admitted = [r for r in results if isinstance(r, Lease)]
    refused = [r for r in results if isinstance(r, APIError)]
    assert len(admitted) == 5 and len(refused) == 35
    assert all(e.status_code == 429 and e.code == "rate_limit_exceeded" for e in refused)
    assert all(e.headers["Retry-After"] == "1" for e in refused)
    await quotas.release(admitted[0], used_tokens=1)
    await quotas.release(admitted[0], used_tokens=1)  # idempotent: frees one slot only
    again = await quotas.acquire(principal, reserved_tokens=1)
    with pytest.raises(APIError, match="parallel"):
        await quotas.acquire(principal, reserved_tokens=1)
    for lease in [*admitted[1:], again]:
        await quotas.release(lease, used_tokens=1)
    assert len([await quotas.acquire(principal, reserved_tokens=1) for _ in range(5)]) == 5


async def test_rpm_under_concurrency(db: Database) -> None:
    principal = await _key(db, rpm_limit=10)
    quotas = QuotaService(db)
    results = await asyncio.gather(*(_try(quotas, principal, 1) for _ in range(40)))
    admitted = [r for r in results if isinstance(r, Lease)]
    assert len(admitted) == 10
    remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in admitted)
    assert remaining == list(range(10))


async def test_lease_ttl_frees_a_leaked_slot(db: Database, clock) -> None:
    principal = await _key(db, max_parallel=1)
    dead_process = QuotaService(db, lease_ttl=30, clock=clock)
    await dead_process.acquire(principal, reserved_tokens=1)  # never released
    survivor = QuotaService(db, lease_ttl=30, clock=clock)
    with pytest.raises(APIError):
        await survivor.acquire(principal, reserved_tokens=1)
    clock.advance(29.9)
    with pytest.raises(APIError):
        await survivor.acquire(principal, reserved_tokens=1)
    clock.advance(0.2)
    lease = await survivor.acquire(principal, reserved_tokens=1)
    await survivor.release(lease, used_tokens=1)


async def test_old_lease_rows_are_cleaned_up(db: Database, clock) -> None:
    principal = await _key(db, rpm_limit=1000)
    quotas = QuotaService(db, clock=clock, cleanup_interval=30)
    for _ in range(5):
        await quotas.release(await quotas.acquire(principal, reserved_tokens=1), used_tokens=1)
    clock.advance(120)
    await quotas.acquire(principal, reserved_tokens=1)  # triggers the periodic clean-up
    async with db.session() as session:
        count = await session.scalar(select(func.count()).select_from(QuotaLease))
    assert count == 1


async def test_daily_budget_resets_with_the_period(db: Database, clock) -> None:
    principal = await _key(db, token_budget=100, budget_period="day")
    quotas = QuotaService(db, clock=clock)
    yesterday = await quotas.acquire(principal, reserved_tokens=100)
    with pytest.raises(APIError, match="today"):
        await quotas.acquire(principal, reserved_tokens=1)
    clock.advance(timedelta(days=1).total_seconds())
    today = await quotas.acquire(principal, reserved_tokens=60)
    # Reconciling yesterday's reservation must not touch today's balance.
    await quotas.release(yesterday, used_tokens=0)
    assert await _budget_used(db, principal.key_id) == 60
    await quotas.release(today, used_tokens=50)
    assert await _budget_used(db, principal.key_id) == 50


async def test_no_database_work_for_unlimited_principals(db: Database) -> None:
    unlimited = await _key(db)
    seen: list[str] = []
    event.listen(db.engine.sync_engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    quotas = QuotaService(db)
    for principal in (STATIC, unlimited):
        lease = await quotas.acquire(principal, reserved_tokens=10**9)
        assert lease.headers == {}
        await quotas.release(lease, used_tokens=5)
    assert seen == []


async def test_revoked_key_refused_at_admission(db: Database) -> None:
    principal = await _key(db, rpm_limit=10)  # as cached by the authenticator
    await KeyService(db).revoke(principal.key_id)
    with pytest.raises(APIError) as err:
        await QuotaService(db).acquire(principal, reserved_tokens=1)
    assert err.value.status_code == 401


async def test_outage_is_503_and_release_never_raises(
    db: Database, break_database, caplog: pytest.LogCaptureFixture
) -> None:
    principal = await _key(db, token_budget=100, max_parallel=3)
    quotas = QuotaService(db)
    lease = await quotas.acquire(principal, reserved_tokens=10)
    await break_database(db)
    with pytest.raises(APIError) as err:
        await quotas.acquire(principal, reserved_tokens=10)
    assert err.value.status_code == 503
    with caplog.at_level(logging.ERROR, logger="api.quotas.service"):
        await quotas.release(lease, used_tokens=5)
    assert "could not release quota lease" in caplog.text


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 0.02, 0.9999, 1, 1.5, 59.2, 60, 360, 61.25)] == [
        "0ms",
        "20ms",
        "1s",
        "1s",
        "1.5s",
        "59.2s",
        "1m0s",
        "6m0s",
        "1m1.25s",
    ]


async def test_bad_reservation_is_a_programming_error(db: Database) -> None:
    quotas = QuotaService(db)
    with pytest.raises(ValueError, match="negative"):
        await quotas.acquire(STATIC, reserved_tokens=-1)
    with pytest.raises(TypeError):
        await quotas.acquire(STATIC, reserved_tokens=1.5)  # type: ignore[arg-type]

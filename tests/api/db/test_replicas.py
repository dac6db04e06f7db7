"""Two replicas sharing one database: each with its own Database (connection pool),
Authenticator and QuotaService, as two server processes have. Runs on Postgres (the
multi-replica setup) and on one SQLite file (several processes on one host)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from api.db.session import Database
from api.keys.auth import Authenticator
from api.keys.service import KeyService
from api.quotas.service import Lease, QuotaService
from api.server.errors import APIError


@dataclass
class Replica:
    db: Database
    keys: KeyService
    auth: Authenticator
    quotas: QuotaService


@pytest.fixture
async def replicas(db: Database, database_url: str):
    made: list[Replica] = []
    for _ in range(2):
        rdb = Database.from_url(database_url)
        made.append(
            Replica(
                rdb,
                KeyService(rdb),
                Authenticator(rdb, mode="keys", static_keys=[], admin_token=None),
                QuotaService(rdb),
            )
        )
    try:
        yield made
    finally:
        for r in made:
            await r.db.dispose()


async def _attempt(replica: Replica, key: str, tokens: int) -> Lease | APIError:
    try:
        principal = await replica.auth.authenticate(f"Bearer {key}")
        return await replica.quotas.acquire(principal, reserved_tokens=tokens)
    except APIError as exc:
        return exc


async def test_revocation_on_one_replica_reaches_the_other_within_the_ttl(
    replicas: list[Replica],
) -> None:
    a, b = replicas
    record, key = await a.keys.create("shared")
    assert (await b.auth.authenticate(f"Bearer {key}")).key_id == record.id  # now cached on b
    await a.keys.revoke(record.id)
    a.auth.invalidate()  # what a's admin API does
    with pytest.raises(APIError):
        await a.auth.authenticate(f"Bearer {key}")
    await asyncio.sleep(b.auth.cache_ttl + 0.05)  # the documented bound (default 2 s)
    with pytest.raises(APIError, match="revoked") as err:
        await b.auth.authenticate(f"Bearer {key}")
    assert err.value.status_code == 401


async def test_budget_and_rate_limits_are_shared_not_doubled(replicas: list[Replica]) -> None:
    a, b = replicas
    _, key = await a.keys.create("shared", token_budget=1000, max_parallel=8)
    results = await asyncio.gather(*(_attempt(r, key, 100) for _ in range(20) for r in (a, b)))
    admitted = [r for r in results if isinstance(r, Lease)]
    refused = [r for r in results if isinstance(r, APIError)]
    # Budget allows 10, parallel 8: the tighter one wins across both replicas together.
    assert len(admitted) == 8
    assert {e.code for e in refused} <= {"rate_limit_exceeded", "insufficient_quota"}
    for lease in admitted:
        await a.quotas.release(lease, used_tokens=100)
    # 800 used: two more fit, on whichever replica, then the budget is spent for both.
    more = await asyncio.gather(*(_attempt(r, key, 100) for _ in range(3) for r in (a, b)))
    assert sum(isinstance(r, Lease) for r in more) == 2
    assert {r.code for r in more if isinstance(r, APIError)} == {"insufficient_quota"}

    _, rpm_key = await a.keys.create("rpm", rpm_limit=10)
    results = await asyncio.gather(*(_attempt(r, rpm_key, 1) for _ in range(20) for r in (a, b)))
    assert sum(isinstance(r, Lease) for r in results) == 10

"""Tenants: the admin REST API on a real app and database, what a key's principal gets from
its tenant, and tenant limits in QuotaService (the tighter of key and tenant wins, with no
overspend at the tenant's budget edge under 40 concurrent requests from several keys)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from uuid import uuid4

import pytest
from litestar import get
from litestar.di import NamedDependency
from litestar.testing import AsyncTestClient
from sqlalchemy import select

from api.db.models import Tenant
from api.db.session import Database
from api.keys.auth import Principal
from api.keys.service import KeyService
from api.quotas.service import Lease, QuotaService
from api.server.errors import APIError
from api.server.guards import require_api_key
from api.tenants.service import TenantService
from tests.api.db.test_admin import AUTH, make_app


@get("/v1/tenant", guards=[require_api_key], sync_to_thread=False)
def whoami_tenant(principal: NamedDependency[Principal]) -> dict:
    return {
        "key_id": principal.key_id,
        "tenant_id": principal.tenant_id,
        "tenant_weight": principal.tenant_weight,
        "cache_scope": principal.cache_scope,
        "request_timeout": principal.request_timeout,
        "tenant_limited": principal.tenant_limited,
    }


@pytest.fixture
async def client(db: Database, database_url: str) -> AsyncIterator[AsyncTestClient]:
    async with AsyncTestClient(make_app(database_url, (whoami_tenant,))) as test_client:
        yield test_client


async def test_tenant_crud_and_keys_in_it(client: AsyncTestClient) -> None:
    r = await client.post(
        "/admin/v1/tenants",
        headers=AUTH,
        json={"name": "team-a", "weight": 2, "token_budget": 5000, "budget_period": "day"},
    )
    assert r.status_code == 201, r.text
    tenant = r.json()
    assert tenant["object"] == "tenant" and tenant["weight"] == 2.0
    assert tenant["prefix_cache_scope"] == "key" and tenant["keys"] == 0
    tid = tenant["id"]
    dup = await client.post("/admin/v1/tenants", headers=AUTH, json={"name": "team-a"})
    assert dup.status_code == 400 and "already exists" in dup.json()["error"]["message"]
    for bad in ({"name": "x", "weight": 0}, {"name": "x", "prefix_cache_scope": "all"}):
        assert (await client.post("/admin/v1/tenants", headers=AUTH, json=bad)).status_code == 400

    # Keys created into the tenant; a key without tenant_id gets one of its own.
    made = []
    for name in ("a1", "a2"):
        r = await client.post("/admin/v1/keys", headers=AUTH, json={"name": name, "tenant_id": tid})
        assert r.status_code == 201 and r.json()["tenant_id"] == tid
        made.append(r.json())
    solo = (await client.post("/admin/v1/keys", headers=AUTH, json={"name": "solo"})).json()
    assert solo["tenant_id"] == solo["id"]
    r = await client.post("/admin/v1/keys", headers=AUTH, json={"name": "x", "tenant_id": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant_id"  # a body field

    listed = (await client.get("/admin/v1/tenants", headers=AUTH)).json()["data"]
    by_name = {t["name"]: t for t in listed}
    assert by_name["team-a"]["keys"] == 2 and by_name[f"solo-{solo['id'][:8]}"]["keys"] == 1
    keys = (await client.get(f"/admin/v1/tenants/{tid}/keys", headers=AUTH)).json()["data"]
    assert sorted(k["name"] for k in keys) == ["a1", "a2"]

    # The principal carries the tenant: weight, per-key cache scope, duration.
    a1 = await client.get("/v1/tenant", headers={"Authorization": f"Bearer {made[0]['key']}"})
    a2 = await client.get("/v1/tenant", headers={"Authorization": f"Bearer {made[1]['key']}"})
    p1, p2 = a1.json(), a2.json()
    assert p1["tenant_id"] == tid and p1["tenant_weight"] == 2.0 and p1["tenant_limited"]
    assert p1["cache_scope"] == p2["cache_scope"] == "key"

    r = await client.patch(
        f"/admin/v1/tenants/{tid}",
        headers=AUTH,
        json={"prefix_cache_scope": "tenant", "weight": 0.5, "max_request_seconds": 30,
              "token_budget": None},
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["prefix_cache_scope"] == "tenant"
    await client.patch(
        f"/admin/v1/keys/{made[0]['id']}", headers=AUTH, json={"max_request_seconds": 10}
    )
    p1 = (
        await client.get("/v1/tenant", headers={"Authorization": f"Bearer {made[0]['key']}"})
    ).json()
    p2 = (
        await client.get("/v1/tenant", headers={"Authorization": f"Bearer {made[1]['key']}"})
    ).json()
    assert p1["cache_scope"] == p2["cache_scope"] == "tenant"  # shared within the tenant...
    solo_p = (
        await client.get("/v1/tenant", headers={"Authorization": f"Bearer {solo['key']}"})
    ).json()
    assert solo_p["cache_scope"] == "key" and solo_p["tenant_id"] != p1["tenant_id"]
    assert (p1["request_timeout"], p2["request_timeout"]) == (10, 30)  # the tighter
    assert p1["tenant_weight"] == 0.5 and not p1["tenant_limited"]

    # Moving a key to another tenant; unknown tenants are 404.
    r = await client.patch(f"/admin/v1/keys/{solo['id']}", headers=AUTH, json={"tenant_id": tid})
    assert r.status_code == 200 and r.json()["tenant_id"] == tid
    r = await client.patch("/admin/v1/tenants/nope", headers=AUTH, json={"weight": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"

    # DELETE disables: its keys are refused, then PATCH re-enables.
    r = await client.delete(f"/admin/v1/tenants/{tid}", headers=AUTH)
    assert r.status_code == 200 and r.json()["disabled_at"] is not None
    r = await client.get("/v1/tenant", headers={"Authorization": f"Bearer {made[0]['key']}"})
    assert r.status_code == 401 and "tenant has been disabled" in r.json()["error"]["message"]
    hidden = await client.get("/admin/v1/tenants?include_disabled=false", headers=AUTH)
    assert tid not in [t["id"] for t in hidden.json()["data"]]
    await client.patch(f"/admin/v1/tenants/{tid}", headers=AUTH, json={"disabled": False})
    r = await client.get("/v1/tenant", headers={"Authorization": f"Bearer {made[0]['key']}"})
    assert r.status_code == 200


# -- quotas -----------------------------------------------------------------------------------


async def _try(quotas: QuotaService, principal: Principal, n: int) -> Lease | APIError:
    try:
        return await quotas.acquire(principal, reserved_tokens=n)
    except APIError as exc:
        return exc


async def _tenant_used(db: Database, tenant_id: str) -> int:
    async with db.session() as session:
        return await session.scalar(select(Tenant.budget_used).where(Tenant.id == tenant_id))


async def _principals(db: Database, tenant_id: str, n: int, **key_limits) -> list[Principal]:
    keys = KeyService(db)
    out = []
    for i in range(n):
        record, _ = await keys.create(f"k{i}", tenant_id=tenant_id, **key_limits)
        out.append(Principal.from_record(await keys.get(record.id)))
    return out


async def test_tenant_budget_edge_40_concurrent_from_several_keys(db: Database) -> None:
    budget = 1000
    tenant = await TenantService(db).create("edge", token_budget=budget)
    # Each key may take 600 tokens, far more than its share of the tenant's 1000: the
    # tenant's budget stops the burst.
    principals = await _principals(db, tenant.id, 4, token_budget=600)
    assert all(p.tenant_limited and p.tenant_id == tenant.id for p in principals)
    quotas = QuotaService(db)
    sizes = [random.Random(i).randint(60, 140) for i in range(40)]
    results = await asyncio.gather(
        *(_try(quotas, principals[i % 4], n) for i, n in enumerate(sizes))
    )
    admitted = [(i, n, r) for i, (n, r) in enumerate(zip(sizes, results, strict=True))
                if isinstance(r, Lease)]  # fmt: skip
    refused = [(i, n, r) for i, (n, r) in enumerate(zip(sizes, results, strict=True))
               if isinstance(r, APIError)]  # fmt: skip
    total = sum(n for _, n, _ in admitted)
    assert total <= budget and len(admitted) + len(refused) == 40
    assert 6 <= len(admitted) <= 16
    assert await _tenant_used(db, tenant.id) == total
    per_key = [sum(n for i, n, _ in admitted if i % 4 == k) for k in range(4)]
    # Which requests win the race is up to the database, so one key may take most of the
    # tenant's budget and meet its own 600 first. Either way a refusal names the limit it
    # did not fit (reservations only grow during the burst, so the final sums bound it),
    # and the least-used key never nears its 600: its refusals are the tenant's.
    for i, n, err in refused:
        assert (err.status_code, err.code) == (429, "insufficient_quota")
        assert err.headers["x-should-retry"] == "false"
        if "tenant's token budget" in err.message:
            assert total + n > budget
        else:
            assert "API key's token budget" in err.message, err.message
            assert per_key[i % 4] + n > 600
    least_used = per_key.index(min(per_key))
    assert any(i % 4 == least_used for i, _, _ in refused)
    assert all("tenant's token budget" in err.message
               for i, _, err in refused if i % 4 == least_used)  # fmt: skip
    # Keys' own counters hold exactly their share; releases reconcile both levels.
    records = [await KeyService(db).get(p.key_id) for p in principals]
    assert [r.budget_used for r in records] == per_key
    await asyncio.gather(*(quotas.release(lease, used_tokens=10) for _, _, lease in admitted))
    assert await _tenant_used(db, tenant.id) == 10 * len(admitted)
    records = [await KeyService(db).get(p.key_id) for p in principals]
    assert sum(r.budget_used for r in records) == 10 * len(admitted)


async def test_the_tighter_limit_wins(db: Database) -> None:
    tenant = await TenantService(db).create("tight", max_parallel=3, rpm_limit=100)
    a, b = await _principals(db, tenant.id, 2, max_parallel=2)
    quotas = QuotaService(db)
    # Key a: its own cap of 2 refuses the third, although the tenant has room.
    la = [await quotas.acquire(a, reserved_tokens=1) for _ in range(2)]
    with pytest.raises(APIError, match="this API key allows 2"):
        await quotas.acquire(a, reserved_tokens=1)
    # Key b: one fits, then the tenant's cap of 3 (over both keys) refuses the next.
    lb = await quotas.acquire(b, reserved_tokens=1)
    with pytest.raises(APIError, match="tenant allows 3") as err:
        await quotas.acquire(b, reserved_tokens=1)
    assert err.value.status_code == 429 and err.value.code == "rate_limit_exceeded"
    assert lb.headers["x-ratelimit-limit-requests"] == "100"
    await quotas.release(la[0], used_tokens=1)
    await quotas.acquire(b, reserved_tokens=1)  # a freed slot of the tenant's is b's now

    # The two refusals rolled back their reservations: 4 admitted requests of 1 token.
    record = await TenantService(db).get(tenant.id)
    assert record is not None and record.budget_used == 4


async def test_tenant_rpm_counts_every_key_of_it(db: Database, clock) -> None:
    tenant = await TenantService(db).create("rpm", rpm_limit=3)
    principals = await _principals(db, tenant.id, 3)
    quotas = QuotaService(db, clock=clock)
    for p in principals:
        await quotas.release(await quotas.acquire(p, reserved_tokens=5), used_tokens=5)
        clock.advance(1)
    with pytest.raises(APIError, match="3 requests per minute for this API key's tenant") as e:
        await quotas.acquire(principals[0], reserved_tokens=5)
    assert e.value.headers["Retry-After"] == "57"
    clock.advance(57)
    await quotas.acquire(principals[1], reserved_tokens=5)


async def test_disabled_tenant_refused_at_admission(db: Database) -> None:
    tenant = await TenantService(db).create("off", token_budget=100)
    (p,) = await _principals(db, tenant.id, 1)
    await TenantService(db).disable(tenant.id)
    with pytest.raises(APIError, match="tenant has been disabled") as err:
        await QuotaService(db).acquire(p, reserved_tokens=1)
    assert err.value.status_code == 401


def test_principal_from_a_key_and_its_tenant() -> None:
    """Scope and duration are pure functions of the records: the tenant's scope, and the
    tighter of the two maximum durations."""
    from dataclasses import replace
    from datetime import datetime

    from api.keys.service import KeyRecord
    from api.tenants.service import TenantRecord

    now = datetime.now()
    unlimited = dict(rpm_limit=None, tpm_limit=None, max_parallel=None, token_budget=None,
                     budget_period="total", budget_used=0)  # fmt: skip
    t = TenantRecord("t1", "t", 2.0, "key", now, None, **unlimited, max_request_seconds=60.0)
    k = KeyRecord("k1", "k", "tsr-", now, None, None, None, 0, {}, None, "t1", t, **unlimited)
    p = Principal.from_record(k)
    assert (p.tenant_id, p.tenant_weight, p.cache_scope, p.request_timeout) == (
        "t1",
        2.0,
        "key",
        60,
    )
    assert not p.tenant_limited and not p.has_limits
    shared = replace(t, prefix_cache_scope="tenant", token_budget=5)
    p = Principal.from_record(replace(k, tenant=shared, max_request_seconds=5.0))
    assert (p.cache_scope, p.request_timeout, p.tenant_limited, p.has_limits) == (
        "tenant", 5.0, True, True)  # fmt: skip
    p = Principal.from_record(replace(k, tenant=replace(t, max_request_seconds=None)))
    assert p.request_timeout is None


async def test_usage_by_tenant(client: AsyncTestClient, db: Database) -> None:
    from api.usage.service import UsageRecord, UsageRecorder

    tenant = await TenantService(db).create("usage-t")
    inside, _ = await KeyService(db).create("in", tenant_id=tenant.id)
    outside, _ = await KeyService(db).create("out")
    recorder = UsageRecorder(db)
    for key, tid in ((inside, tenant.id), (inside, tenant.id), (outside, outside.tenant_id)):
        recorder.record(UsageRecord(request_id=uuid4().hex, key_id=key.id, model="m",
                                    prompt_tokens=3, completion_tokens=2, tenant_id=tid,
                                    x_request_id="rid"))  # fmt: skip
    assert await recorder.flush()
    r = await client.get(f"/admin/v1/usage?tenant_id={tenant.id}", headers=AUTH)
    data = r.json()["data"]
    assert [(d["key_id"], d["requests"], d["total_tokens"]) for d in data] == [(inside.id, 2, 10)]

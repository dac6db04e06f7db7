"""Migrations: empty -> head on both databases, no drift between models and migrations."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import inspect

from api.db.migrate import downgrade_to, head_revisions, schema_drift
from api.db.models import Base, utcnow
from api.db.session import Database, SchemaOutOfDate, default_database_url, normalize_url


def _tables(conn) -> set[str]:
    return set(inspect(conn).get_table_names())


async def test_upgrade_from_empty_to_head_without_drift(database_url: str) -> None:
    db = Database.from_url(database_url)
    try:
        assert await db.current_revision() == ()
        assert not await db.is_up_to_date()
        await db.upgrade()
        assert await db.current_revision() == head_revisions()
        assert await db.is_up_to_date()
        async with db.engine.connect() as conn:
            assert set(Base.metadata.tables) <= await conn.run_sync(_tables)
            assert await conn.run_sync(schema_drift) == []
        await db.upgrade()  # idempotent
        assert await db.is_up_to_date()
    finally:
        await db.dispose()


async def test_downgrade_to_base_and_back(database_url: str) -> None:
    db = Database.from_url(database_url)
    try:
        await db.upgrade()
        await asyncio.to_thread(downgrade_to, db.url, "base")
        async with db.engine.connect() as conn:
            assert not set(Base.metadata.tables) & await conn.run_sync(_tables)
        assert await db.current_revision() == ()
        await db.upgrade()
        assert await db.is_up_to_date()
    finally:
        await db.dispose()


async def test_ensure_schema_migrates_sqlite_but_refuses_postgres(database_url: str) -> None:
    db = Database.from_url(database_url)
    try:
        if db.is_sqlite:
            await db.ensure_schema()
            assert await db.is_up_to_date()
        else:
            with pytest.raises(SchemaOutOfDate, match="tessera db upgrade"):
                await db.ensure_schema()
            assert await db.current_revision() == ()
    finally:
        await db.dispose()


def test_urls(tmp_path) -> None:
    url = default_database_url(tmp_path)
    assert url == f"sqlite+aiosqlite:///{tmp_path.resolve() / 'tessera.db'}"
    assert normalize_url("postgres://u:p@h/db").drivername == "postgresql+asyncpg"
    assert normalize_url("sqlite:///x.db").drivername == "sqlite+aiosqlite"
    for bad in ("mysql://u@h/db", "not a url"):
        with pytest.raises(ValueError, match="database URL"):
            normalize_url(bad)


async def test_0002_puts_each_existing_key_in_a_tenant_of_its_own(database_url: str) -> None:
    """Keys and usage rows written at revision 0001 survive the upgrade: each key is the
    only key of an unlimited tenant with its id, its own limits unchanged."""
    from sqlalchemy import text

    from api.db.migrate import upgrade_to
    from api.keys.auth import Principal
    from api.keys.service import KeyService
    from api.tenants.service import TenantService

    db = Database.from_url(database_url)
    try:
        await asyncio.to_thread(upgrade_to, db.url, "0001")
        async with db.engine.begin() as conn:
            for kid, name in (("a" * 32, "alice"), ("b" * 32, "alice"), ("c" * 32, "carol")):
                await conn.execute(
                    text(
                        "INSERT INTO api_keys (id, name, key_digest, key_prefix, created_at, "
                        "budget_period, budget_used, budget_period_start, priority, rpm_limit) "
                        "VALUES (:id, :name, :digest, 'tsr-x', :created, 'total', 7, 0.0, 0, 5)"
                    ),
                    {"id": kid, "name": name, "digest": kid * 2, "created": utcnow()},
                )
            await conn.execute(
                text(
                    "INSERT INTO usage_records (request_id, key_id, model, prompt_tokens, "
                    "completion_tokens, cached_tokens, status_code, created_at) VALUES "
                    "('r1', :kid, 'm', 1, 2, 0, 200, :created)"
                ),
                {"kid": "a" * 32, "created": utcnow()},
            )
        await db.upgrade()
        assert await db.current_revision() == head_revisions()
        async with db.engine.connect() as conn:
            assert await conn.run_sync(schema_drift) == []
            tenant_of_usage = await conn.scalar(text("SELECT tenant_id FROM usage_records"))
        assert tenant_of_usage == "a" * 32
        tenants = {t.id: t for t in await TenantService(db).list()}
        keys = await KeyService(db).list()
        assert len(tenants) == 3 and {k.tenant_id for k in keys} == set(tenants)
        for key in keys:
            tenant = tenants[key.tenant_id]
            assert key.tenant_id == key.id and tenant.keys == 1
            assert tenant.name == f"{key.name}-{key.id[:8]}"
            assert not tenant.has_limits and tenant.weight == 1.0
            assert tenant.prefix_cache_scope == "key"
            assert (key.rpm_limit, key.budget_used) == (5, 7)
            assert Principal.from_record(key).tenant_id == key.id
        # And down again: the tenants table goes, the keys stay.
        await asyncio.to_thread(downgrade_to, db.url, "0001")
        async with db.engine.connect() as conn:
            assert "tenants" not in await conn.run_sync(_tables)
            assert await conn.scalar(text("SELECT count(*) FROM api_keys")) == 3
    finally:
        await db.dispose()

"""Migrations: empty -> head on both databases, no drift between models and migrations."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import inspect

from api.db.migrate import downgrade_to, head_revisions, schema_drift
from api.db.models import Base
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

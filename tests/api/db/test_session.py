"""Database: transactions, per-backend connection settings."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, text

from api.db.models import ApiKey
from api.db.session import Database
from api.keys.service import KeyService


async def test_transaction_commits_or_rolls_back(db: Database) -> None:
    record, _ = await KeyService(db).create("k")
    with pytest.raises(RuntimeError):
        async with db.transaction(write=True) as conn:
            await conn.execute(ApiKey.__table__.delete())
            raise RuntimeError("abort")
    async with db.transaction() as conn:
        assert await conn.scalar(select(func.count()).select_from(ApiKey)) == 1
    async with db.transaction(write=True, durable=False) as conn:
        await conn.execute(ApiKey.__table__.update().values(priority=3))
    assert (await KeyService(db).get(record.id)).priority == 3


async def test_backend_settings(db: Database) -> None:
    if db.is_sqlite:
        async with db.transaction() as conn:
            assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar() == 5000
            assert (await conn.execute(text("PRAGMA foreign_keys"))).scalar() == 1
        return
    show = text("SHOW synchronous_commit")
    async with db.transaction(write=True, durable=False) as conn:
        assert (await conn.execute(show)).scalar() == "off"  # quota counters, usage rows
    async with db.transaction(write=True) as conn:
        assert (await conn.execute(show)).scalar() == "on"
    async with db.session(write=True) as session:  # key changes: always durable
        assert (await session.execute(show)).scalar() == "on"
    async with db.session() as session:
        assert (await session.execute(text("SHOW TimeZone"))).scalar() == "UTC"

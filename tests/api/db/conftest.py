"""Fixtures: the same tests on a real SQLite file and on a real Postgres.

`database_url` is parametrised: a fresh SQLite file in tmp_path, and a freshly created
Postgres database on 127.0.0.1:5432 (created from the `test` database, dropped afterwards;
marked `postgres`, skipped with a reason when that server is not reachable).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from api.db.session import Database
from tests.api.keys_http import fresh_database, pg_admin


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
)
def database_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(autouse=True)
async def _aiosqlite_threads_finish() -> AsyncIterator[None]:
    """After a failed SQLite connect, aiosqlite's worker thread still posts one result to
    the event loop; let it land before pytest closes the loop (else 'Event loop is closed'
    in that thread). A live server's loop outlives its threads, so this is test-only."""
    yield
    for thread in threading.enumerate():
        if thread.name.endswith("(_connection_worker_thread)"):
            await asyncio.to_thread(thread.join, 1.0)


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = Database.from_url(database_url)
    await database.upgrade()
    try:
        yield database
    finally:
        await database.dispose()


@pytest.fixture
def break_database():
    """An outage of a live database: SQLite's file becomes a directory, Postgres's
    database is dropped under the open connections."""

    async def breaker(db: Database) -> None:
        await db.dispose()
        if db.is_sqlite:
            path = Path(db.url.database or "")
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
            path.mkdir()
        else:
            await pg_admin(f'DROP DATABASE "{db.url.database}" WITH (FORCE)')

    return breaker


class FakeClock:
    """Wall-clock seconds the test moves by hand (quota windows and lease TTLs)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()

"""Raw-driver access for the request hot path: the quota transactions
(api/quotas/service.py) and the usage ledger's batched inserts (api/usage/service.py).

Every request of a limited key runs two short transactions (reserve, release). Through the
SQLAlchemy session layer each statement costs ~0.5 ms of CPU (expression building, the
greenlet bridge, aiosqlite's thread hop per statement), several ms per request, and a
100-row ledger INSERT held the event loop for tens of ms. Here the same SQL runs on the
driver itself:

    Postgres  an asyncpg connection borrowed from the Database's own pool (so settings,
              limits and dispose() are shared), its statements prepared once per
              connection by asyncpg's statement cache;
    SQLite    one stdlib sqlite3 connection per Database, used on the event loop (each
              statement takes microseconds) inside the Database's in-process writer lock,
              BEGIN IMMEDIATE. Another *process* writing (the `tessera keys` CLI) can make
              BEGIN wait, for at most BUSY_TIMEOUT_MS.

    store = raw_store(db)                       # one per Database
    async with store.transaction() as tx:       # commits on exit, rolls back on error
        row = await tx.fetchrow(SQL, *args)     # SQL written with $1, $2 ... placeholders
    await store.executemany(SQL, rows)          # one transaction
    # The SQLite connection closes with db.dispose(); Postgres's are the pool's.

SQL is constant text with bound parameters, never built from values; SQLite spells the
numbered parameters $N as ?N. STORE_ERRORS are what a broken or unreachable database raises.
"""

from __future__ import annotations

import contextlib
import sqlite3
import weakref
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import asyncpg
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.util import greenlet_spawn

from api.db.session import Database

BUSY_TIMEOUT_MS = 1000
STORE_ERRORS: tuple[type[BaseException], ...] = (
    SQLAlchemyError,
    OSError,
    TimeoutError,
    sqlite3.Error,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)


class Tx(Protocol):
    async def fetchrow(self, sql: str, *args: Any) -> Sequence[Any] | None: ...

    async def fetch(self, sql: str, *args: Any) -> list[Sequence[Any]]: ...

    async def execute(self, sql: str, *args: Any) -> None: ...


class RawStore(Protocol):
    def transaction(self) -> contextlib.AbstractAsyncContextManager[Tx]: ...

    async def execute(self, sql: str, *args: Any) -> None:
        """One statement, in a transaction of its own."""

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """One statement for each row, all in one transaction."""

    def timestamp(self, value: datetime) -> Any:
        """A UTC datetime as this database compares it with the keys' timestamp columns."""

    def datetime(self, value: Any) -> datetime | None:
        """A timestamp column's value as an aware UTC datetime."""


_stores: weakref.WeakKeyDictionary[Database, RawStore] = weakref.WeakKeyDictionary()


def raw_store(db: Database) -> RawStore:
    """The Database's store (created on first use; its SQLite connection closes with it)."""
    store = _stores.get(db)
    if store is None:
        store = _stores[db] = SQLiteStore(db) if db.is_sqlite else PostgresStore(db)
    return store


# -- Postgres -------------------------------------------------------------------------------


class _PgTx:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def fetchrow(self, sql: str, *args: Any) -> Sequence[Any] | None:
        return await self.conn.fetchrow(sql, *args)

    async def fetch(self, sql: str, *args: Any) -> list[Sequence[Any]]:
        return await self.conn.fetch(sql, *args)

    async def execute(self, sql: str, *args: Any) -> None:
        await self.conn.execute(sql, *args)


class PostgresStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        async with self._connection() as conn, conn.transaction():
            yield _PgTx(conn)

    async def execute(self, sql: str, *args: Any) -> None:
        async with self._connection() as conn:
            await conn.execute(sql, *args)  # outside a transaction block: autocommit

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        async with self._connection() as conn:
            await conn.executemany(sql, rows)  # atomic, and pipelined by asyncpg

    async def call(self, definition: str, sql: str, *args: Any) -> Sequence[Any] | None:
        """One autocommit statement calling a pg_temp function; `definition` creates the
        function on a connection that does not have it yet (the first call on each)."""
        async with self._connection() as conn:
            try:
                return await conn.fetchrow(sql, *args)
            except (asyncpg.UndefinedFunctionError, asyncpg.InvalidSchemaNameError):
                # (A session that never made a temporary object has no pg_temp schema yet.)
                await conn.execute(definition)
                return await conn.fetchrow(sql, *args)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        try:
            fairy = await self.db.engine.raw_connection()
        except self.db.engine.dialect.loaded_dbapi.Error as exc:
            # Connecting goes through SQLAlchemy's driver adapter, whose errors are its own.
            raise ConnectionError(f"cannot connect to the database: {exc}") from exc
        conn: asyncpg.Connection = fairy.driver_connection
        try:
            yield conn
        finally:
            # A transaction left open (a rollback cut short by cancellation) or a broken
            # connection must not go back to the pool: SQLAlchemy cannot see our transaction.
            # The pool may close a connection on check-in: that is async I/O, hence greenlet.
            if conn.is_closed() or conn.is_in_transaction():
                await greenlet_spawn(fairy.invalidate)
            await greenlet_spawn(fairy.close)

    def timestamp(self, value: datetime) -> datetime:
        return _utc(value)

    def datetime(self, value: Any) -> datetime | None:
        return value


# -- SQLite ---------------------------------------------------------------------------------


class _SqliteTx:
    """sqlite3 is synchronous: these return without yielding to the loop (microseconds)."""

    _converted: dict[str, str] = {}

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    @classmethod
    def sql(cls, sql: str) -> str:
        # $N and ?N are both "the N-th parameter"; only the spelling differs.
        converted = cls._converted.get(sql)
        if converted is None:
            converted = cls._converted[sql] = sql.replace("$", "?")
        return converted

    async def fetchrow(self, sql: str, *args: Any) -> Sequence[Any] | None:
        return self.conn.execute(self.sql(sql), args).fetchone()

    async def fetch(self, sql: str, *args: Any) -> list[Sequence[Any]]:
        return self.conn.execute(self.sql(sql), args).fetchall()

    async def execute(self, sql: str, *args: Any) -> None:
        self.conn.execute(self.sql(sql), args)


class SQLiteStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._conn: sqlite3.Connection | None = None
        db.on_dispose(self._close)  # reopened on next use, like the pool's connections

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            path = Path(self.db.url.database or "")
            # isolation_level=None: transactions are the explicit BEGIN IMMEDIATE below.
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA busy_timeout=1000")  # BUSY_TIMEOUT_MS
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._conn = conn
        return self._conn

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        async with self.db.sqlite_write_lock():
            conn = self._connect()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteTx(conn)
            except BaseException:
                conn.rollback()  # synchronous: also completes under cancellation
                raise
            conn.commit()

    async def execute(self, sql: str, *args: Any) -> None:
        async with self.transaction() as tx:
            await tx.execute(sql, *args)

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        async with self.transaction() as tx:
            assert isinstance(tx, _SqliteTx)
            tx.conn.executemany(tx.sql(sql), rows)

    def timestamp(self, value: datetime) -> str:
        # How api.db.models.UTCDateTime stores times on SQLite: naive UTC, microseconds.
        return _utc(value).strftime("%Y-%m-%d %H:%M:%S.%f")

    def datetime(self, value: Any) -> datetime | None:
        if value is None:
            return None
        return datetime.fromisoformat(value).replace(tzinfo=UTC)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _utc(value: datetime) -> datetime:
    # Naive times are UTC, as api.db.models.UTCDateTime reads them.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

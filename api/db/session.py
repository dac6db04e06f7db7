"""The async database handle: engine, sessions and schema migrations.

Interface used by the app:

    db = Database.from_url(url)      # sqlite+aiosqlite:///path or postgresql+asyncpg://...
    async with db.session() as s:    # AsyncSession; commit explicitly
        ...
    async with db.session(write=True) as s:   # a write transaction, see below
        ...
    async with db.transaction(write=True, durable=True) as conn:  # Core; commits at exit
        ...
    await db.upgrade()               # alembic upgrade head, in a worker thread
    await db.is_up_to_date()         # current revision == head
    await db.ensure_schema()         # SQLite: upgrade; Postgres: raise SchemaOutOfDate
    await db.dispose()
    default_database_url(data_dir)   # sqlite+aiosqlite:///<data_dir>/tessera.db

Plain `sqlite:///` and `postgresql://` / `postgres://` URLs are accepted and mapped to the
async drivers. Postgres sessions run with TimeZone=UTC.

SQLite: WAL journal, busy_timeout 5 s, foreign keys on. SQLAlchemy emits BEGIN itself (the
sqlite3 module's implicit transactions are switched off), and `write=True` transactions
begin with BEGIN IMMEDIATE after taking an in-process lock, so read-modify-write
transactions (quota reservation) are serialised within the process by the lock and across
processes by SQLite's write lock. On Postgres `write=True` is a plain transaction: the services make
their writes atomic with conditional UPDATEs, which lock the row.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.engine.url import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine

from api.db.migrate import current_revisions, head_revisions, upgrade_to_head

_IMMEDIATE = "tessera_sqlite_immediate"
_DURABLE = "tessera_durable_commit"


class SchemaOutOfDate(RuntimeError):
    """The database is not migrated to the code's head revision."""


def default_database_url(data_dir: Path) -> str:
    return f"sqlite+aiosqlite:///{Path(data_dir).expanduser().resolve() / 'tessera.db'}"


def normalize_url(url: str | URL) -> URL:
    """Parse `url` and map it onto an async driver; ValueError for anything else."""
    try:
        parsed = url if isinstance(url, URL) else make_url(url)
    except Exception as exc:  # sqlalchemy raises ArgumentError with a terse message
        raise ValueError(f"invalid database URL {redact(url)!r}: {exc}") from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "postgres":
        backend = "postgresql"
    if backend == "sqlite" and driver in ("", "pysqlite", "aiosqlite"):
        return parsed.set(drivername="sqlite+aiosqlite")
    if backend == "postgresql" and driver in ("", "psycopg2", "asyncpg"):
        return parsed.set(drivername="postgresql+asyncpg")
    raise ValueError(
        f"unsupported database URL {redact(url)!r}: use sqlite+aiosqlite:///<path> "
        "or postgresql+asyncpg://user:password@host:port/dbname"
    )


def redact(url: str | URL) -> str:
    """The URL with its password hidden, for messages and logs."""
    try:
        return (url if isinstance(url, URL) else make_url(url)).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable database URL>"


def create_engine(url: str | URL, **kwargs: Any) -> AsyncEngine:
    """An AsyncEngine with Tessera's per-backend settings (also used by migrations/env.py)."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = _create_async_engine(parsed, **kwargs)
        _install_sqlite_hooks(engine)
        return engine
    # Commits do not wait for the WAL flush (an fsync: ~5 ms on a VM disk) unless the
    # transaction asks to be durable (see Database.transaction). A crash of the Postgres
    # server may lose its last ~0.6 s of relaxed commits (quota counters, usage rows), never
    # consistency; key changes made through the admin API and CLI are always durable.
    settings = {"timezone": "UTC", "synchronous_commit": "off"}
    connect_args: dict[str, Any] = {"timeout": 5, "server_settings": settings}
    connect_args.update(kwargs.pop("connect_args", {}))
    # No pool_pre_ping: it costs a round trip per checkout on the hot path. A connection
    # broken by a server restart fails once (503), and SQLAlchemy then invalidates the pool.
    if "poolclass" not in kwargs:
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 20)
    engine = _create_async_engine(parsed, connect_args=connect_args, **kwargs)
    _install_postgres_hooks(engine)
    return engine


def _install_postgres_hooks(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        if conn.get_execution_options().get(_DURABLE, False):
            conn.exec_driver_sql("SET LOCAL synchronous_commit TO ON")


def _install_sqlite_hooks(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # SQLAlchemy, not the sqlite3 module, decides when transactions begin.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        for pragma in (
            "PRAGMA journal_mode=WAL",
            "PRAGMA synchronous=NORMAL",
            "PRAGMA busy_timeout=5000",
            "PRAGMA foreign_keys=ON",
        ):
            cursor.execute(pragma)
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get(_IMMEDIATE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


class Database:
    def __init__(self, engine: AsyncEngine, url: URL) -> None:
        self.engine = engine
        self.url = url
        self.is_sqlite = url.get_backend_name() == "sqlite"
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)
        # SQLite writes begin IMMEDIATE; Postgres durable writes wait for the WAL flush.
        self._relaxed_engine = (
            engine.execution_options(**{_IMMEDIATE: True}) if self.is_sqlite else engine
        )
        self._write_engine = (
            self._relaxed_engine if self.is_sqlite else engine.execution_options(**{_DURABLE: True})
        )
        self._write_sessions = async_sessionmaker(self._write_engine, expire_on_commit=False)
        self._write_lock: asyncio.Lock | None = None
        self._on_dispose: list[Callable[[], None]] = []

    @classmethod
    def from_url(cls, url: str, **engine_kwargs: Any) -> Database:
        parsed = normalize_url(url)
        return cls(create_engine(parsed, **engine_kwargs), parsed)

    @property
    def dialect(self) -> str:
        return self.url.get_backend_name()

    def __repr__(self) -> str:
        return f"Database({redact(self.url)!r})"

    @contextlib.asynccontextmanager
    async def session(self, *, write: bool = False) -> AsyncIterator[AsyncSession]:
        """An AsyncSession; the caller commits. Leaving the block rolls back what is left."""
        async with self._sqlite_write_lock(write):
            factory = self._write_sessions if write else self._sessions
            async with factory() as session:
                yield session

    @contextlib.asynccontextmanager
    async def transaction(
        self, *, write: bool = False, durable: bool = True
    ) -> AsyncIterator[AsyncConnection]:
        """A Core connection inside a transaction: commits on success, else rolls back.

        Cheaper than a Session; the quota hot path uses it. `durable=False` (Postgres)
        commits without waiting for the WAL flush: for data whose last fraction of a second
        may be lost in a database-server crash (quota counters, the usage ledger). Write
        sessions are always durable."""
        if write:
            engine = self._write_engine if durable else self._relaxed_engine
        else:
            engine = self.engine
        async with self._sqlite_write_lock(write), engine.begin() as conn:
            yield conn

    def sqlite_write_lock(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The in-process lock every SQLite write transaction holds; writers that bypass
        SQLAlchemy (the quota hot path) take it too. A no-op on Postgres."""
        return self._sqlite_write_lock(True)

    @contextlib.asynccontextmanager
    async def _sqlite_write_lock(self, write: bool) -> AsyncIterator[None]:
        if not (write and self.is_sqlite):
            yield
            return
        if self._write_lock is None:
            self._write_lock = asyncio.Lock()
        async with self._write_lock:
            yield

    async def upgrade(self) -> None:
        await asyncio.to_thread(upgrade_to_head, self.url)

    async def current_revision(self) -> tuple[str, ...]:
        async with self.engine.connect() as conn:
            return await conn.run_sync(current_revisions)

    async def is_up_to_date(self) -> bool:
        return set(await self.current_revision()) == set(head_revisions())

    async def ensure_schema(self) -> None:
        """Migrate SQLite automatically; refuse an un-migrated Postgres with the fix."""
        if await self.is_up_to_date():
            return
        if self.is_sqlite:
            await self.upgrade()
            return
        raise SchemaOutOfDate(
            f"the database {redact(self.url)} is not at the current schema revision; "
            f"run `tessera db upgrade --database-url {redact(self.url)}` first"
        )

    def on_dispose(self, close: Callable[[], None]) -> None:
        """Call `close` when the pool is disposed: for connections opened outside it."""
        self._on_dispose.append(close)

    async def dispose(self) -> None:
        for close in self._on_dispose:
            close()
        await self.engine.dispose()


def default_data_dir() -> Path:
    if env := os.environ.get("TESSERA_DATA_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "tessera"


def resolve_database_url(database_url: str | None, data_dir: str | Path | None) -> str:
    """--database-url, else TESSERA_DATABASE_URL, else SQLite in the data dir."""
    url = database_url or os.environ.get("TESSERA_DATABASE_URL")
    if url:
        return url
    return default_database_url(Path(data_dir) if data_dir else default_data_dir())

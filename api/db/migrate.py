"""Alembic, driven programmatically, so migrations work from an installed package.

The scripts live in the repository's top-level `migrations/` folder (env.py, script.py.mako,
versions/), which a wheel installs as api/db/migrations; `migrations/alembic.ini` is only for
developers who run the `alembic` command directly.
These helpers are synchronous: Database runs them in a worker thread (upgrade) or through
AsyncConnection.run_sync (revision and drift checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.engine.url import URL

# One Postgres advisory lock serialises concurrent `tessera db upgrade` runs (an init container
# in each of N replicas): the second waits, then finds the schema at head and does nothing.
# A fixed 64-bit key, "tessera1" in ASCII; other applications on a shared Postgres pick theirs.
MIGRATION_LOCK_KEY = 0x7465737365726131


def take_migration_lock(conn: Connection) -> None:
    """Postgres: wait for the migration lock, held until this transaction ends (commit or
    rollback, or the connection dying), so no replica can leave it held. Other dialects: none
    needed (SQLite is one file that one server migrates under its own write lock)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})


def migrations_dir() -> Path:
    """api/db/migrations when installed from a wheel (setup.py maps it there), else the source
    checkout's top-level migrations/ (editable install, PYTHONPATH). The installed copy is
    looked for first: next to an installed package, ../../migrations is site-packages/migrations,
    which may be another project's."""
    here = Path(__file__).resolve().parent
    for path in (here / "migrations", here.parents[1] / "migrations"):
        if (path / "env.py").is_file() and (path / "versions").is_dir():
            return path
    raise RuntimeError("Tessera's migrations/ folder is missing from this installation")


def alembic_config(url: URL | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # Passed as an object, not through the ini parser (which would choke on '%').
    cfg.attributes["url"] = url
    return cfg


def upgrade_to_head(url: URL) -> None:
    command.upgrade(alembic_config(url), "head")


def upgrade_to(url: URL, revision: str) -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade_to(url: URL, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def head_revisions() -> tuple[str, ...]:
    return tuple(ScriptDirectory.from_config(alembic_config()).get_heads())


def current_revisions(conn: Connection) -> tuple[str, ...]:
    return tuple(MigrationContext.configure(conn).get_current_heads())


def _only_ours(name: str | None, type_: str, parent_names: dict[str, Any]) -> bool:
    # A shared Postgres may hold other applications' tables: compare only Tessera's.
    from api.db.models import Base

    return type_ != "table" or name in Base.metadata.tables


def schema_drift(conn: Connection) -> list[Any]:
    """Differences between the models and the live schema (empty = no drift)."""
    from api.db.models import Base

    ctx = MigrationContext.configure(conn, opts={"compare_type": True, "include_name": _only_ours})
    return list(compare_metadata(ctx, Base.metadata))

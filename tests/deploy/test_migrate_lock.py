"""`tessera db upgrade` takes a Postgres advisory lock, so the migrate init containers of N
replicas starting together never race: with the lock held by the test, two real upgrade
processes both wait on it (seen in pg_locks) and create nothing; released, both exit 0 and the
schema is at head.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import asyncpg
import pytest

from api.db.migrate import MIGRATION_LOCK_KEY, head_revisions
from tests.api.keys_http import fresh_database

pytestmark = [pytest.mark.postgres]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def upgrade(url: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env["PYTHONPATH"] = REPO
    cmd = [sys.executable, "-m", "api.cli", "db", "upgrade", "--database-url", url]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


async def _scenario(url: str) -> None:
    dsn = url.replace("postgresql+asyncpg://", "postgresql://")
    holder = await asyncpg.connect(dsn, timeout=5)
    procs: list[subprocess.Popen] = []
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        procs = [upgrade(url), upgrade(url)]
        # Both upgrades reach the lock and wait there (bounded: each process starts in seconds).
        deadline = time.monotonic() + 120
        waiting = 0
        while waiting < 2:
            assert time.monotonic() < deadline, "the upgrades never waited on the lock"
            for p in procs:
                assert p.poll() is None, p.stdout.read()
            waiting = await holder.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            await asyncio.sleep(0.2)
        tables = await holder.fetchval(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        )
        assert tables == 0, "an upgrade ran without the lock"
        await holder.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
        outputs = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outputs.append(out)
            assert p.returncode == 0, out
        # The second to get the lock found the schema at head (a racing second upgrade fails
        # creating tables that exist, or on alembic_version's primary key).
        versions = await holder.fetch("SELECT version_num FROM alembic_version")
        assert tuple(r["version_num"] for r in versions) == head_revisions()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        await holder.close()


def test_concurrent_upgrades_run_one_after_the_other(tmp_path):
    with fresh_database("postgres", tmp_path) as url:
        asyncio.run(_scenario(url))

"""--db-timeout: the admin REST API and the console answer 503 while a table is locked
(Postgres `LOCK TABLE` held in another connection), within the timeout, then recover."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import httpx
import pytest

from tests.api.keys_http import (
    ADMIN_TOKEN,
    PG_ADMIN_DSN,
    Admin,
    fresh_database,
    start_keys_server,
)
from tests.console.conftest import login

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

DB_TIMEOUT = 1.0


async def _locked_then(url: str, table: str, probe) -> list:
    """Run `probe` while another connection holds ACCESS EXCLUSIVE on `table`."""
    dsn = PG_ADMIN_DSN.rsplit("/", 1)[0] + "/" + url.rsplit("/", 1)[1]
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        try:
            return await probe()
        finally:
            await tx.rollback()
    finally:
        await conn.close()


def test_locked_table_gives_503_within_the_timeout(start_server, tiny_llama_dir, tmp_path):
    with fresh_database("postgres", tmp_path) as url:
        server = start_keys_server(
            start_server, tiny_llama_dir, tmp_path, url, "--db-timeout", str(DB_TIMEOUT)
        )
        admin = Admin(server)
        key_id, _ = admin.create_key("locked")

        async def probe() -> list:
            out = []
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
                for method, path in (
                    ("GET", "/admin/v1/keys"),
                    ("GET", f"/admin/v1/keys/{key_id}"),
                ):
                    started = time.monotonic()
                    r = await c.request(method, path, headers=headers)
                    out.append((path, r.status_code, r.json(), time.monotonic() - started))
                assert (await login(c, ADMIN_TOKEN)).status_code == 302
                started = time.monotonic()
                r = await c.get("/console/keys")
                out.append(("/console/keys", r.status_code, r.json(), time.monotonic() - started))
            return out

        results = asyncio.run(_locked_then(url, "api_keys", probe))
        for path, status, body, took in results:
            assert status == 503, (path, status, body)
            assert body["error"]["type"] == "service_unavailable", body
            # Answered by the deadline, not by the lock (held until the probe is done).
            assert took < 10 * DB_TIMEOUT + 5, (path, took)
        # The lock is gone: the same calls work again.
        assert admin.key(key_id)["name"] == "locked"
        assert admin.request("GET", "/keys").status_code == 200

"""Helpers for the HTTP tests of keys, quotas and usage: servers in keys mode on a real
SQLite file or a fresh Postgres database, and the admin REST API over HTTP.

    with fresh_database("postgres", tmp) as url: ...       # created, then dropped
    server = start_keys_server(start_server, model_dir, tmp, url)
    admin = Admin(server)                                   # the admin token, Bearer
    key_id, key = admin.create_key("name", token_budget=100)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

PG_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/test"
PG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
ADMIN_TOKEN = "tsa-test-admin-token-for-http-tests"
MODEL = "tiny"
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


async def pg_admin(sql: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def pg_run(sql: str) -> None:
    asyncio.run(pg_admin(sql))


@contextlib.contextmanager
def fresh_database(backend: str, tmp: Path) -> Iterator[str]:
    """A URL to an empty database: a SQLite file in tmp, or a new Postgres database."""
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp / 'tessera.db'}"
        return
    name = f"tessera_h_{uuid.uuid4().hex[:16]}"
    try:
        # Identifiers cannot be bound parameters; `name` is generated here, never input.
        pg_run(f'CREATE DATABASE "{name}"')
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.skip(f"Postgres on 127.0.0.1:5432 not available: {exc}")
    try:
        yield PG_URL.format(name=name)
    finally:
        pg_run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def migrate(url: str) -> None:
    """`tessera db upgrade` (Postgres is not migrated by `tessera serve`)."""
    from api.cli.main import main

    assert main(["db", "upgrade", "--database-url", url]) == 0


def start_keys_server(start_server, model_dir: Path, tmp: Path, url: str, *extra: str):
    if url.startswith("postgresql"):
        migrate(url)
    args = ["--served-model-name", MODEL, "--data-dir", str(tmp), "--database-url", url]
    return start_server(model_dir, *args, "--admin-token", ADMIN_TOKEN, *extra)


class Admin:
    """The admin REST API of one server."""

    def __init__(self, server: Any, token: str = ADMIN_TOKEN) -> None:
        self.base = server.base_url + "/admin/v1"
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, self.base + path, headers=self.headers, timeout=30, **kwargs)

    def create_key(self, name: str | None = None, **fields: Any) -> tuple[str, str]:
        body = {"name": name or f"k-{uuid.uuid4().hex[:8]}", **fields}
        r = self.request("POST", "/keys", content=json.dumps(body, default=str))
        assert r.status_code == 201, r.text
        return r.json()["id"], r.json()["key"]

    def key(self, key_id: str) -> dict:
        r = self.request("GET", f"/keys/{key_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def revoke(self, key_id: str) -> None:
        assert self.request("DELETE", f"/keys/{key_id}").status_code == 200

    def usage(self, key_id: str) -> dict:
        """The key's totals from GET /admin/v1/usage (the ledger is written in batches:
        wait until `requests` stops changing)."""
        last: dict | None = None
        deadline = time.monotonic() + 10
        while True:
            r = self.request("GET", "/usage", params={"key_id": key_id})
            assert r.status_code == 200, r.text
            buckets = r.json()["data"]
            total = {
                f: sum(b[f] for b in buckets)
                for f in ("requests", "errors", "prompt_tokens", "completion_tokens")
            }
            if total == last or time.monotonic() > deadline:
                return total
            last = total
            time.sleep(0.7)  # longer than the recorder's 0.5 s batch interval


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def prompt_tokens(server: Any, key: str, prompt: str) -> int:
    r = httpx.post(
        server.base_url + "/tokenize", json={"prompt": prompt}, headers=bearer(key), timeout=30
    )
    assert r.status_code == 200, r.text
    return r.json()["count"]


def complete(server: Any, key: str, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, **body}
    return httpx.post(
        server.base_url + "/v1/completions", json=payload, headers=bearer(key), timeout=60
    )

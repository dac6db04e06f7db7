"""X-Request-Id end to end on a real `tessera serve` (SQLite ledger, --log-format json): the
client's id comes back on the response, is in the JSON log lines of that request, and in its
usage row; an invalid id is replaced; errors and unknown routes carry one too. Plus the tenant
on the usage row and in the log line, and the in-process request context pieces."""

from __future__ import annotations

import io
import json
import logging
import uuid

import httpx
import pytest
from sqlalchemy import select

from api.db.models import UsageRow
from api.server.logs import configure_logging
from api.server.request_context import accept_request_id
from tests.api.keys_http import MODEL, Admin, bearer, start_keys_server
from tests.api.usage.test_usage_http import ledger


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rid")
    url = f"sqlite+aiosqlite:///{tmp / 'tessera.db'}"
    srv = start_keys_server(start_server, tiny_llama_dir, tmp, url, "--log-format", "json")
    srv.db_url = url
    return srv


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue  # e.g. the banner, printed before logging starts
        if isinstance(value, dict):
            out.append(value)
    return out


def test_request_id_in_header_log_and_usage_row(server) -> None:
    admin = Admin(server)
    r = admin.request("POST", "/tenants", json={"name": "team-rid"})
    tenant = r.json()
    key_id, key = admin.create_key("rid-key", tenant_id=tenant["id"])
    rid = f"client-{uuid.uuid4().hex[:12]}"
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(
        server.base_url + "/v1/completions",
        json=body,
        headers={**bearer(key), "X-Request-Id": rid},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    completion_id = r.json()["id"]

    # The usage row names the client's id and the tenant.
    admin.usage(key_id)  # waits for the ledger's batch
    row = ledger(server.db_url)[completion_id]
    assert (row.x_request_id, row.tenant_id, row.key_id) == (rid, tenant["id"], key_id)

    # The server's log: JSON lines, the access line of this request carries its id.
    lines = _json_lines(server.log(tail=None))
    assert lines and all({"ts", "level", "logger", "msg", "request_id"} <= set(e) for e in lines)
    mine = [e for e in lines if e["request_id"] == rid]
    assert any(e["logger"] == "uvicorn.access" and "/v1/completions" in e["msg"] for e in mine)
    assert all(e["tenant"] in (None, "team-rid") for e in mine)


def test_generated_and_invalid_ids_and_errors(server) -> None:
    # No id: one is generated, different per request.
    a = httpx.get(server.base_url + "/health", timeout=10).headers["x-request-id"]
    b = httpx.get(server.base_url + "/health", timeout=10).headers["x-request-id"]
    assert a != b and len(a) == 32
    # An invalid id (too long, spaces, a forged log line) is replaced, never echoed.
    for bad in ("x" * 129, "has space", 'evil" {"level":"error"}', ""):
        r = httpx.get(server.base_url + "/health", headers={"X-Request-Id": bad}, timeout=10)
        assert r.headers["x-request-id"] != bad and len(r.headers["x-request-id"]) == 32
    # Errors carry the client's id: 401 (no key), 404 (no route), 400 (bad body).
    for method, path, kwargs in (
        ("POST", "/v1/completions", {"json": {"model": MODEL, "prompt": "x"}}),
        ("GET", "/v1/nope", {}),
    ):
        r = httpx.request(
            method, server.base_url + path, headers={"X-Request-Id": "err-1"}, timeout=10, **kwargs
        )
        assert r.status_code in (401, 404) and r.headers["x-request-id"] == "err-1"
    _, key = Admin(server).create_key()
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": -1},
        headers={**bearer(key), "X-Request-Id": "err-2"},
        timeout=10,
    )
    assert r.status_code == 400 and r.headers["x-request-id"] == "err-2"


def test_accept_request_id() -> None:
    assert accept_request_id(b"abc-123_X.y:z/1+2=3@4") == "abc-123_X.y:z/1+2=3@4"
    assert accept_request_id(b"a" * 128) == "a" * 128
    for bad in (b"a" * 129, b"", b"a b", "é".encode(), b"a\nb", None):
        assert len(accept_request_id(bad)) == 32


def test_json_log_format_outside_a_request() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("info", "json", stream)
        logging.getLogger("tessera.test").info("hello %s", "world", extra={"key_id": "k1"})
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("tessera.test").exception("failed")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "hello world" and first["level"] == "info"
    assert first["request_id"] is None and first["key_id"] == "k1"
    assert first["logger"] == "tessera.test" and first["ts"].endswith("+00:00")
    assert second["level"] == "error" and "ValueError: boom" in second["exc"]
    with pytest.raises(ValueError, match="log format"):
        configure_logging("info", "xml")


def test_usage_rows_select(server) -> None:
    # The x_request_id column is indexed: a lookup by it finds the request's row.
    import asyncio

    from api.db.session import Database

    async def find(rid: str) -> list[UsageRow]:
        db = Database.from_url(server.db_url)
        try:
            async with db.session() as s:
                q = select(UsageRow).where(UsageRow.x_request_id == rid)
                return list((await s.scalars(q)).all())
        finally:
            await db.dispose()

    _, key = Admin(server).create_key()
    body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2}
    r = httpx.post(server.base_url + "/v1/completions", json=body,
                   headers={**bearer(key), "X-Request-Id": "two-prompts"}, timeout=60)  # fmt: skip
    assert r.status_code == 200
    Admin(server).usage(r.json()["id"])  # any key: waits for the ledger batch
    rows = asyncio.run(find("two-prompts"))
    assert len(rows) == 1 and rows[0].request_id == r.json()["id"]


def test_user_field_on_the_usage_row(server) -> None:
    # OpenAI's `user` (the caller's end-user id) is recorded on the row, on both routes;
    # one over 256 characters is a 400 naming it, and writes no row with it.
    key_id, key = Admin(server).create_key()
    completion = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "user": "end-user-42"},
        headers=bearer(key),
        timeout=60,
    )
    chat = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "user": "end-user-43",
        },
        headers=bearer(key),
        timeout=60,
    )
    plain = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers=bearer(key),
        timeout=60,
    )
    assert completion.status_code == chat.status_code == plain.status_code == 200
    too_long = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "user": "u" * 257},
        headers=bearer(key),
        timeout=60,
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "user"
    Admin(server).usage(key_id)  # waits for the ledger's batch
    rows = ledger(server.db_url)
    assert rows[completion.json()["id"]].end_user == "end-user-42"
    assert rows[chat.json()["id"]].end_user == "end-user-43"
    assert rows[plain.json()["id"]].end_user is None
    assert not any(r.end_user == "u" * 257 for r in rows.values())

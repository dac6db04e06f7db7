"""The /admin/v1 controller on a real Litestar app and a real database."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from litestar import Litestar, Request, Response, get
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components
from litestar.testing import AsyncTestClient

from api.admin.routes import ADMIN_CONTROLLERS, ADMIN_SECURITY_NAME, ADMIN_SECURITY_SCHEME
from api.db.session import Database
from api.keys.auth import Authenticator, Principal
from api.keys.service import KeyService
from api.server.errors import APIError
from api.server.guards import provide_principal, require_api_key
from api.tenants.service import TenantService
from api.usage.service import UsageRecord, UsageRecorder

ADMIN = "admin-secret-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def _api_error(_: Request, exc: APIError) -> Response:
    return Response(exc.to_body(), status_code=exc.status_code, headers=exc.headers)


def _http_error(_: Request, exc: HTTPException) -> Response:
    # Litestar's own errors (body validation) in the same envelope, as the app does.
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
    return Response(body, status_code=exc.status_code)


def engine_stats() -> dict:
    return {"num_requests_running": 2, "num_requests_waiting": 1, "kv_cache_usage": 0.25}


@get("/v1/whoami", guards=[require_api_key], sync_to_thread=False)
def whoami(principal: NamedDependency[Principal]) -> dict:
    """A stand-in inference route: shows what the API-key guard authenticated."""
    return {"key_id": principal.key_id, "rpm_limit": principal.rpm_limit}


def make_app(database_url: str, extra_routes: tuple = ()) -> Litestar:
    # The test client serves the app on its own event loop: the app gets its own Database
    # (like another replica), created and disposed on that loop; `db` stays the test's.
    app_db = Database.from_url(database_url)
    authenticator = Authenticator(
        app_db, mode="keys", static_keys=[], admin_token=ADMIN, cache_ttl=2.0
    )
    return Litestar(
        route_handlers=[*ADMIN_CONTROLLERS, whoami, *extra_routes],
        exception_handlers={APIError: _api_error, HTTPException: _http_error},
        dependencies={"principal": Provide(provide_principal, sync_to_thread=False)},
        on_shutdown=[app_db.dispose],
        state=State(
            {
                "keys": KeyService(app_db),
                "tenants": TenantService(app_db),
                "authenticator": authenticator,
                "engine_stats": engine_stats,
            }
        ),
        openapi_config=OpenAPIConfig(
            title="test",
            version="0",
            components=Components(security_schemes={ADMIN_SECURITY_NAME: ADMIN_SECURITY_SCHEME}),
        ),
    )


@pytest.fixture
async def client(db: Database, database_url: str) -> AsyncIterator[AsyncTestClient]:
    async with AsyncTestClient(make_app(database_url)) as test_client:
        yield test_client


async def test_database_outage_is_503(database_url: str, tmp_path) -> None:
    if database_url.startswith("sqlite"):
        down = f"sqlite+aiosqlite:///{tmp_path}"  # a directory: cannot be opened
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        down = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/test"
    async with AsyncTestClient(make_app(down)) as client:
        for method, path in (
            ("GET", "/admin/v1/keys"),
            ("GET", "/admin/v1/keys/abc"),
            ("POST", "/admin/v1/keys"),
            ("GET", "/admin/v1/usage"),
        ):
            r = await client.request(method, path, headers=AUTH, json={"name": "x"})
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["type"] == "service_unavailable"
        r = await client.get("/v1/whoami", headers={"Authorization": "Bearer tsr-" + "D" * 43})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert (await client.get("/admin/v1/engine", headers=AUTH)).status_code == 200


async def test_admin_token_required(client: AsyncTestClient, db: Database) -> None:
    _, api_key = await KeyService(db).create("not-an-admin")
    assert (await _whoami(client, api_key))[0] == 200  # a valid key, just not an admin one
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {api_key}"},
        {"Authorization": "Bearer " + "x" * 10_000},
        {"Authorization": f"Basic {ADMIN}"},
    ):
        for method, path in (
            ("GET", "/admin/v1/keys"),
            ("POST", "/admin/v1/keys"),
            ("GET", "/admin/v1/keys/abc"),
            ("DELETE", "/admin/v1/keys/abc"),
            ("GET", "/admin/v1/usage"),
            ("GET", "/admin/v1/engine"),
        ):
            r = await client.request(method, path, headers=headers, json={"name": "x"})
            assert r.status_code == 401, (method, path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"


async def test_create_list_get_patch(client: AsyncTestClient) -> None:
    body = {
        "name": "team-a",
        "allowed_models": ["m1"],
        "rpm_limit": 60,
        "tpm_limit": None,
        "max_parallel": 4,
        "token_budget": 10_000,
        "budget_period": "day",
        "priority": 3,
        "expires_at": "2999-01-01T00:00:00Z",
        "metadata": {"owner": "a@example.com"},
    }
    r = await client.post("/admin/v1/keys", json=body, headers=AUTH)
    assert r.status_code == 201, r.text
    created = r.json()
    key = created["key"]
    assert key.startswith("tsr-") and created["key_prefix"] == key[:12]
    for field, value in body.items():
        if field != "expires_at":
            assert created[field] == value, field
    assert datetime.fromisoformat(created["expires_at"]) == datetime(2999, 1, 1, tzinfo=UTC)
    assert created["revoked_at"] is None and created["budget_used"] == 0
    key_id = created["id"]

    minimal = await client.post("/admin/v1/keys", json={"name": "b"}, headers=AUTH)
    assert minimal.status_code == 201
    assert minimal.json()["rpm_limit"] is None and minimal.json()["budget_period"] == "total"

    listed = (await client.get("/admin/v1/keys", headers=AUTH)).json()
    assert listed["object"] == "list" and [k["name"] for k in listed["data"]] == ["team-a", "b"]
    assert all("key" not in k for k in listed["data"])
    assert key not in (await client.get("/admin/v1/keys", headers=AUTH)).text

    got = await client.get(f"/admin/v1/keys/{key_id}", headers=AUTH)
    assert got.status_code == 200 and "key" not in got.json()
    assert got.json()["name"] == "team-a"
    missing = await client.get("/admin/v1/keys/nope", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

    patched = await client.patch(
        f"/admin/v1/keys/{key_id}", json={"rpm_limit": None, "priority": -1}, headers=AUTH
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["rpm_limit"] is None and patched.json()["priority"] == -1
    assert patched.json()["max_parallel"] == 4  # untouched
    r = await client.patch("/admin/v1/keys/nope", json={"priority": 1}, headers=AUTH)
    assert r.status_code == 404


BAD_BODIES = [
    {},
    {"name": ""},
    {"name": "x", "rpm_limit": 0},
    {"name": "x", "budget_period": "week"},
    {"name": "x", "colour": "red"},
    {"name": "x", "priority": 10**6},
    {"name": "x", "expires_at": "soon"},
    {"name": "x", "metadata": {"big": "y" * 20000}},
]


async def test_bad_bodies_are_400(client: AsyncTestClient) -> None:
    created = (await client.post("/admin/v1/keys", json={"name": "k"}, headers=AUTH)).json()
    for body in BAD_BODIES:
        r = await client.post("/admin/v1/keys", json=body, headers=AUTH)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
        if body:
            r = await client.patch(f"/admin/v1/keys/{created['id']}", json=body, headers=AUTH)
            assert r.status_code == 400, (body, r.text)
    listed = (await client.get("/admin/v1/keys", headers=AUTH)).json()["data"]
    assert [k["name"] for k in listed] == ["k"]


async def _whoami(client: AsyncTestClient, key: str) -> tuple[int, dict]:
    r = await client.get("/v1/whoami", headers={"Authorization": f"Bearer {key}"})
    return r.status_code, r.json()


async def test_changes_take_effect_at_once_on_this_replica(client: AsyncTestClient) -> None:
    created = (
        await client.post("/admin/v1/keys", json={"name": "k", "rpm_limit": 5}, headers=AUTH)
    ).json()
    key_id, old = created["id"], created["key"]
    assert await _whoami(client, old) == (200, {"key_id": key_id, "rpm_limit": 5})

    await client.patch(f"/admin/v1/keys/{key_id}", json={"rpm_limit": 9}, headers=AUTH)
    assert (await _whoami(client, old))[1]["rpm_limit"] == 9  # cache dropped, not 2 s late

    rotated = await client.post(f"/admin/v1/keys/{key_id}/rotate", headers=AUTH)
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()["key"]
    assert new != old and rotated.json()["key_prefix"] == new[:12]
    valid_until = datetime.fromisoformat(rotated.json()["previous_key_valid_until"])
    assert valid_until > datetime.now(UTC) + timedelta(minutes=59)  # default grace 1 h
    assert (await _whoami(client, old))[0] == 200
    assert (await _whoami(client, new))[0] == 200

    again = await client.post(
        f"/admin/v1/keys/{key_id}/rotate", json={"grace_seconds": 0}, headers=AUTH
    )
    newest = again.json()["key"]
    for stale in (old, new):
        status, body = await _whoami(client, stale)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert (await _whoami(client, newest))[0] == 200

    revoked = await client.delete(f"/admin/v1/keys/{key_id}", headers=AUTH)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    status, body = await _whoami(client, newest)
    assert status == 401 and "revoked" in body["error"]["message"]
    r = await client.post(f"/admin/v1/keys/{key_id}/rotate", headers=AUTH)
    assert r.status_code == 400 and "revoked" in r.json()["error"]["message"]
    assert (await client.delete("/admin/v1/keys/nope", headers=AUTH)).status_code == 404
    bad = await client.post(
        f"/admin/v1/keys/{key_id}/rotate", json={"grace_seconds": -5}, headers=AUTH
    )
    assert bad.status_code == 400


async def test_usage_and_engine(client: AsyncTestClient, db: Database) -> None:
    created = (await client.post("/admin/v1/keys", json={"name": "u"}, headers=AUTH)).json()
    recorder = UsageRecorder(db)
    when = datetime(2025, 6, 1, 10, 15, tzinfo=UTC)
    for i in range(3):
        recorder.record(
            UsageRecord(
                request_id=f"r{i}",
                key_id=created["id"],
                model="m",
                prompt_tokens=10,
                completion_tokens=i,
                created_at=when + timedelta(hours=i),
            )
        )
    await recorder.stop()

    r = await client.get(
        "/admin/v1/usage",
        params={"key_id": created["id"], "group_by": "hour", "since": "2025-06-01T11:00:00Z"},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["group_by"] == "hour"
    assert [(d["period_start"][:19], d["requests"], d["total_tokens"]) for d in report["data"]] == [
        ("2025-06-01T11:00:00", 1, 11),
        ("2025-06-01T12:00:00", 1, 12),
    ]
    assert report["data"][0]["key_name"] == "u"
    daily = (await client.get("/admin/v1/usage", headers=AUTH)).json()["data"]
    assert [(d["requests"], d["prompt_tokens"], d["completion_tokens"]) for d in daily] == [
        (3, 30, 3)
    ]
    bad = await client.get("/admin/v1/usage", params={"group_by": "week"}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"

    engine = await client.get("/admin/v1/engine", headers=AUTH)
    assert engine.status_code == 200 and engine.json() == engine_stats()


async def test_openapi_documents_the_admin_api(client: AsyncTestClient) -> None:
    schema = (await client.get("/schema/openapi.json")).json()
    paths = schema["paths"]
    assert {"post", "get"} <= set(paths["/admin/v1/keys"])
    assert {"get", "patch", "delete"} <= set(paths["/admin/v1/keys/{key_id}"])
    assert "post" in paths["/admin/v1/keys/{key_id}/rotate"]
    assert "/admin/v1/usage" in paths and "/admin/v1/engine" in paths
    assert paths["/admin/v1/keys"]["post"]["security"] == [{ADMIN_SECURITY_NAME: []}]
    assert ADMIN_SECURITY_NAME in schema["components"]["securitySchemes"]

"""Authenticator: header parsing, key lookup + cache, revocation bound, outages -> 503."""

from __future__ import annotations

import asyncio
import logging
import socket
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import event

from api.db.session import Database
from api.keys.auth import ADMIN, ANONYMOUS, STATIC, Authenticator, Principal
from api.keys.service import KeyService
from api.server.errors import APIError

ADMIN_TOKEN = "admin-token-for-tests-0123456789"


def _auth(db: Database | None, **kw) -> Authenticator:
    kw.setdefault("mode", "keys")
    kw.setdefault("static_keys", [])
    kw.setdefault("admin_token", ADMIN_TOKEN)
    return Authenticator(db, **kw)


def _statements(db: Database) -> list[str]:
    """Every SQL statement the engine sends from now on (a real observation, not a mock)."""
    seen: list[str] = []
    event.listen(
        db.engine.sync_engine,
        "before_cursor_execute",
        lambda _c, _cur, statement, *_: seen.append(statement),
    )
    return seen


async def _status(coro) -> int:
    try:
        await coro
    except APIError as exc:
        return exc.status_code
    return 200


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_valid_key_gives_its_principal(db: Database) -> None:
    record, key = await KeyService(db).create(
        "alice",
        allowed_models=["m"],
        rpm_limit=3,
        tpm_limit=300,
        max_parallel=2,
        token_budget=1000,
        budget_period="day",
        priority=7,
    )
    principal = await _auth(db).authenticate(f"Bearer {key}")
    assert principal == Principal(
        key_id=record.id,
        key_name="alice",
        allowed_models=("m",),
        rpm_limit=3,
        tpm_limit=300,
        max_parallel=2,
        token_budget=1000,
        budget_period="day",
        priority=7,
        # A key created without a tenant is the only key of a tenant of its own.
        tenant_id=record.id,
        tenant_name=f"alice-{record.id[:8]}",
    )
    assert await _auth(db).authenticate(f"bearer   {key}  ") == principal  # scheme any case


BAD_HEADERS = [
    None,
    "",
    "Bearer",
    "Bearer ",
    "Basic dXNlcjpwYXNz",
    "tsr-abc",
    "Bearer a b",
    "Bearer tsr-é" + "a" * 50,
    "Bearer tsr-\x00" + "a" * 50,
    "Bearer " + "x" * 10_000,
    "Bearer tsr-" + "A" * 10_000,
    "Bearer tsr-short",
    "Bearer sk-" + "a" * 48,
]


async def test_bad_headers_are_401_without_touching_the_database(db: Database) -> None:
    auth = _auth(db)
    seen = _statements(db)
    for header in BAD_HEADERS:
        with pytest.raises(APIError) as err:
            await auth.authenticate(header)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key", header
        assert err.value.to_body()["error"]["type"] == "invalid_request_error"
        with pytest.raises(APIError) as err:
            auth.authenticate_admin(header)
        assert err.value.status_code == 401
    assert seen == [] and auth.db_lookups == 0


async def test_unknown_keys_are_cached_negatively_and_lookups_coalesce(db: Database) -> None:
    await KeyService(db).create("someone")
    auth = _auth(db, cache_ttl=5)
    bogus = "Bearer tsr-" + "B" * 43
    statuses = await asyncio.gather(*(_status(auth.authenticate(bogus)) for _ in range(50)))
    assert statuses == [401] * 50
    for _ in range(20):
        assert await _status(auth.authenticate(bogus)) == 401
    assert auth.db_lookups == 1


async def test_revoked_key_refused_after_cache_ttl(db: Database) -> None:
    keys = KeyService(db)
    record, key = await keys.create("k")
    auth = _auth(db, cache_ttl=0.3)
    assert (await auth.authenticate(f"Bearer {key}")).key_id == record.id
    await keys.revoke(record.id)  # as another replica would: this cache is not told
    await asyncio.sleep(0.35)
    with pytest.raises(APIError, match="revoked") as err:
        await auth.authenticate(f"Bearer {key}")
    assert err.value.status_code == 401
    # invalidate() makes a local change visible at once (the admin API calls it).
    other, other_key = await keys.create("k2")
    assert await auth.authenticate(f"Bearer {other_key}")
    await keys.revoke(other.id)
    auth.invalidate()
    assert await _status(auth.authenticate(f"Bearer {other_key}")) == 401


async def test_expiry_is_exact_even_while_cached(db: Database) -> None:
    keys = KeyService(db)
    # The already-expired key first: creating a key (and its tenant) must not eat into the
    # 0.3 s the other key has left on a loaded machine.
    _, expired = await keys.create("old", expires_at=datetime.now(UTC) - timedelta(seconds=1))
    soon = datetime.now(UTC) + timedelta(seconds=0.3)
    _, key = await keys.create("k", expires_at=soon)
    auth = _auth(db, cache_ttl=5)
    assert await auth.authenticate(f"Bearer {key}")
    await asyncio.sleep(0.35)
    with pytest.raises(APIError, match="expired"):
        await auth.authenticate(f"Bearer {key}")
    with pytest.raises(APIError, match="expired"):
        await auth.authenticate(f"Bearer {expired}")


async def test_rotation_grace_then_refusal(db: Database) -> None:
    keys = KeyService(db)
    record, old = await keys.create("k")
    _, new = await keys.rotate(record.id, grace_seconds=0.3)
    auth = _auth(db, cache_ttl=0)
    assert (await auth.authenticate(f"Bearer {old}")).key_id == record.id
    assert (await auth.authenticate(f"Bearer {new}")).key_id == record.id
    await asyncio.sleep(0.35)
    with pytest.raises(APIError, match="grace period has ended"):
        await auth.authenticate(f"Bearer {old}")
    assert (await auth.authenticate(f"Bearer {new}")).key_id == record.id


async def test_database_outage_is_503_never_401(database_url: str, tmp_path) -> None:
    if database_url.startswith("sqlite"):
        down_url = f"sqlite+aiosqlite:///{tmp_path}"  # a directory: cannot be opened
    else:
        down_url = f"postgresql+asyncpg://postgres@127.0.0.1:{_closed_port()}/test"
    down = Database.from_url(down_url)
    try:
        auth = _auth(down)
        for _ in range(2):  # failures are not cached as "unknown key"
            with pytest.raises(APIError) as err:
                await auth.authenticate("Bearer tsr-" + "C" * 43)
            assert err.value.status_code == 503
            assert err.value.headers["Retry-After"]
        # Bad headers are still 401 (decided before any lookup), and admin needs no DB.
        assert await _status(auth.authenticate("Bearer nope")) == 401
        assert await auth.authenticate(f"Bearer {ADMIN_TOKEN}") == ADMIN
    finally:
        await down.dispose()


async def test_outage_after_cache_expiry_is_503(db: Database, break_database) -> None:
    _, key = await KeyService(db).create("k")
    auth = _auth(db, cache_ttl=0)
    assert await auth.authenticate(f"Bearer {key}")
    await break_database(db)
    for _ in range(2):
        assert await _status(auth.authenticate(f"Bearer {key}")) == 503


async def test_static_and_none_modes() -> None:
    static = Authenticator(None, mode="static", static_keys=["k1", "k2"], admin_token=None)
    assert await static.authenticate("Bearer k2") == STATIC
    assert await _status(static.authenticate("Bearer k3")) == 401
    assert await _status(static.authenticate(None)) == 401
    with pytest.raises(APIError, match="admin API is disabled"):
        static.authenticate_admin("Bearer k1")
    open_server = Authenticator(None, mode="none", static_keys=[], admin_token=None)
    assert await open_server.authenticate(None) == ANONYMOUS
    assert await open_server.authenticate("Bearer whatever") == ANONYMOUS


async def test_admin_token() -> None:
    auth = Authenticator(None, mode="static", static_keys=["k"], admin_token=ADMIN_TOKEN)
    assert auth.authenticate_admin(f"Bearer {ADMIN_TOKEN}") == ADMIN
    assert await auth.authenticate(f"Bearer {ADMIN_TOKEN}") == ADMIN
    for wrong in (f"Bearer {ADMIN_TOKEN}x", "Bearer k", f"Basic {ADMIN_TOKEN}"):
        with pytest.raises(APIError) as err:
            auth.authenticate_admin(wrong)
        assert err.value.status_code == 401


def test_check_model_and_constructor_validation() -> None:
    auth = Authenticator(None, mode="none", static_keys=[], admin_token=None)
    limited = Principal(key_id="k", key_name="n", allowed_models=("a",))
    auth.check_model(limited, "a")
    auth.check_model(ANONYMOUS, "anything")
    with pytest.raises(APIError) as err:
        auth.check_model(limited, "b")
    assert err.value.status_code == 403 and err.value.code == "permission_denied"
    for kwargs, message in (
        ({"mode": "open"}, "auth mode must be one of"),
        ({"mode": "keys"}, "needs a database"),
        ({"mode": "static"}, "needs at least one API key"),
        ({"mode": "none", "cache_ttl": 10}, "cache_ttl"),
    ):
        with pytest.raises(ValueError, match=message):
            Authenticator(None, static_keys=[], admin_token=None, **kwargs)


async def test_keys_never_logged(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    keys = KeyService(db)
    record, key = await keys.create("k")
    auth = _auth(db, cache_ttl=0)
    await auth.authenticate(f"Bearer {key}")
    await keys.revoke(record.id)
    await _status(auth.authenticate(f"Bearer {key}"))
    await _status(auth.authenticate(f"Bearer {key}x"))
    text = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert key not in text and key[12:] not in text and ADMIN_TOKEN not in text

"""KeyService: CRUD, rotation with grace, revocation, expiry; secrets never stored."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from api.db.models import Base
from api.db.session import Database
from api.keys.service import KeyNotFound, KeyService, digest_key


async def _all_cells(db: Database) -> list[str]:
    cells: list[str] = []
    async with db.session() as session:
        for table in Base.metadata.sorted_tables:
            for row in (await session.execute(select(table))).all():
                cells.extend(str(v) for v in row)
    return cells


def _sqlite_bytes(db: Database) -> bytes:
    path = Path(db.url.database or "")
    return b"".join(p.read_bytes() for p in (path, Path(f"{path}-wal")) if p.exists())


async def test_create_get_list(db: Database) -> None:
    keys = KeyService(db)
    expires = datetime.now(UTC) + timedelta(days=30)
    record, plaintext = await keys.create(
        "  alice  ",
        allowed_models=["m1", "m2", "m1"],
        rpm_limit=60,
        tpm_limit=100_000,
        max_parallel=4,
        token_budget=1_000_000,
        budget_period="month",
        priority=-5,
        expires_at=expires,
        metadata={"team": "search", "tags": ["a", 1]},
    )
    assert re.fullmatch(r"tsr-[A-Za-z0-9_-]{43,}", plaintext)
    assert record.key_prefix == plaintext[:12] and record.key_prefix.startswith("tsr-")
    assert record.name == "alice"
    assert record.allowed_models == ("m1", "m2")
    assert (record.rpm_limit, record.tpm_limit, record.max_parallel) == (60, 100_000, 4)
    assert (record.token_budget, record.budget_period, record.budget_used) == (
        1_000_000,
        "month",
        0,
    )
    assert record.priority == -5
    assert record.metadata == {"team": "search", "tags": ["a", 1]}
    assert record.revoked_at is None
    assert record.is_active(datetime.now(UTC))

    fetched = await keys.get(record.id)
    assert fetched is not None
    assert fetched.expires_at == expires
    assert fetched.created_at.tzinfo is not None
    assert fetched == record

    other, _ = await keys.create("bob")
    assert (other.rpm_limit, other.token_budget, other.allowed_models) == (None, None, None)
    assert other.budget_period == "total" and other.metadata == {}
    assert [k.id for k in await keys.list()] == [record.id, other.id]
    assert await keys.get("nope") is None

    found = await keys.find_by_digest(digest_key(plaintext))
    assert found is not None and found[0].id == record.id and found[1] is None
    assert await keys.find_by_digest(digest_key(plaintext + "x")) is None


async def test_plaintext_never_stored(db: Database) -> None:
    keys = KeyService(db)
    record, plaintext = await keys.create("secret-holder", metadata={"note": "x"})
    _, rotated = await keys.rotate(record.id, grace_seconds=60)
    secrets = [plaintext, rotated, plaintext[12:], rotated[12:]]
    cells = await _all_cells(db)
    assert digest_key(rotated) in cells and digest_key(plaintext) in cells
    for secret in secrets:
        assert not any(secret in cell for cell in cells)
    if db.is_sqlite:
        raw = _sqlite_bytes(db)
        assert raw and digest_key(rotated).encode() in raw
        for secret in secrets:
            assert secret.encode() not in raw


async def test_update_partial_and_null_means_unlimited(db: Database) -> None:
    keys = KeyService(db)
    record, _ = await keys.create("k", rpm_limit=10, tpm_limit=500, allowed_models=["m"])
    updated = await keys.update(record.id, rpm_limit=None, max_parallel=2, name="renamed")
    assert updated.rpm_limit is None and updated.max_parallel == 2 and updated.name == "renamed"
    assert updated.tpm_limit == 500 and updated.allowed_models == ("m",)
    updated = await keys.update(record.id, allowed_models=None, metadata={"a": 1})
    assert updated.allowed_models is None and updated.metadata == {"a": 1}
    assert await keys.get(record.id) == updated


BAD_CHANGES = [
    ({"rpm_limit": 0}, "rpm_limit must be a whole number"),
    ({"tpm_limit": -1}, "tpm_limit must be a whole number"),
    ({"max_parallel": True}, "max_parallel must be a whole number"),
    ({"token_budget": 1.5}, "token_budget must be a whole number"),
    ({"budget_period": "week"}, "budget_period must be one of day, month, total"),
    ({"priority": 5000}, "priority must be a whole number"),
    ({"name": " "}, "name must be a non-empty string"),
    ({"allowed_models": "m"}, "allowed_models must be a list"),
    ({"allowed_models": [""]}, "each allowed model"),
    ({"metadata": [1]}, "metadata must be a JSON object"),
    ({"metadata": {"x": float("nan")}}, "JSON-serialisable"),
    ({"metadata": {"x": "y" * 20000}}, "at most 16384 bytes"),
    ({"expires_at": "tomorrow"}, "expires_at must be"),
    ({"colour": "red"}, "unknown key field"),
]


async def test_update_rejects_bad_input(db: Database) -> None:
    keys = KeyService(db)
    record, _ = await keys.create("k")
    for changes, message in BAD_CHANGES:
        with pytest.raises(ValueError, match=message):
            await keys.update(record.id, **changes)
        with pytest.raises(ValueError, match=message):
            await keys.create(**{"name": "new", **changes})
    assert await keys.list() == [record]


async def test_unknown_id_raises_key_not_found(db: Database) -> None:
    keys = KeyService(db)
    for call in (
        keys.update("missing", rpm_limit=1),
        keys.revoke("missing"),
        keys.rotate("missing"),
    ):
        with pytest.raises(KeyNotFound, match="missing"):
            await call


async def test_revoke_is_idempotent_and_listed(db: Database) -> None:
    keys = KeyService(db)
    record, _ = await keys.create("k")
    keep, _ = await keys.create("keep")
    revoked = await keys.revoke(record.id)
    assert revoked.revoked_at is not None and not revoked.is_active(datetime.now(UTC))
    again = await keys.revoke(record.id)
    assert again.revoked_at == revoked.revoked_at
    assert {k.id for k in await keys.list()} == {record.id, keep.id}
    assert [k.id for k in await keys.list(include_revoked=False)] == [keep.id]
    with pytest.raises(ValueError, match="revoked key cannot be rotated"):
        await keys.rotate(record.id)


async def test_rotate_with_grace(db: Database) -> None:
    keys = KeyService(db)
    record, old = await keys.create("k", rpm_limit=5)
    rotated, new = await keys.rotate(record.id, grace_seconds=120)
    assert new != old and rotated.key_prefix == new[:12] and rotated.rpm_limit == 5
    now = datetime.now(UTC)
    assert rotated.previous_valid_until is not None
    assert now + timedelta(seconds=100) < rotated.previous_valid_until
    assert rotated.previous_valid_until <= now + timedelta(seconds=121)

    current = await keys.find_by_digest(digest_key(new))
    assert current is not None and current[1] is None
    previous = await keys.find_by_digest(digest_key(old))
    assert previous is not None and previous[0].id == record.id
    assert previous[1] == rotated.previous_valid_until

    # Rotating again ends the oldest secret's grace immediately; grace 0 drops it at once.
    _, newest = await keys.rotate(record.id, grace_seconds=0)
    assert await keys.find_by_digest(digest_key(old)) is None
    assert await keys.find_by_digest(digest_key(new)) is None
    assert await keys.find_by_digest(digest_key(newest)) is not None
    with pytest.raises(ValueError, match="grace_seconds"):
        await keys.rotate(record.id, grace_seconds=-1)


async def test_expiry(db: Database) -> None:
    keys = KeyService(db)
    past = datetime.now(UTC) - timedelta(seconds=1)
    record, _ = await keys.create("k", expires_at=past)
    assert not record.is_active(datetime.now(UTC))
    naive_future = datetime.now(UTC).replace(tzinfo=None) + timedelta(hours=1)
    updated = await keys.update(record.id, expires_at=naive_future)
    assert updated.expires_at == naive_future.replace(tzinfo=UTC)  # naive = UTC
    assert updated.is_active(datetime.now(UTC))


async def test_ensure_bootstrap_creates_exactly_one_key(db: Database) -> None:
    keys = KeyService(db)
    plaintext = await keys.ensure_bootstrap()
    assert plaintext is not None and plaintext.startswith("tsr-")
    assert await keys.ensure_bootstrap() is None
    listed = await keys.list()
    assert len(listed) == 1 and listed[0].name == "default"
    assert listed[0].key_prefix == plaintext[:12]

"""API keys: issue, list, change, rotate, revoke (and usage reads for the admin API).

Interface:

    keys = KeyService(db)
    record, plaintext = await keys.create("name", rpm_limit=60, ...)  # plaintext shown once
    await keys.list(include_revoked=True) -> list[KeyRecord]
    await keys.get(key_id) -> KeyRecord | None
    await keys.update(key_id, **changes) -> KeyRecord       # None in a change = unlimited
    await keys.revoke(key_id) -> KeyRecord                  # idempotent
    await keys.rotate(key_id, grace_seconds=3600) -> (KeyRecord, plaintext)
    await keys.find_by_digest(digest) -> (KeyRecord, grace_until | None) | None
    await keys.list(tenant_id=...)                          # the keys of one tenant
    await keys.usage(key_id=, since=, until=, group_by="day"|"hour") -> list[UsageBucket]
    await keys.ensure_bootstrap(name="default") -> plaintext | None   # first key, once

Mutators raise KeyNotFound for an unknown id and ValueError (a message a user can act on)
for bad input. A key is `tsr-` + secrets.token_urlsafe(32) (43 url-safe characters, 256
bits); the database keeps only its SHA-256 hex digest and a 12-character display prefix.
Rotation moves the current digest to `previous_digest`, valid until `grace_seconds` from
now; rotating again inside the grace period ends the older secret's grace at once.
Every key belongs to a tenant (api/tenants/service.py): `tenant_id` on create puts it in an
existing one, else it gets a tenant of its own (same id as the key). Records carry their
tenant (`record.tenant`), which is what authentication needs.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from api.db.models import ApiKey, Tenant, utcnow
from api.db.session import Database
from api.keys.fields import (
    BUDGET_PERIODS,
    KEY_FIELDS,
    Limits,
    limits_of,
    validate_fields,
    validate_name,
)
from api.tenants.service import (
    TenantRecord,
    insert_tenant,
    own_tenant_name,
    tenant_record,
    tenant_row,
)
from api.usage.service import GROUP_BY, UsageBucket, aggregate_usage

KEY_PREFIX = "tsr-"
DISPLAY_PREFIX_LEN = len(KEY_PREFIX) + 8
DEFAULT_ROTATE_GRACE = 3600
MAX_ROTATE_GRACE = 30 * 86400


class KeyNotFound(LookupError):
    def __init__(self, key_id: str) -> None:
        super().__init__(f"no API key with id {key_id!r}")
        self.key_id = key_id


@dataclass(slots=True, frozen=True)
class KeyRecord(Limits):
    """A key as the rest of the app sees it: everything but the digests (its limits are
    Limits' fields, keyword-only)."""

    id: str
    name: str
    key_prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    allowed_models: tuple[str, ...] | None
    priority: int
    metadata: dict[str, Any]
    previous_valid_until: datetime | None
    tenant_id: str = ""
    tenant: TenantRecord | None = None

    def is_active(self, now: datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def _record(row: ApiKey, now: datetime, tenant: Tenant | None = None) -> KeyRecord:
    return KeyRecord(
        **limits_of(row, now),
        id=row.id,
        name=row.name,
        key_prefix=row.key_prefix,
        created_at=row.created_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
        allowed_models=tuple(row.allowed_models) if row.allowed_models is not None else None,
        priority=row.priority,
        metadata=dict(row.metadata_ or {}),
        previous_valid_until=row.previous_valid_until,
        tenant_id=row.tenant_id,
        tenant=tenant_record(tenant, now) if tenant is not None else None,
    )


def _column_values(fields: dict[str, Any]) -> dict[str, Any]:
    """Public field names -> ApiKey attribute names."""
    return {("metadata_" if k == "metadata" else k): v for k, v in fields.items()}


class KeyService:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, name: str, **settings: Any) -> tuple[KeyRecord, str]:
        fields = {**KEY_FIELDS, **validate_fields({"name": name, **settings})}
        async with self.db.session(write=True) as session:
            record, plaintext = await self._insert(session, fields)
            await session.commit()
        return record, plaintext

    async def _insert(self, session: AsyncSession, fields: dict[str, Any]) -> tuple[KeyRecord, str]:
        now = utcnow()
        plaintext = generate_key()
        key_id = uuid.uuid4().hex
        fields = dict(fields)
        tenant_id = fields.pop("tenant_id", None)
        if tenant_id is None:
            tenant = await insert_tenant(
                session, own_tenant_name(fields["name"], key_id), {}, tenant_id=key_id
            )
        else:
            tenant = await tenant_row(session, tenant_id)
            if tenant.disabled_at is not None:
                raise ValueError(f"tenant {tenant_id!r} is disabled")
        row = ApiKey(
            id=key_id,
            tenant_id=tenant.id,
            key_digest=digest_key(plaintext),
            key_prefix=plaintext[:DISPLAY_PREFIX_LEN],
            created_at=now,
            budget_used=0,
            **_column_values(fields),
        )
        session.add(row)
        await session.flush()
        return _record(row, now, tenant), plaintext

    async def list(
        self, *, include_revoked: bool = True, tenant_id: str | None = None
    ) -> list[KeyRecord]:
        query = (
            select(ApiKey, Tenant)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .order_by(ApiKey.created_at, ApiKey.id)
        )
        if not include_revoked:
            query = query.where(ApiKey.revoked_at.is_(None))
        if tenant_id is not None:
            query = query.where(ApiKey.tenant_id == tenant_id)
        async with self.db.session() as session:
            rows = (await session.execute(query)).all()
        now = utcnow()
        return [_record(row, now, tenant) for row, tenant in rows]

    async def get(self, key_id: str) -> KeyRecord | None:
        async with self.db.session() as session:
            row = await session.get(ApiKey, key_id)
            tenant = await session.get(Tenant, row.tenant_id) if row is not None else None
        return _record(row, utcnow(), tenant) if row is not None else None

    async def update(self, key_id: str, **changes: Any) -> KeyRecord:
        fields = validate_fields(changes)
        async with self.db.session(write=True) as session:
            row = await self._row(session, key_id)
            if "tenant_id" in fields:
                if fields["tenant_id"] is None:
                    raise ValueError("tenant_id cannot be null: every key belongs to a tenant")
                await tenant_row(session, fields["tenant_id"])
            for attr, value in _column_values(fields).items():
                setattr(row, attr, value)
            await session.commit()
            tenant = await session.get(Tenant, row.tenant_id)
        return _record(row, utcnow(), tenant)

    async def revoke(self, key_id: str) -> KeyRecord:
        async with self.db.session(write=True) as session:
            row = await self._row(session, key_id)
            if row.revoked_at is None:
                row.revoked_at = utcnow()
            await session.commit()
        return _record(row, utcnow())

    async def rotate(
        self, key_id: str, *, grace_seconds: float = DEFAULT_ROTATE_GRACE
    ) -> tuple[KeyRecord, str]:
        if (
            isinstance(grace_seconds, bool)
            or not isinstance(grace_seconds, int | float)
            or not math.isfinite(grace_seconds)
            or not 0 <= grace_seconds <= MAX_ROTATE_GRACE
        ):
            raise ValueError(f"grace_seconds must be between 0 and {MAX_ROTATE_GRACE}")
        async with self.db.session(write=True) as session:
            row = await self._row(session, key_id)
            if row.revoked_at is not None:
                raise ValueError("a revoked key cannot be rotated; create a new key instead")
            now = utcnow()
            plaintext = generate_key()
            if grace_seconds > 0:
                row.previous_digest = row.key_digest
                row.previous_valid_until = now + timedelta(seconds=grace_seconds)
            else:
                row.previous_digest = None
                row.previous_valid_until = None
            row.key_digest = digest_key(plaintext)
            row.key_prefix = plaintext[:DISPLAY_PREFIX_LEN]
            await session.commit()
        return _record(row, now), plaintext

    async def find_by_digest(self, digest: str) -> tuple[KeyRecord, datetime | None] | None:
        """The key whose current or pre-rotation secret has this digest.

        The second element is None for the current secret, else the end of its grace period
        (the caller decides whether that is still in the future).
        """
        query = (
            select(ApiKey, Tenant)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where((ApiKey.key_digest == digest) | (ApiKey.previous_digest == digest))
        )
        async with self.db.session() as session:
            found = (await session.execute(query.limit(1))).first()
        if found is None:
            return None
        row, tenant = found
        grace = None if row.key_digest == digest else row.previous_valid_until
        if row.key_digest != digest and grace is None:
            return None
        return _record(row, utcnow(), tenant), grace

    async def usage(
        self,
        *,
        key_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        group_by: str = "day",
        tenant_id: str | None = None,
    ) -> list[UsageBucket]:
        """Requests and tokens per key and per day/hour (UTC); see usage.aggregate_usage."""
        return await aggregate_usage(
            self.db, key_id=key_id, since=since, until=until, group_by=group_by,
            tenant_id=tenant_id,
        )  # fmt: skip

    async def ensure_bootstrap(self, name: str = "default") -> str | None:
        """Create the first API key if there is none; its plaintext, or None."""
        async with self.db.session(write=True) as session:
            if not self.db.is_sqlite:
                # Replicas starting together must not each create a "first" key.
                await session.execute(select(func.pg_advisory_xact_lock(0x7E55E8A)))
            if await session.scalar(select(func.count()).select_from(ApiKey)):
                return None
            fields = {**KEY_FIELDS, "name": validate_name(name)}
            _, plaintext = await self._insert(session, fields)
            await session.commit()
        return plaintext

    async def _row(self, session: AsyncSession, key_id: str) -> ApiKey:
        row = await session.get(ApiKey, key_id)
        if row is None:
            raise KeyNotFound(key_id)
        return row


__all__ = [
    "BUDGET_PERIODS",
    "GROUP_BY",
    "KeyNotFound",
    "KeyRecord",
    "KeyService",
    "UsageBucket",
    "digest_key",
    "generate_key",
]

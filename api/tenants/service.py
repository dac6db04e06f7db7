"""Tenants (teams): create, list, change, disable; every API key belongs to one.

Interface:

    tenants = TenantService(db)
    record = await tenants.create("team-a", weight=2.0, token_budget=10**6, ...)
    await tenants.list(include_disabled=True) -> list[TenantRecord]
    await tenants.get(tenant_id) -> TenantRecord | None
    await tenants.update(tenant_id, **changes) -> TenantRecord   # None = unlimited;
                                                                # disabled=True/False
    await tenants.disable(tenant_id) -> TenantRecord             # idempotent (DELETE)

A tenant's weight is its share of the engine's fair scheduler; its limits (budget, rpm, tpm,
parallel) apply to the sum of its keys' requests on top of each key's own (the tighter
wins; api/quotas/service.py); its prefix-cache scope says whether its keys share cached
prompt blocks (`tenant`) or each key's hash apart (`key`, the default): never across
tenants. A disabled tenant's keys are refused (401). Tenants are never deleted, so the
usage ledger keeps naming them. Mutators raise TenantNotFound for an unknown id and
ValueError for bad input (a name in use included).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from api.db.models import ApiKey, Tenant, utcnow
from api.db.session import Database
from api.keys.fields import TENANT_FIELDS, Limits, limits_of, validate_tenant_fields


class TenantNotFound(LookupError):
    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"no tenant with id {tenant_id!r}")
        self.tenant_id = tenant_id


@dataclass(slots=True, frozen=True)
class TenantRecord(Limits):
    """A tenant; its limits are Limits' fields (keyword-only), its `budget_used` the reserved +
    used tokens of all its keys in the current period."""

    id: str
    name: str
    weight: float
    prefix_cache_scope: str
    created_at: datetime
    disabled_at: datetime | None
    keys: int = 0  # its keys, revoked ones included (list/get only)


def tenant_record(row: Tenant, now: datetime, keys: int = 0) -> TenantRecord:
    return TenantRecord(
        **limits_of(row, now),
        id=row.id,
        name=row.name,
        weight=row.weight,
        prefix_cache_scope=row.prefix_cache_scope,
        created_at=row.created_at,
        disabled_at=row.disabled_at,
        keys=keys,
    )


def own_tenant_name(key_name: str, key_id: str) -> str:
    """The name of the tenant a key gets when created without one (as migration 0002)."""
    return f"{key_name[:190]}-{key_id[:8]}"


async def insert_tenant(
    session: AsyncSession, name: str, fields: dict[str, Any], tenant_id: str | None = None
) -> Tenant:
    """Add a tenant row in `session` (flushed); ValueError if the name is taken."""
    if await session.scalar(select(Tenant.id).where(Tenant.name == name)):
        raise ValueError(f"a tenant named {name!r} already exists")
    fields = dict(fields)
    disabled = fields.pop("disabled", False)
    row = Tenant(
        id=tenant_id or uuid.uuid4().hex,
        name=name,
        budget_used=0,
        created_at=utcnow(),
        disabled_at=utcnow() if disabled else None,
        **{**TENANT_FIELDS, **fields},
    )
    session.add(row)
    await session.flush()
    return row


class TenantService:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, name: str, **settings: Any) -> TenantRecord:
        fields = validate_tenant_fields({"name": name, **settings})
        name = fields.pop("name")
        async with self.db.session(write=True) as session:
            row = await insert_tenant(session, name, fields)
            await session.commit()
        return tenant_record(row, utcnow())

    async def list(self, *, include_disabled: bool = True) -> list[TenantRecord]:
        counts = (
            select(ApiKey.tenant_id, func.count().label("n")).group_by(ApiKey.tenant_id).subquery()
        )
        query = (
            select(Tenant, func.coalesce(counts.c.n, 0))
            .outerjoin(counts, counts.c.tenant_id == Tenant.id)
            .order_by(Tenant.created_at, Tenant.id)
        )
        if not include_disabled:
            query = query.where(Tenant.disabled_at.is_(None))
        async with self.db.session() as session:
            rows = (await session.execute(query)).all()
        now = utcnow()
        return [tenant_record(row, now, int(n)) for row, n in rows]

    async def get(self, tenant_id: str) -> TenantRecord | None:
        async with self.db.session() as session:
            row = await session.get(Tenant, tenant_id)
            if row is None:
                return None
            n = await session.scalar(
                select(func.count()).select_from(ApiKey).where(ApiKey.tenant_id == tenant_id)
            )
        return tenant_record(row, utcnow(), int(n or 0))

    async def update(self, tenant_id: str, **changes: Any) -> TenantRecord:
        fields = validate_tenant_fields(changes)
        async with self.db.session(write=True) as session:
            row = await tenant_row(session, tenant_id)
            name = fields.pop("name", None)
            if name is not None and name != row.name:
                if await session.scalar(select(Tenant.id).where(Tenant.name == name)):
                    raise ValueError(f"a tenant named {name!r} already exists")
                row.name = name
            if "disabled" in fields:
                disabled = fields.pop("disabled")
                if not disabled:
                    row.disabled_at = None
                elif row.disabled_at is None:
                    row.disabled_at = utcnow()
            for attr, value in fields.items():
                setattr(row, attr, value)
            await session.commit()
        return await self._get(tenant_id)

    async def disable(self, tenant_id: str) -> TenantRecord:
        return await self.update(tenant_id, disabled=True)

    async def _get(self, tenant_id: str) -> TenantRecord:
        record = await self.get(tenant_id)
        if record is None:
            raise TenantNotFound(tenant_id)
        return record


async def tenant_row(session: AsyncSession, tenant_id: str) -> Tenant:
    """The tenant's row in `session`; TenantNotFound if there is none."""
    row = await session.get(Tenant, tenant_id)
    if row is None:
        raise TenantNotFound(tenant_id)
    return row


__all__ = [
    "TenantNotFound",
    "TenantRecord",
    "TenantService",
    "own_tenant_name",
    "tenant_record",
    "tenant_row",
]

"""SQLAlchemy 2.0 models: API keys, quota leases and the usage ledger.

Tables (the limits both tenants and keys have are LimitColumns, written once)
    tenants         one row per tenant (team): its scheduling weight, prefix-cache scope,
                    maximum request duration and its own budget / rpm / tpm / parallel
                    limits, counted like a key's (`budget_used`, `budget_period_start`).
                    Every key belongs to exactly one tenant; a key created without one
                    gets a tenant of its own (same id as the key).
    api_keys        one row per issued key. Only the SHA-256 hex digest of the secret and a
                    short display prefix are stored, never the secret. `previous_digest`
                    keeps the pre-rotation secret valid until `previous_valid_until`.
                    `budget_used` / `budget_period_start` hold the running token reservation
                    of the current budget period (updated by one conditional UPDATE).
    quota_leases    one row per admitted request of a key with rpm/tpm/parallel limits: the
                    sliding rate windows count rows by `created_at`; the parallel slot is
                    held while `released_at IS NULL AND expires_at > now`, so a process that
                    dies cannot leak it past the lease TTL. Times are epoch seconds (float)
                    so window arithmetic is identical on SQLite and Postgres.
                    `tenant_id` is set when the key's tenant has limits (its windows count
                    the rows of all its keys).
    usage_records   the append-only ledger, one row per request, with the tenant it was
                    charged to, the client's X-Request-Id and the LoRA adapter it ran.
    lora_adapters   the LoRA adapters loaded at run time through the admin API (api/lora/):
                    name, PEFT folder, owner tenant (NULL: public); loaded again at start.
    stored_responses  /v1/responses answers kept for GET, DELETE and previous_response_id
                    (api/openai/responses/store.py): the response body, the conversation
                    before it, and its owner (the key's tenant; see `owner`).

Any change here needs a migration in migrations/versions (the test suite fails on drift).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Double, ForeignKey, Index, Integer, MetaData, String
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import DateTime, TypeDecorator

# Deterministic constraint names: SQLite batch migrations need named constraints.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only aliases the rowid for INTEGER PRIMARY KEY, not BIGINT.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    Postgres stores timestamptz; SQLite has no time zones, so values are stored as naive UTC
    (lexicographic order == time order) and read back as aware UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class LimitColumns:
    """The columns of the limits a tenant and a key both have (api/keys/fields.py LIMIT_FIELDS)
    and of the running token count of the budget period (api/quotas/service.py)."""

    rpm_limit: Mapped[int | None] = mapped_column(Integer())
    tpm_limit: Mapped[int | None] = mapped_column(BigInteger())
    max_parallel: Mapped[int | None] = mapped_column(Integer())
    token_budget: Mapped[int | None] = mapped_column(BigInteger())
    budget_period: Mapped[str] = mapped_column(String(8), default="total")
    budget_used: Mapped[int] = mapped_column(BigInteger(), default=0)
    budget_period_start: Mapped[float | None] = mapped_column(Double())
    max_request_seconds: Mapped[float | None] = mapped_column(Double())


class Tenant(LimitColumns, Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    weight: Mapped[float] = mapped_column(Double(), default=1.0)
    # "key": each key's prompts hash apart; "tenant": the tenant's keys share cached blocks.
    prefix_cache_scope: Mapped[str] = mapped_column(String(8), default="key")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    disabled_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class ApiKey(LimitColumns, Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    key_digest: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(16))
    previous_digest: Mapped[str | None] = mapped_column(String(64), index=True)
    previous_valid_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON())
    priority: Mapped[int] = mapped_column(Integer(), default=0)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    # `metadata` is reserved on declarative classes; the column keeps the public name.
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON())


class QuotaLease(Base):
    __tablename__ = "quota_leases"
    __table_args__ = (
        Index("ix_quota_leases_key_id_created_at", "key_id", "created_at"),
        Index("ix_quota_leases_tenant_id_created_at", "tenant_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    tenant_id: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[float] = mapped_column(Double())
    expires_at: Mapped[float] = mapped_column(Double())
    reserved_tokens: Mapped[int] = mapped_column(BigInteger())
    used_tokens: Mapped[int | None] = mapped_column(BigInteger())
    released_at: Mapped[float | None] = mapped_column(Double())


class UsageRow(Base):
    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_key_id_created_at", "key_id", "created_at"),
        Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128), index=True)
    # The client's X-Request-Id (or the one the server generated): logs and traces carry it.
    x_request_id: Mapped[str | None] = mapped_column(String(128), index=True)
    # The request body's `user` (OpenAI's end-user id), as the client sent it.
    end_user: Mapped[str | None] = mapped_column(String(256))
    # No foreign key: the ledger outlives keys and also records static/none-mode traffic.
    key_id: Mapped[str | None] = mapped_column(String(32))
    tenant_id: Mapped[str | None] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer())
    completion_tokens: Mapped[int] = mapped_column(Integer())
    cached_tokens: Mapped[int] = mapped_column(Integer())
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    status_code: Mapped[int] = mapped_column(Integer())
    queue_time: Mapped[float | None] = mapped_column(Double())
    latency: Mapped[float | None] = mapped_column(Double())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    # The LoRA adapter the request ran (its name; `model` is what the client asked for).
    lora_adapter: Mapped[str | None] = mapped_column(String(200))


class LoRAAdapterRow(Base):
    __tablename__ = "lora_adapters"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    path: Mapped[str] = mapped_column(String(4096))
    # The owner: only its keys may call the adapter; NULL: every key (public).
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


def utcnow() -> datetime:
    return datetime.now(UTC)


class StoredResponse(Base):
    __tablename__ = "stored_responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # resp_...
    # Who may read, continue and delete it: "tenant:<id>" (every key of the tenant), or for
    # keys without a tenant row (static --api-key, auth none, the admin token) "principal:<name>".
    owner: Mapped[str] = mapped_column(String(250), index=True)
    key_id: Mapped[str | None] = mapped_column(String(32))  # the key that created it
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    # The conversation's items before this response's output (instructions excluded, as
    # OpenAI does: a later request gives its own), as Responses input items.
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSON())
    response: Mapped[dict[str, Any]] = mapped_column(JSON())  # the response object as sent

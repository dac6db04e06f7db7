"""Initial schema: api_keys, quota_leases, usage_records.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("key_digest", sa.String(length=64), nullable=False),
        sa.Column("key_prefix", sa.String(length=16), nullable=False),
        sa.Column("previous_digest", sa.String(length=64), nullable=True),
        sa.Column("previous_valid_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("allowed_models", sa.JSON(), nullable=True),
        sa.Column("rpm_limit", sa.Integer(), nullable=True),
        sa.Column("tpm_limit", sa.BigInteger(), nullable=True),
        sa.Column("max_parallel", sa.Integer(), nullable=True),
        sa.Column("token_budget", sa.BigInteger(), nullable=True),
        sa.Column("budget_period", sa.String(length=8), nullable=False),
        sa.Column("budget_used", sa.BigInteger(), nullable=False),
        sa.Column("budget_period_start", sa.Double(), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_digest", name=op.f("uq_api_keys_key_digest")),
    )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_api_keys_previous_digest"), ["previous_digest"], unique=False
        )

    op.create_table(
        "usage_records",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("queue_time", sa.Double(), nullable=True),
        sa.Column("latency", sa.Double(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_records")),
    )
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_usage_records_created_at"), ["created_at"], unique=False
        )
        batch_op.create_index(
            "ix_usage_records_key_id_created_at", ["key_id", "created_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_usage_records_request_id"), ["request_id"], unique=False
        )

    op.create_table(
        "quota_leases",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("reserved_tokens", sa.BigInteger(), nullable=False),
        sa.Column("used_tokens", sa.BigInteger(), nullable=True),
        sa.Column("released_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["key_id"],
            ["api_keys.id"],
            name=op.f("fk_quota_leases_key_id_api_keys"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quota_leases")),
    )
    with op.batch_alter_table("quota_leases", schema=None) as batch_op:
        batch_op.create_index(
            "ix_quota_leases_key_id_created_at", ["key_id", "created_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("quota_leases", schema=None) as batch_op:
        batch_op.drop_index("ix_quota_leases_key_id_created_at")

    op.drop_table("quota_leases")
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_usage_records_request_id"))
        batch_op.drop_index("ix_usage_records_key_id_created_at")
        batch_op.drop_index(batch_op.f("ix_usage_records_created_at"))

    op.drop_table("usage_records")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_keys_previous_digest"))

    op.drop_table("api_keys")

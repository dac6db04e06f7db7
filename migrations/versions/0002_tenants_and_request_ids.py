"""Tenants (every existing key in a tenant of its own), per-key/tenant request durations,
tenant ids on quota leases and usage rows, and the client's X-Request-Id and `user` on usage
rows.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("weight", sa.Double(), nullable=False),
        sa.Column("rpm_limit", sa.Integer(), nullable=True),
        sa.Column("tpm_limit", sa.BigInteger(), nullable=True),
        sa.Column("max_parallel", sa.Integer(), nullable=True),
        sa.Column("token_budget", sa.BigInteger(), nullable=True),
        sa.Column("budget_period", sa.String(length=8), nullable=False),
        sa.Column("budget_used", sa.BigInteger(), nullable=False),
        sa.Column("budget_period_start", sa.Double(), nullable=True),
        sa.Column("prefix_cache_scope", sa.String(length=8), nullable=False),
        sa.Column("max_request_seconds", sa.Double(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("max_request_seconds", sa.Double(), nullable=True))

    # Each existing key becomes the only key of a tenant with the key's id, unlimited (the
    # key keeps its own limits), so nothing about how existing keys are served changes.
    op.execute(
        """
        INSERT INTO tenants (id, name, weight, budget_period, budget_used,
            prefix_cache_scope, created_at)
        SELECT id, substr(name, 1, 190) || '-' || substr(id, 1, 8), 1.0, 'total', 0, 'key', created_at
        FROM api_keys
        """
    )
    op.execute("UPDATE api_keys SET tenant_id = id")

    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.alter_column("tenant_id", existing_type=sa.String(length=32), nullable=False)
        batch_op.create_index(batch_op.f("ix_api_keys_tenant_id"), ["tenant_id"], unique=False)
        batch_op.create_foreign_key(
            batch_op.f("fk_api_keys_tenant_id_tenants"), "tenants", ["tenant_id"], ["id"]
        )

    with op.batch_alter_table("quota_leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant_id", sa.String(length=32), nullable=True))
        batch_op.create_index(
            "ix_quota_leases_tenant_id_created_at", ["tenant_id", "created_at"], unique=False
        )

    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("x_request_id", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("end_user", sa.String(length=256), nullable=True))
        batch_op.create_index(
            "ix_usage_records_tenant_id_created_at", ["tenant_id", "created_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_usage_records_x_request_id"), ["x_request_id"], unique=False
        )
    # Existing usage rows were charged to the keys' tenants (which share the keys' ids).
    op.execute(
        "UPDATE usage_records SET tenant_id = key_id WHERE key_id IN (SELECT id FROM api_keys)"
    )


def downgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_usage_records_x_request_id"))
        batch_op.drop_index("ix_usage_records_tenant_id_created_at")
        batch_op.drop_column("end_user")
        batch_op.drop_column("x_request_id")
        batch_op.drop_column("tenant_id")
    with op.batch_alter_table("quota_leases", schema=None) as batch_op:
        batch_op.drop_index("ix_quota_leases_tenant_id_created_at")
        batch_op.drop_column("tenant_id")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_api_keys_tenant_id_tenants"), type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_api_keys_tenant_id"))
        batch_op.drop_column("max_request_seconds")
        batch_op.drop_column("tenant_id")
    op.drop_table("tenants")

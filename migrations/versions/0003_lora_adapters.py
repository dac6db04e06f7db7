"""LoRA adapters loaded at run time (name, folder, owner tenant) and the adapter a usage row
ran.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("path", sa.String(length=4096), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_lora_adapters_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_lora_adapters")),
    )
    with op.batch_alter_table("lora_adapters", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_lora_adapters_tenant_id"), ["tenant_id"], unique=False)
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lora_adapter", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.drop_column("lora_adapter")
    with op.batch_alter_table("lora_adapters", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_lora_adapters_tenant_id"))
    op.drop_table("lora_adapters")

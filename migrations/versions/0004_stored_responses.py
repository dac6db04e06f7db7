"""Stored /v1/responses answers (store: true): the body, the conversation before it, owner.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=250), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stored_responses")),
    )
    with op.batch_alter_table("stored_responses", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_stored_responses_created_at"), ["created_at"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_stored_responses_owner"), ["owner"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("stored_responses", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_stored_responses_owner"))
        batch_op.drop_index(batch_op.f("ix_stored_responses_created_at"))
    op.drop_table("stored_responses")

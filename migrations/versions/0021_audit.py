"""The audit trail (docs/audit.md): one row per change made through the API, never updated
or deleted by the service.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-03 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("actor_name", sa.String(length=200), nullable=True),
        sa.Column("actor_token_id", sa.String(length=32), nullable=True),
        sa.Column("actor_token_name", sa.String(length=200), nullable=True),
        sa.Column("actor_role", sa.String(length=16), nullable=True),
        sa.Column("via", sa.String(length=16), nullable=False),
        sa.Column("source", sa.String(length=100), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target_kind", sa.String(length=32), nullable=True),
        sa.Column("target_id", sa.String(length=300), nullable=True),
        sa.Column("outcome", sa.Integer(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.create_index("ix_audit_events_at", ["at"], unique=False)
        batch_op.create_index("ix_audit_events_action", ["action"], unique=False)
        batch_op.create_index("ix_audit_events_actor_name", ["actor_name"], unique=False)


def downgrade() -> None:
    op.drop_table("audit_events")

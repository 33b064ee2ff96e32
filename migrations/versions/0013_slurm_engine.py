"""Engines (docs/slurm.md): which engine runs an attempt and its job there, the engine of each node,
and launch tokens scoped to one attempt.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25 17:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("engine", sa.String(length=16), server_default="agents", nullable=False)
        )
        batch_op.add_column(sa.Column("engine_job_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("engine_state", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("engine_reason", sa.Text(), nullable=True))
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("engine", sa.String(length=16), server_default="agents", nullable=False)
        )
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("attempt_id", sa.String(length=32), nullable=True))
        batch_op.create_index("ix_tokens_attempt_id", ["attempt_id"], unique=False)
    op.create_index(
        "ix_attempts_engine_open",
        "attempts",
        ["engine"],
        unique=False,
        sqlite_where=sa.text("engine <> 'agents' AND engine_state IS NULL"),
        postgresql_where=sa.text("engine <> 'agents' AND engine_state IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_attempts_engine_open", table_name="attempts")
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.drop_index("ix_tokens_attempt_id")
        batch_op.drop_column("attempt_id")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("engine")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("engine_reason")
        batch_op.drop_column("engine_state")
        batch_op.drop_column("engine_job_id")
        batch_op.drop_column("engine")

"""Teams' use of their quotas over time (docs/teams.md): one row per team, pool and minute,
written by the upkeep and kept for a week.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-02 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "team_usage",
        sa.Column("team_id", sa.String(length=32), nullable=False),
        sa.Column("pool", sa.String(length=100), nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("used", sa.Integer(), nullable=False),
        sa.Column("nominal", sa.Integer(), nullable=False),
        sa.Column("borrowed", sa.Integer(), nullable=False),
        sa.Column("lent", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_team_usage_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("team_id", "pool", "at", name=op.f("pk_team_usage")),
    )
    with op.batch_alter_table("team_usage", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_team_usage_at"), ["at"], unique=False)


def downgrade() -> None:
    op.drop_table("team_usage")

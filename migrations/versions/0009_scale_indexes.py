"""Indexes for a long queue and many nodes: the queue in the scheduler's order, the job
lists' cursors, placements not done, attempts by rendezvous address.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 14:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_QUEUED = sa.text("status = 'queued'")
_OPEN = sa.text("status <> 'done'")


def upgrade() -> None:
    op.create_index(
        "ix_jobs_queue",
        "jobs",
        [sa.text("priority DESC"), "created_at", "id"],
        sqlite_where=_QUEUED,
        postgresql_where=_QUEUED,
    )
    op.create_index("ix_jobs_created_id", "jobs", ["created_at", "id"])
    op.create_index("ix_jobs_owner_created_id", "jobs", ["owner_id", "created_at", "id"])
    op.create_index("ix_jobs_status_created_id", "jobs", ["status", "created_at", "id"])
    op.create_index(
        "ix_placements_open",
        "placements",
        ["node_id", "lease_expires_at"],
        sqlite_where=_OPEN,
        postgresql_where=_OPEN,
    )
    op.create_index("ix_attempts_master_addr", "attempts", ["master_addr"])


def downgrade() -> None:
    op.drop_index("ix_attempts_master_addr", table_name="attempts")
    op.drop_index("ix_placements_open", table_name="placements")
    op.drop_index("ix_jobs_status_created_id", table_name="jobs")
    op.drop_index("ix_jobs_owner_created_id", table_name="jobs")
    op.drop_index("ix_jobs_created_id", table_name="jobs")
    op.drop_index("ix_jobs_queue", table_name="jobs")

"""Restarts, preemption and drain: a job counts its restarts and why it was requeued, an
attempt may be preempted, a node may be draining or drained, and each metric point
records its attempt number.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 02:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NODE_STATUS_OLD = "status IN ('lost', 'ready')"
_NODE_STATUS_NEW = "status IN ('drained', 'draining', 'lost', 'ready')"
_ATTEMPT_STATUS_OLD = "status IN ('cancelled', 'failed', 'running', 'scheduled', 'succeeded')"
_ATTEMPT_STATUS_NEW = "status IN ('cancelled', 'failed', 'preempted', 'running', 'scheduled', 'succeeded')"


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("restarts", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("requeue_reason", sa.Text(), nullable=True))
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("drained_by", sa.String(length=16), nullable=True))
        batch_op.drop_constraint(op.f("ck_nodes_status"), type_="check")
        batch_op.create_check_constraint(op.f("ck_nodes_status"), _NODE_STATUS_NEW)
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preempt_requested_at", UTCDateTime(), nullable=True))
        batch_op.drop_constraint(op.f("ck_attempts_status"), type_="check")
        batch_op.create_check_constraint(op.f("ck_attempts_status"), _ATTEMPT_STATUS_NEW)
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.add_column(sa.Column("attempt", sa.Integer(), server_default="1", nullable=False))
        batch_op.create_index(
            "ix_metrics_job_point_attempt",
            ["job_id", "name", "rank", "epoch", "step", "attempt"],
            unique=False,
        )
    op.execute(
        "UPDATE metrics SET attempt = (SELECT attempts.number FROM attempts "
        "WHERE attempts.id = metrics.attempt_id)"
    )


def downgrade() -> None:
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.drop_index("ix_metrics_job_point_attempt")
        batch_op.drop_column("attempt")
    op.execute("UPDATE attempts SET status = 'cancelled' WHERE status = 'preempted'")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_attempts_status"), type_="check")
        batch_op.create_check_constraint(op.f("ck_attempts_status"), _ATTEMPT_STATUS_OLD)
        batch_op.drop_column("preempt_requested_at")
    op.execute("UPDATE nodes SET status = 'ready' WHERE status IN ('draining', 'drained')")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_nodes_status"), type_="check")
        batch_op.create_check_constraint(op.f("ck_nodes_status"), _NODE_STATUS_OLD)
        batch_op.drop_column("drained_by")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("requeue_reason")
        batch_op.drop_column("restarts")

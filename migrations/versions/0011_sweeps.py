"""Sweeps: hyperparameter searches, their trials, and each trial's job.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 14:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("algorithm", sa.String(length=16), nullable=False),
        sa.Column("max_trials", sa.Integer(), nullable=False),
        sa.Column("max_concurrent_trials", sa.Integer(), nullable=False),
        sa.Column("trials_created", sa.Integer(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint(
            "status IN ('cancelled', 'failed', 'running', 'succeeded')", name=op.f("ck_sweeps_status")
        ),
        sa.CheckConstraint(
            "max_concurrent_trials >= 1 AND max_trials >= max_concurrent_trials",
            name=op.f("ck_sweeps_limits"),
        ),
        sa.ForeignKeyConstraint(["owner_id"], ["tokens.id"], name=op.f("fk_sweeps_owner_id_tokens")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweeps")),
    )
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.create_index("ix_sweeps_owner_created", ["owner_id", "created_at"], unique=False)

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sweep_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("trial_number", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("cancel_reason", sa.Text(), nullable=True))
        batch_op.create_index(batch_op.f("ix_jobs_sweep_id"), ["sweep_id"], unique=False)
        batch_op.create_foreign_key(batch_op.f("fk_jobs_sweep_id_sweeps"), "sweeps", ["sweep_id"], ["id"])

    op.create_table(
        "sweep_trials",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("sweep_id", sa.String(length=32), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("epochs", sa.Integer(), nullable=False),
        sa.Column("intermediate", sa.JSON(), nullable=False),
        sa.Column("system_attrs", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint(
            "state IN ('cancelled', 'completed', 'failed', 'pruned', 'queued', 'running')",
            name=op.f("ck_sweep_trials_state"),
        ),
        sa.ForeignKeyConstraint(
            ["sweep_id"], ["sweeps.id"], name=op.f("fk_sweep_trials_sweep_id_sweeps"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_sweep_trials_job_id_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweep_trials")),
        sa.UniqueConstraint("job_id", name=op.f("uq_sweep_trials_job_id")),
        sa.UniqueConstraint("sweep_id", "number", name="uq_sweep_trials_sweep_number"),
    )


def downgrade() -> None:
    op.drop_table("sweep_trials")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_jobs_sweep_id_sweeps"), type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_jobs_sweep_id"))
        batch_op.drop_column("cancel_reason")
        batch_op.drop_column("trial_number")
        batch_op.drop_column("sweep_id")
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.drop_index("ix_sweeps_owner_created")
    op.drop_table("sweeps")

"""Jobs: their metric points, metric names and points dropped past the per-job limits
(TORCHYARD_MAX_METRIC_POINTS_PER_JOB, TORCHYARD_MAX_METRIC_NAMES_PER_JOB), counted on the row.
The counts of the points already stored are filled in.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 15:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("metric_points", sa.BigInteger(), server_default="0", nullable=False))
        batch.add_column(sa.Column("metric_names", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("metrics_dropped", sa.BigInteger(), server_default="0", nullable=False))
    op.execute(
        "UPDATE jobs SET "
        "metric_points = (SELECT count(*) FROM metrics WHERE metrics.job_id = jobs.id), "
        "metric_names = (SELECT count(DISTINCT metrics.name) FROM metrics WHERE metrics.job_id = jobs.id) "
        "WHERE EXISTS (SELECT 1 FROM metrics WHERE metrics.job_id = jobs.id)"
    )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("metrics_dropped")
        batch.drop_column("metric_names")
        batch.drop_column("metric_points")

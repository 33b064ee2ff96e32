"""Metric points: several values at one name, rank, epoch and step (MLflow keeps them all).
Each point has its ``occurrence`` there (0 for the first value, 1 for the next...), and the
key that makes a retried report a no-op includes it. The points already stored are the
first (and only) value at their step: 0.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_KEY = ["job_id", "attempt_id", "name", "rank", "epoch", "step"]


def upgrade() -> None:
    with op.batch_alter_table("metrics") as batch:
        batch.add_column(sa.Column("occurrence", sa.Integer(), server_default="0", nullable=False))
        batch.drop_constraint("uq_metrics_point", type_="unique")
        batch.create_unique_constraint("uq_metrics_point", [*_KEY, "occurrence"])


def downgrade() -> None:
    # Only the first value at each step fits the older key: the later ones go (and their count).
    later = "FROM metrics WHERE metrics.job_id = jobs.id AND metrics.occurrence > 0"
    op.execute(
        f"UPDATE jobs SET metric_points = metric_points - (SELECT count(*) {later}) "
        f"WHERE EXISTS (SELECT 1 {later})"
    )
    op.execute("DELETE FROM metrics WHERE occurrence > 0")
    with op.batch_alter_table("metrics") as batch:
        batch.drop_constraint("uq_metrics_point", type_="unique")
        batch.create_unique_constraint("uq_metrics_point", _KEY)
        batch.drop_column("occurrence")

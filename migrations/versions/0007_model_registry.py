"""The model registry: named, numbered versions of trained model directories.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-12 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "model_versions",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("architecture", sa.String(length=100), nullable=False),
        sa.Column("classes", sa.JSON(), nullable=False),
        sa.Column("image_size", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("has_onnx", sa.Boolean(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("deleted_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint("version >= 1", name=op.f("ck_model_versions_version")),
        sa.ForeignKeyConstraint(["owner_id"], ["tokens.id"], name=op.f("fk_model_versions_owner_id_tokens")),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_model_versions_job_id_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_versions")),
        sa.UniqueConstraint("owner_id", "name", "version", name="uq_model_versions_owner_name_version"),
    )
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.create_index("ix_model_versions_owner_name", ["owner_id", "name"], unique=False)
        batch_op.create_index(batch_op.f("ix_model_versions_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_model_versions_job_id"))
        batch_op.drop_index("ix_model_versions_owner_name")
    op.drop_table("model_versions")

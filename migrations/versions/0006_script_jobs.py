"""Job types and script jobs: a job's type, code packages, a script job's input datasets
and outputs archive; training-only columns become nullable.

Revision ID: 0006
Revises: 0002
Create Date: 2026-12-10 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0006"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "code_packages",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("deleted_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint("files >= 0 AND size_bytes >= 0", name=op.f("ck_code_packages_sizes")),
        sa.ForeignKeyConstraint(["owner_id"], ["tokens.id"], name=op.f("fk_code_packages_owner_id_tokens")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_code_packages")),
    )
    with op.batch_alter_table("code_packages", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_code_packages_owner_id"), ["owner_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_code_packages_sha256"), ["sha256"], unique=False)

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("type", sa.String(length=16), server_default="train", nullable=False))
        batch_op.add_column(sa.Column("code_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("outputs_sha256", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("outputs_size", sa.BigInteger(), nullable=True))
        batch_op.alter_column("architecture", existing_type=sa.String(length=100), nullable=True)
        batch_op.alter_column("train_dataset_id", existing_type=sa.String(length=32), nullable=True)
        batch_op.alter_column("validation_dataset_id", existing_type=sa.String(length=32), nullable=True)
        batch_op.drop_constraint(batch_op.f("ck_jobs_succeeded_has_model"), type_="check")
        batch_op.create_check_constraint(
            batch_op.f("ck_jobs_succeeded_has_model"),
            "type <> 'train' OR status <> 'succeeded' OR model_sha256 IS NOT NULL",
        )
        batch_op.create_check_constraint(
            batch_op.f("ck_jobs_train_fields"),
            "type <> 'train' OR (architecture IS NOT NULL AND train_dataset_id IS NOT NULL "
            "AND validation_dataset_id IS NOT NULL)",
        )
        batch_op.create_check_constraint(
            batch_op.f("ck_jobs_script_fields"), "type <> 'script' OR code_id IS NOT NULL"
        )
        batch_op.create_foreign_key(
            batch_op.f("fk_jobs_code_id_code_packages"), "code_packages", ["code_id"], ["id"]
        )
        batch_op.create_index(batch_op.f("ix_jobs_code_id"), ["code_id"], unique=False)

    op.create_table(
        "job_inputs",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("dataset_id", sa.String(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["dataset_id"], ["datasets.id"], name=op.f("fk_job_inputs_dataset_id_datasets")
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_inputs_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "name", name=op.f("pk_job_inputs")),
    )
    with op.batch_alter_table("job_inputs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_inputs_dataset_id"), ["dataset_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("job_inputs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_job_inputs_dataset_id"))
    op.drop_table("job_inputs")
    # Jobs that are not training jobs have no place in the older schema.
    op.execute("DELETE FROM jobs WHERE type <> 'train'")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_code_id"))
        batch_op.drop_constraint(batch_op.f("fk_jobs_code_id_code_packages"), type_="foreignkey")
        batch_op.drop_constraint(batch_op.f("ck_jobs_script_fields"), type_="check")
        batch_op.drop_constraint(batch_op.f("ck_jobs_train_fields"), type_="check")
        batch_op.drop_constraint(batch_op.f("ck_jobs_succeeded_has_model"), type_="check")
        batch_op.create_check_constraint(
            batch_op.f("ck_jobs_succeeded_has_model"), "status <> 'succeeded' OR model_sha256 IS NOT NULL"
        )
        batch_op.alter_column("validation_dataset_id", existing_type=sa.String(length=32), nullable=False)
        batch_op.alter_column("train_dataset_id", existing_type=sa.String(length=32), nullable=False)
        batch_op.alter_column("architecture", existing_type=sa.String(length=100), nullable=False)
        batch_op.drop_column("outputs_size")
        batch_op.drop_column("outputs_sha256")
        batch_op.drop_column("code_id")
        batch_op.drop_column("type")
    with op.batch_alter_table("code_packages", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_code_packages_sha256"))
        batch_op.drop_index(batch_op.f("ix_code_packages_owner_id"))
    op.drop_table("code_packages")

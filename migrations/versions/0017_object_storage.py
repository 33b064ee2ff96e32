"""Object storage (docs/storage.md): direct uploads in progress, and the object keys of
artifacts stored by direct upload (None: the key of the file layout).

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "object_uploads",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("owner_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("store_upload_id", sa.Text(), nullable=True),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("part_bytes", sa.BigInteger(), nullable=False),
        sa.Column("part_sha256", sa.JSON(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("size_bytes >= 0 AND part_bytes > 0", name=op.f("ck_object_uploads_sizes")),
        sa.ForeignKeyConstraint(["owner_id"], ["tokens.id"], name=op.f("fk_object_uploads_owner_id_tokens")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_object_uploads")),
    )
    with op.batch_alter_table("object_uploads", schema=None) as batch_op:
        batch_op.create_index("ix_object_uploads_lookup", ["kind", "owner_id", "sha256"], unique=False)
        batch_op.create_index("ix_object_uploads_created", ["created_at"], unique=False)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("model_key", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("outputs_key", sa.Text(), nullable=True))
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("archive_key", sa.Text(), nullable=True))
    with op.batch_alter_table("code_packages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("archive_key", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("code_packages", schema=None) as batch_op:
        batch_op.drop_column("archive_key")
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_column("archive_key")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("outputs_key")
        batch_op.drop_column("model_key")
    op.drop_table("object_uploads")

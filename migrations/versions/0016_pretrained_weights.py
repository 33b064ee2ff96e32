"""The weights store: uploaded state dicts that ``pretrained: true`` training jobs start from
(docs/fine-tuning.md); each file is ``<data dir>/weights/<sha256>.pth``.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pretrained_weights",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("architecture", sa.String(length=100), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("uploaded_by", sa.String(length=32), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("size_bytes >= 0", name=op.f("ck_pretrained_weights_size")),
        sa.ForeignKeyConstraint(
            ["uploaded_by"], ["tokens.id"], name=op.f("fk_pretrained_weights_uploaded_by_tokens")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pretrained_weights")),
    )
    with op.batch_alter_table("pretrained_weights", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_pretrained_weights_architecture"), ["architecture"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_pretrained_weights_sha256"), ["sha256"], unique=False)


def downgrade() -> None:
    op.drop_table("pretrained_weights")

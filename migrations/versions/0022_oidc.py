"""Sign-in with the organisation's OpenID provider (docs/oidc.md): users found by the
provider's issuer and subject, and the web UI's server-side sessions.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-03 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.add_column(sa.Column("oidc_issuer", sa.String(length=500), nullable=True))
        batch_op.add_column(sa.Column("oidc_subject", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("email", sa.String(length=320), nullable=True))
        batch_op.add_column(sa.Column("sign_in_token_id", sa.String(length=32), nullable=True))
        batch_op.create_index("ix_users_oidc_identity", ["oidc_issuer", "oidc_subject"], unique=True)
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("id_hash", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("last_seen_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.Column("refresh_token", sa.Text(), nullable=True),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
        sa.UniqueConstraint("id_hash", name=op.f("uq_sessions_id_hash")),
    )
    op.create_index("ix_sessions_user_id", "sessions", ["user_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_sessions_user_id", table_name="sessions")
    op.drop_table("sessions")
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.drop_index("ix_users_oidc_identity")
        batch_op.drop_column("sign_in_token_id")
        batch_op.drop_column("email")
        batch_op.drop_column("oidc_subject")
        batch_op.drop_column("oidc_issuer")

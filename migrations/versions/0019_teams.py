"""Users and teams (docs/teams.md): users own tokens and belong to teams; teams have quotas
per resource pool; jobs, sweeps, datasets, code and model versions belong to a team.

Every existing user or admin token becomes the token of a user of its own (named as the
token; a second token of the same name gets ``<name>-2``...), member of the team
``default``, so that who may see what stays exactly as it was. Worker and launch tokens
have no user.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-01 10:00:00.000000
"""

from collections.abc import Sequence
from datetime import UTC, datetime
from uuid import uuid4

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OWNED = ("jobs", "sweeps", "datasets", "code_packages", "model_versions")


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("disabled_at", UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("name", name=op.f("uq_users_name")),
    )
    op.create_table(
        "teams",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False, server_default="1"),
        sa.Column("preempt_within", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("slurm_account", sa.String(length=100), nullable=True),
        sa.Column("kueue_queue", sa.String(length=100), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("weight > 0", name=op.f("ck_teams_weight")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_teams")),
        sa.UniqueConstraint("name", name=op.f("uq_teams_name")),
    )
    op.create_table(
        "team_members",
        sa.Column("team_id", sa.String(length=32), nullable=False),
        sa.Column("user_id", sa.String(length=32), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False, server_default="0"),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_team_members_team_id_teams"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_team_members_user_id_users"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("team_id", "user_id", name=op.f("pk_team_members")),
    )
    op.create_table(
        "team_quotas",
        sa.Column("team_id", sa.String(length=32), nullable=False),
        sa.Column("pool", sa.String(length=100), nullable=False),
        sa.Column("nominal", sa.Integer(), nullable=False),
        sa.Column("borrowing_limit", sa.Integer(), nullable=True),
        sa.Column("lending_limit", sa.Integer(), nullable=True),
        sa.CheckConstraint(
            "nominal >= 0 AND (borrowing_limit IS NULL OR borrowing_limit >= 0) "
            "AND (lending_limit IS NULL OR lending_limit >= 0)",
            name=op.f("ck_team_quotas_limits"),
        ),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_team_quotas_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("team_id", "pool", name=op.f("pk_team_quotas")),
    )
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("user_id", sa.String(length=32), nullable=True))
        batch_op.create_index("ix_tokens_user_id", ["user_id"], unique=False)
    for table in _OWNED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("team_id", sa.String(length=32), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_team_status", ["team_id", "status"], unique=False)
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preempt_reason", sa.Text(), nullable=True))

    bind = op.get_bind()
    now = datetime.now(UTC)
    team_id = uuid4().hex
    teams = sa.table("teams", sa.column("id"), sa.column("name"), sa.column("created_at"))
    bind.execute(teams.insert().values(id=team_id, name="default", created_at=now))
    users = sa.table("users", sa.column("id"), sa.column("name"), sa.column("admin"), sa.column("created_at"))
    members = sa.table("team_members", sa.column("team_id"), sa.column("user_id"), sa.column("position"))
    tokens = sa.table("tokens", sa.column("id"), sa.column("name"), sa.column("role"), sa.column("user_id"))
    taken: set[str] = set()
    rows = bind.execute(
        sa.text("SELECT id, name, role FROM tokens WHERE role IN ('user', 'admin') ORDER BY created_at, id")
    ).all()
    for token_id, name, role in rows:
        user_name, n = name, 1
        while user_name in taken:
            n += 1
            user_name = f"{name}-{n}"
        taken.add(user_name)
        user_id = uuid4().hex
        bind.execute(users.insert().values(id=user_id, name=user_name, admin=role == "admin", created_at=now))
        bind.execute(members.insert().values(team_id=team_id, user_id=user_id, position=0))
        bind.execute(tokens.update().where(tokens.c.id == token_id).values(user_id=user_id))
    for table in _OWNED:
        bind.execute(sa.text(f"UPDATE {table} SET team_id = :team"), {"team": team_id})


def downgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("preempt_reason")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_team_status")
    for table in _OWNED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("team_id")
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.drop_index("ix_tokens_user_id")
        batch_op.drop_column("user_id")
    op.drop_table("team_quotas")
    op.drop_table("team_members")
    op.drop_table("teams")
    op.drop_table("users")

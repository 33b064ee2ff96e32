"""Initial schema: tokens, datasets, jobs and their history, nodes, attempts, placements, metrics, logs.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 03:09:20.865222
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from service.db.types import UTCDateTime

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint("role IN ('admin', 'user', 'worker')", name=op.f("ck_tokens_role")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_tokens_token_hash")),
    )
    op.create_table(
        "datasets",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("storage_path", sa.Text(), nullable=False),
        sa.Column("classes", sa.JSON(), nullable=False),
        sa.Column("class_counts", sa.JSON(), nullable=False),
        sa.Column("num_images", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("deleted_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint("source IN ('upload', 'path')", name=op.f("ck_datasets_source")),
        sa.CheckConstraint("num_images >= 0", name=op.f("ck_datasets_num_images")),
        sa.ForeignKeyConstraint(["owner_id"], ["tokens.id"], name=op.f("fk_datasets_owner_id_tokens")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_datasets")),
    )
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_datasets_owner_id"), ["owner_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_datasets_sha256"), ["sha256"], unique=False)

    op.create_table(
        "nodes",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("units", sa.Integer(), nullable=False),
        sa.Column("accelerator", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("token_id", sa.String(length=32), nullable=False),
        sa.Column("info", sa.JSON(), nullable=True),
        sa.Column("registered_at", UTCDateTime(), nullable=False),
        sa.Column("last_heartbeat_at", UTCDateTime(), nullable=False),
        sa.CheckConstraint("status IN ('lost', 'ready')", name=op.f("ck_nodes_status")),
        sa.CheckConstraint("units >= 1", name=op.f("ck_nodes_units")),
        sa.ForeignKeyConstraint(["token_id"], ["tokens.id"], name=op.f("fk_nodes_token_id_tokens")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
        sa.UniqueConstraint("name", name=op.f("uq_nodes_name")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("architecture", sa.String(length=100), nullable=False),
        sa.Column("train_dataset_id", sa.String(length=32), nullable=False),
        sa.Column("validation_dataset_id", sa.String(length=32), nullable=False),
        sa.Column("init_from_job_id", sa.String(length=32), nullable=True),
        sa.Column("node_count", sa.Integer(), nullable=False),
        sa.Column("process_count_per_node", sa.Integer(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("wait_reason", sa.Text(), nullable=True),
        sa.Column("progress", sa.JSON(), nullable=True),
        sa.Column("best", sa.JSON(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("failure_code", sa.String(length=64), nullable=True),
        sa.Column("failure_message", sa.Text(), nullable=True),
        sa.Column("failure_rank", sa.Integer(), nullable=True),
        sa.Column("failure_node", sa.String(length=200), nullable=True),
        sa.Column("failure_traceback", sa.Text(), nullable=True),
        sa.Column("model_sha256", sa.String(length=64), nullable=True),
        sa.Column("model_size", sa.BigInteger(), nullable=True),
        sa.Column("attempts_count", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.Column("scheduled_at", UTCDateTime(), nullable=True),
        sa.Column("started_at", UTCDateTime(), nullable=True),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.Column("cancel_requested_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint(
            "(status = 'failed') = (failure_code IS NOT NULL)", name=op.f("ck_jobs_failure_iff_failed")
        ),
        sa.CheckConstraint(
            "(status IN ('cancelled', 'failed', 'succeeded')) = (finished_at IS NOT NULL)",
            name=op.f("ck_jobs_finished_iff_final"),
        ),
        sa.CheckConstraint(
            "status <> 'succeeded' OR model_sha256 IS NOT NULL", name=op.f("ck_jobs_succeeded_has_model")
        ),
        sa.CheckConstraint(
            "status IN ('cancelled', 'cancelling', 'failed', 'queued', 'running', 'scheduled', 'succeeded')",
            name=op.f("ck_jobs_status"),
        ),
        sa.CheckConstraint("node_count >= 1 AND process_count_per_node >= 1", name=op.f("ck_jobs_resources")),
        sa.ForeignKeyConstraint(
            ["init_from_job_id"], ["jobs.id"], name=op.f("fk_jobs_init_from_job_id_jobs")
        ),
        sa.ForeignKeyConstraint(["owner_id"], ["tokens.id"], name=op.f("fk_jobs_owner_id_tokens")),
        sa.ForeignKeyConstraint(
            ["train_dataset_id"], ["datasets.id"], name=op.f("fk_jobs_train_dataset_id_datasets")
        ),
        sa.ForeignKeyConstraint(
            ["validation_dataset_id"], ["datasets.id"], name=op.f("fk_jobs_validation_dataset_id_datasets")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_owner_created", ["owner_id", "created_at"], unique=False)
        batch_op.create_index("ix_jobs_status_priority", ["status", "priority", "created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_train_dataset_id"), ["train_dataset_id"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_jobs_validation_dataset_id"), ["validation_dataset_id"], unique=False
        )

    op.create_table(
        "attempts",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("master_addr", sa.String(length=255), nullable=False),
        sa.Column("master_port", sa.Integer(), nullable=False),
        sa.Column("failure_code", sa.String(length=64), nullable=True),
        sa.Column("failure_message", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=True),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint(
            "status IN ('cancelled', 'failed', 'running', 'scheduled', 'succeeded')",
            name=op.f("ck_attempts_status"),
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_attempts_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),
    )
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_attempts_job_id"), ["job_id"], unique=False)
        batch_op.create_index(
            "uq_attempts_one_live_per_job",
            ["job_id"],
            unique=True,
            sqlite_where=sa.text("status IN ('running', 'scheduled')"),
            postgresql_where=sa.text("status IN ('running', 'scheduled')"),
        )

    op.create_table(
        "job_events",
        sa.Column(
            "seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.CheckConstraint(
            "status IN ('cancelled', 'cancelling', 'failed', 'queued', 'running', 'scheduled', 'succeeded')",
            name=op.f("ck_job_events_status"),
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_events_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_job_events")),
    )
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.create_index("ix_job_events_job_seq", ["job_id", "seq"], unique=False)

    op.create_table(
        "log_chunks",
        sa.Column(
            "seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("attempt_id", sa.String(length=32), nullable=False),
        sa.Column("stream", sa.String(length=210), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_log_chunks_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_log_chunks_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.CheckConstraint("size >= 1", name=op.f("ck_log_chunks_size")),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_log_chunks")),
        sa.UniqueConstraint("job_id", "attempt_id", "stream", "offset", name="uq_log_chunks_offset"),
    )
    with op.batch_alter_table("log_chunks", schema=None) as batch_op:
        batch_op.create_index("ix_log_chunks_job_stream_seq", ["job_id", "stream", "seq"], unique=False)

    op.create_table(
        "metrics",
        sa.Column(
            "seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("attempt_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("time", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_metrics_attempt_id_attempts"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_metrics_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_metrics")),
        sa.UniqueConstraint("job_id", "attempt_id", "name", "rank", "epoch", "step", name="uq_metrics_point"),
    )
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.create_index("ix_metrics_job_name_seq", ["job_id", "name", "seq"], unique=False)
        batch_op.create_index("ix_metrics_job_seq", ["job_id", "seq"], unique=False)

    op.create_table(
        "placements",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("attempt_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("node_id", sa.String(length=32), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("units", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("lease_token", sa.String(length=64), nullable=False),
        sa.Column("lease_expires_at", UTCDateTime(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.CheckConstraint("status IN ('assigned', 'running', 'done')", name=op.f("ck_placements_status")),
        sa.CheckConstraint("units >= 1 AND node_rank >= 0", name=op.f("ck_placements_shape")),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_placements_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_placements_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_placements_node_id_nodes")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_placements")),
        sa.UniqueConstraint("attempt_id", "node_id", name="uq_placements_attempt_node"),
        sa.UniqueConstraint("attempt_id", "node_rank", name="uq_placements_attempt_rank"),
        sa.UniqueConstraint("lease_token", name="uq_placements_lease_token"),
    )
    with op.batch_alter_table("placements", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_placements_job_id"), ["job_id"], unique=False)
        batch_op.create_index("ix_placements_node_status", ["node_id", "status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("placements", schema=None) as batch_op:
        batch_op.drop_index("ix_placements_node_status")
        batch_op.drop_index(batch_op.f("ix_placements_job_id"))

    op.drop_table("placements")
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.drop_index("ix_metrics_job_seq")
        batch_op.drop_index("ix_metrics_job_name_seq")

    op.drop_table("metrics")
    with op.batch_alter_table("log_chunks", schema=None) as batch_op:
        batch_op.drop_index("ix_log_chunks_job_stream_seq")

    op.drop_table("log_chunks")
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.drop_index("ix_job_events_job_seq")

    op.drop_table("job_events")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_attempts_one_live_per_job",
            sqlite_where=sa.text("status IN ('running', 'scheduled')"),
            postgresql_where=sa.text("status IN ('running', 'scheduled')"),
        )
        batch_op.drop_index(batch_op.f("ix_attempts_job_id"))

    op.drop_table("attempts")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_validation_dataset_id"))
        batch_op.drop_index(batch_op.f("ix_jobs_train_dataset_id"))
        batch_op.drop_index("ix_jobs_status_priority")
        batch_op.drop_index("ix_jobs_owner_created")

    op.drop_table("jobs")
    op.drop_table("nodes")
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_datasets_sha256"))
        batch_op.drop_index(batch_op.f("ix_datasets_owner_id"))

    op.drop_table("datasets")
    op.drop_table("tokens")

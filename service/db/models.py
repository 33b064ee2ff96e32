"""SQL tables. The schema is created only by the Alembic migrations in ``migrations/``.

Constraints guard the state machine: a job's status is one of the known values, a
final job has a finish time and only a final one does, a failed job has a failure
code, a succeeded one a model, and at most one live attempt exists per job.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, validates

from service.db.types import EnumAsString, SeqInt, UTCDateTime, new_id, utcnow
from service.states import (
    ENGINE_AGENTS,
    FINAL_STATUSES,
    LIVE_ATTEMPT_STATUSES,
    AttemptStatus,
    EngineName,
    JobStatus,
    NodeStatus,
    PlacementStatus,
    Role,
    SweepStatus,
    TrialState,
    sql_in,
)
from torchyard.contract.jobspec import JobKind

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def enum_columns(*keys: str) -> Any:
    """A validator for the :class:`EnumAsString` columns ``keys`` of a row: what is assigned
    becomes the enum member at once (a plain string too), not only once the row is read
    back, so the row's attributes are members from the start."""

    @validates(*keys)
    def as_member(row: Base, key: str, value: Any) -> Any:
        column_type = row.__table__.c[key].type
        assert isinstance(column_type, EnumAsString)
        return None if value is None else column_type.enum_class(value)

    return as_member


class Token(Base):
    __tablename__ = "tokens"
    __table_args__ = (CheckConstraint(f"role IN {sql_in(Role)}", name="role"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[Role] = mapped_column(EnumAsString(Role))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Refreshed at most once a minute (see ``service.services.tokens.LAST_USED_RESOLUTION``).
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # A launch token (docs/slurm.md): it speaks only for this attempt's placements.
    attempt_id: Mapped[str | None] = mapped_column(String(32), index=True)
    # The user a user or admin token acts for (docs/teams.md); None for worker tokens.
    user_id: Mapped[str | None] = mapped_column(String(32), index=True)

    _enums = enum_columns("role")


class User(Base):
    """A person (docs/teams.md): owns tokens, belongs to teams (the first is their default)."""

    __tablename__ = "users"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    disabled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # A user of the OpenID provider (docs/oidc.md): found by its issuer and subject, never by
    # name or email; they act through a token of their own that is never handed out.
    oidc_issuer: Mapped[str | None] = mapped_column(String(500))
    oidc_subject: Mapped[str | None] = mapped_column(String(255))
    email: Mapped[str | None] = mapped_column(String(320))
    sign_in_token_id: Mapped[str | None] = mapped_column(String(32))

    __table_args__ = (Index("ix_users_oidc_identity", "oidc_issuer", "oidc_subject", unique=True),)


class WebSession(Base):
    """A web UI sign-in through the OpenID provider (docs/oidc.md): the cookie's value is kept
    only as a hash; the provider's refresh token encrypted (Fernet)."""

    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    id_hash: Mapped[str] = mapped_column(String(64), unique=True)
    user_id: Mapped[str] = mapped_column(String(32), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    refresh_token: Mapped[str | None] = mapped_column(Text)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Team(Base):
    """A team (docs/teams.md): its members' jobs are admitted against its quotas."""

    __tablename__ = "teams"
    __table_args__ = (CheckConstraint("weight > 0", name="weight"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    # Fair-share weight: a team of weight 2 is entitled to twice the share of one of weight 1.
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    # Whether a higher-priority job of the team may preempt a lower-priority one of the team.
    preempt_within: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Passed to the engines that schedule: sbatch --account, Kueue's queue-name label.
    slurm_account: Mapped[str | None] = mapped_column(String(100))
    kueue_queue: Mapped[str | None] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TeamMember(Base):
    __tablename__ = "team_members"

    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), primary_key=True)
    # The order of the user's teams: the first is the default of their submissions.
    position: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class TeamQuota(Base):
    """A team's quota in one resource pool, in units (GPUs, or CPU slots): ``nominal`` is
    its own, ``borrowing_limit`` how much more it may use of others' idle units,
    ``lending_limit`` how much of its idle nominal others may borrow (None: no limit)."""

    __tablename__ = "team_quotas"
    __table_args__ = (
        CheckConstraint(
            "nominal >= 0 AND (borrowing_limit IS NULL OR borrowing_limit >= 0) "
            "AND (lending_limit IS NULL OR lending_limit >= 0)",
            name="limits",
        ),
    )

    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), primary_key=True)
    pool: Mapped[str] = mapped_column(String(100), primary_key=True)
    nominal: Mapped[int] = mapped_column(Integer)
    borrowing_limit: Mapped[int | None] = mapped_column(Integer)
    lending_limit: Mapped[int | None] = mapped_column(Integer)


class TeamUsage(Base):
    """A team's use of its quota in a pool, sampled once a minute by the upkeep and kept
    for a week (docs/teams.md): the teams page's charts. ``at`` is the minute of the sample,
    so that replicas sampling the same minute cannot both write it."""

    __tablename__ = "team_usage"

    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), primary_key=True)
    pool: Mapped[str] = mapped_column(String(100), primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, primary_key=True, index=True)
    used: Mapped[int] = mapped_column(Integer)
    nominal: Mapped[int] = mapped_column(Integer)
    borrowed: Mapped[int] = mapped_column(Integer)
    lent: Mapped[int] = mapped_column(Integer)


class Dataset(Base):
    __tablename__ = "datasets"
    __table_args__ = (
        CheckConstraint("source IN ('upload', 'path')", name="source"),
        CheckConstraint("num_images >= 0", name="num_images"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[str] = mapped_column(ForeignKey("tokens.id"), index=True)
    # The team it belongs to (docs/teams.md); None only for rows older than teams.
    team_id: Mapped[str | None] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(200))
    source: Mapped[str] = mapped_column(String(16))
    storage_path: Mapped[str] = mapped_column(Text)
    classes: Mapped[list[str]] = mapped_column(JSON)
    class_counts: Mapped[dict[str, int]] = mapped_column(JSON)
    num_images: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Object storage: the object holding the dataset's archive (docs/storage.md); None when
    # the dataset is the folder ``storage_path``.
    archive_key: Mapped[str | None] = mapped_column(Text)
    # Deleted datasets keep their row (finished jobs still reference it) but are hidden.
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class CodePackage(Base):
    """An uploaded source folder for script jobs, stored content-addressed under
    ``<data dir>/code/<sha256>/`` (two uploads of the same files share one copy)."""

    __tablename__ = "code_packages"
    __table_args__ = (CheckConstraint("files >= 0 AND size_bytes >= 0", name="sizes"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[str] = mapped_column(ForeignKey("tokens.id"), index=True)
    # The team it belongs to (docs/teams.md); None only for rows older than teams.
    team_id: Mapped[str | None] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(200))
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    files: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Object storage: the object holding the package's archive (docs/storage.md); None when
    # the package is the folder ``code/<sha256>``.
    archive_key: Mapped[str | None] = mapped_column(Text)
    # Deleted packages keep their row (finished jobs still reference it) but are hidden.
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class PretrainedWeights(Base):
    """An uploaded state dict of a torchvision architecture, the starting point of
    ``pretrained: true`` jobs (docs/fine-tuning.md); the file is ``<data dir>/weights/<sha256>.pth``.
    Shared by every user; only an admin deletes one (row and file)."""

    __tablename__ = "pretrained_weights"
    __table_args__ = (CheckConstraint("size_bytes >= 0", name="size"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    architecture: Mapped[str] = mapped_column(String(100), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    uploaded_by: Mapped[str] = mapped_column(ForeignKey("tokens.id"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


_final = sql_in(FINAL_STATUSES)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(f"status IN {sql_in(JobStatus)}", name="status"),
        CheckConstraint(f"(status IN {_final}) = (finished_at IS NOT NULL)", name="finished_iff_final"),
        CheckConstraint("(status = 'failed') = (failure_code IS NOT NULL)", name="failure_iff_failed"),
        CheckConstraint(
            "type <> 'train' OR status <> 'succeeded' OR model_sha256 IS NOT NULL", name="succeeded_has_model"
        ),
        CheckConstraint(
            "type <> 'train' OR (architecture IS NOT NULL AND train_dataset_id IS NOT NULL "
            "AND validation_dataset_id IS NOT NULL)",
            name="train_fields",
        ),
        CheckConstraint("type <> 'script' OR code_id IS NOT NULL", name="script_fields"),
        CheckConstraint("node_count >= 1 AND process_count_per_node >= 1", name="resources"),
        Index("ix_jobs_owner_created", "owner_id", "created_at"),
        Index("ix_jobs_status_priority", "status", "priority", "created_at"),
        # The job lists' cursors (newest first): everyone's, one owner's, by status.
        Index("ix_jobs_created_id", "created_at", "id"),
        Index("ix_jobs_owner_created_id", "owner_id", "created_at", "id"),
        Index("ix_jobs_team_status", "team_id", "status"),
        Index("ix_jobs_status_created_id", "status", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[str] = mapped_column(ForeignKey("tokens.id"))
    # The team it belongs to (docs/teams.md); None only for rows older than teams.
    team_id: Mapped[str | None] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[JobStatus] = mapped_column(EnumAsString(JobStatus), default=JobStatus.QUEUED)
    # What runs (torchyard.contract.jobspec.JobKind); the API refuses other values.
    type: Mapped[JobKind] = mapped_column(
        EnumAsString(JobKind), default=JobKind.TRAIN, server_default=JobKind.TRAIN
    )
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    # Training jobs only (the train_fields constraint).
    architecture: Mapped[str | None] = mapped_column(String(100))
    train_dataset_id: Mapped[str | None] = mapped_column(ForeignKey("datasets.id"), index=True)
    validation_dataset_id: Mapped[str | None] = mapped_column(ForeignKey("datasets.id"), index=True)
    # Script jobs only: the code package, and the outputs archive once uploaded.
    code_id: Mapped[str | None] = mapped_column(ForeignKey("code_packages.id"), index=True)
    outputs_sha256: Mapped[str | None] = mapped_column(String(64))
    outputs_size: Mapped[int | None] = mapped_column(BigInteger)
    # As ``model_key``, for the outputs archive. None: ``outputs/<id>.tar.gz``.
    outputs_key: Mapped[str | None] = mapped_column(Text)
    init_from_job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"))
    node_count: Mapped[int] = mapped_column(Integer)
    process_count_per_node: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    wait_reason: Mapped[str | None] = mapped_column(Text)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    best: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Script jobs: the MLflow runs their processes logged, with params and tags (docs/script-jobs.md).
    tracking: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Metric points stored for the job (every attempt), the distinct metric names among them,
    # and the points its reports sent past the job's limits (not stored): counted as reports
    # arrive, under the job's row lock, so the limits cost no count of the metrics table.
    metric_points: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    metric_names: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    metrics_dropped: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    failure_code: Mapped[str | None] = mapped_column(String(64))
    failure_message: Mapped[str | None] = mapped_column(Text)
    failure_rank: Mapped[int | None] = mapped_column(Integer)
    failure_node: Mapped[str | None] = mapped_column(String(200))
    failure_traceback: Mapped[str | None] = mapped_column(Text)
    model_sha256: Mapped[str | None] = mapped_column(String(64))
    model_size: Mapped[int | None] = mapped_column(BigInteger)
    # The object of the model archive when it came by direct upload (docs/storage.md): one
    # key per upload, so only the row says which is current. None: ``models/<id>.tar.gz``.
    model_key: Mapped[str | None] = mapped_column(Text)
    attempts_count: Mapped[int] = mapped_column(Integer, default=0)
    # Restarts used after retryable failures (preemptions are not counted).
    restarts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Why a job went back to the queue (a restart or a preemption), until it is placed again.
    requeue_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    scheduled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # A sweep's trial (docs/sweeps.md): the sweep and the trial's number in it.
    sweep_id: Mapped[str | None] = mapped_column(ForeignKey("sweeps.id"), index=True)
    trial_number: Mapped[int | None] = mapped_column(Integer)
    # Why it was cancelled: by whom, or the sweep rule that pruned it.
    cancel_reason: Mapped[str | None] = mapped_column(Text)
    # The owner's labels and free text (PATCH /v1/jobs/{id}).
    tags: Mapped[list[str] | None] = mapped_column(JSON)
    note: Mapped[str | None] = mapped_column(Text)
    # A deleted job keeps this row (its id is never given again, registered model rows and
    # other jobs may name it) but nothing else: it is hidden everywhere.
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    _enums = enum_columns("status", "type")


# The queue in the scheduler's order (priority first, then oldest first), queued jobs only:
# a pass reads its first jobs from here without sorting the queue.
Index(
    "ix_jobs_queue",
    Job.priority.desc(),
    Job.created_at,
    Job.id,
    sqlite_where=text("status = 'queued'"),
    postgresql_where=text("status = 'queued'"),
)


class JobInput(Base):
    """A dataset a job reads besides a training job's own two (a script job's ``inputs``)."""

    __tablename__ = "job_inputs"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), index=True)


class JobEvent(Base):
    """Timestamped status history of a job (also the source of status events for followers)."""

    __tablename__ = "job_events"
    __table_args__ = (
        CheckConstraint(f"status IN {sql_in(JobStatus)}", name="status"),
        Index("ix_job_events_job_seq", "job_id", "seq"),
    )

    seq: Mapped[int] = mapped_column(SeqInt, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    status: Mapped[JobStatus] = mapped_column(EnumAsString(JobStatus))
    message: Mapped[str | None] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    _enums = enum_columns("status")


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (
        CheckConstraint(f"status IN {sql_in(NodeStatus)}", name="status"),
        CheckConstraint("units >= 1", name="units"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    address: Mapped[str] = mapped_column(String(255))
    units: Mapped[int] = mapped_column(Integer)
    accelerator: Mapped[str] = mapped_column(String(64))
    status: Mapped[NodeStatus] = mapped_column(EnumAsString(NodeStatus), default=NodeStatus.READY)
    # The worker token that registered the node: no other token may speak for it.
    token_id: Mapped[str] = mapped_column(ForeignKey("tokens.id"))
    # sha256 of the per-node key of the agent holding the node; a second agent with the
    # same token but another key is refused while this one's heartbeats are fresh.
    agent_key_hash: Mapped[str | None] = mapped_column(String(64))
    info: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Who drained the node: "admin" (kept across agent restarts until undrained) or
    # "agent" (its agent got SIGTERM; a new agent registering makes it ready again).
    drained_by: Mapped[str | None] = mapped_column(String(16))
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Who keeps the row: "agents" (a resident agent registers and heartbeats) or an
    # engine's inventory ("slurm": mirrored from sinfo).
    engine: Mapped[EngineName] = mapped_column(
        EnumAsString(EngineName), default=ENGINE_AGENTS, server_default=ENGINE_AGENTS
    )

    _enums = enum_columns("status", "engine")


_live_attempt = sql_in(LIVE_ATTEMPT_STATUSES)


class Attempt(Base):
    """One try at running a job: a gang of placements, one per node."""

    __tablename__ = "attempts"
    __table_args__ = (
        CheckConstraint(f"status IN {sql_in(AttemptStatus)}", name="status"),
        UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),
        # At most one live attempt per job.
        Index(
            "uq_attempts_one_live_per_job",
            "job_id",
            unique=True,
            sqlite_where=text(f"status IN {_live_attempt}"),
            postgresql_where=text(f"status IN {_live_attempt}"),
        ),
        # What an engine's poll reads: attempts whose engine job may still exist.
        Index(
            "ix_attempts_engine_open",
            "engine",
            sqlite_where=text("engine <> 'agents' AND engine_state IS NULL"),
            postgresql_where=text("engine <> 'agents' AND engine_state IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    status: Mapped[AttemptStatus] = mapped_column(
        EnumAsString(AttemptStatus), default=AttemptStatus.SCHEDULED
    )
    master_addr: Mapped[str] = mapped_column(String(255), index=True)
    master_port: Mapped[int] = mapped_column(Integer)
    failure_code: Mapped[str | None] = mapped_column(String(64))
    failure_message: Mapped[str | None] = mapped_column(Text)
    # Set when a node of the attempt is drained: every node is told to checkpoint and stop.
    preempt_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Why the scheduler asked it to stop (docs/teams.md: a team's quota reclaimed); None: a drain.
    preempt_reason: Mapped[str | None] = mapped_column(Text)
    # The engine that runs it ("agents", "slurm"), its job id there once submitted, that
    # job's final state once the engine reports it ended (None while it may still run), and
    # the engine's last word on it (a pending reason, the tail of its output).
    engine: Mapped[EngineName] = mapped_column(
        EnumAsString(EngineName), default=ENGINE_AGENTS, server_default=ENGINE_AGENTS
    )
    engine_job_id: Mapped[str | None] = mapped_column(String(64))
    engine_state: Mapped[str | None] = mapped_column(String(32))
    engine_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    _enums = enum_columns("status", "engine")


class Placement(Base):
    """An attempt's share of one node: its node rank, units held, and the node's lease."""

    __tablename__ = "placements"
    __table_args__ = (
        CheckConstraint("status IN ('assigned', 'running', 'done')", name="status"),
        CheckConstraint("units >= 1 AND node_rank >= 0", name="shape"),
        UniqueConstraint("attempt_id", "node_rank", name="uq_placements_attempt_rank"),
        UniqueConstraint("attempt_id", "node_id", name="uq_placements_attempt_node"),
        UniqueConstraint("lease_token", name="uq_placements_lease_token"),
        Index("ix_placements_node_status", "node_id", "status"),
        # Placements not done: the units they hold, and the leases the reaper watches.
        Index(
            "ix_placements_open",
            "node_id",
            "lease_expires_at",
            sqlite_where=text("status <> 'done'"),
            postgresql_where=text("status <> 'done'"),
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    attempt_id: Mapped[str] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"))
    node_rank: Mapped[int] = mapped_column(Integer)
    units: Mapped[int] = mapped_column(Integer)
    status: Mapped[PlacementStatus] = mapped_column(
        EnumAsString(PlacementStatus), default=PlacementStatus.ASSIGNED
    )
    lease_token: Mapped[str] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    _enums = enum_columns("status")


class Metric(Base):
    """Append-only metric points; the unique key makes a retried batch a no-op."""

    __tablename__ = "metrics"
    __table_args__ = (
        UniqueConstraint(
            "job_id", "attempt_id", "name", "rank", "epoch", "step", "occurrence", name="uq_metrics_point"
        ),
        Index("ix_metrics_job_seq", "job_id", "seq"),
        Index("ix_metrics_job_name_seq", "job_id", "name", "seq"),
        # Finds the later attempt's point that supersedes one (the default history).
        Index("ix_metrics_job_point_attempt", "job_id", "name", "rank", "epoch", "step", "attempt"),
    )

    seq: Mapped[int] = mapped_column(SeqInt, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt_id: Mapped[str] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    # The attempt's number: the default history shows each point from the latest attempt.
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Float)
    epoch: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    time: Mapped[datetime] = mapped_column(UTCDateTime)
    # Which value at its name, rank, epoch and step (0 the first): MLflow keeps several.
    occurrence: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class LogChunk(Base):
    """A piece of one log stream (``rank-N`` or ``agent-<node>``) at a byte offset."""

    __tablename__ = "log_chunks"
    __table_args__ = (
        CheckConstraint("size >= 1", name="size"),
        UniqueConstraint("job_id", "attempt_id", "stream", "offset", name="uq_log_chunks_offset"),
        Index("ix_log_chunks_job_stream_seq", "job_id", "stream", "seq"),
    )

    seq: Mapped[int] = mapped_column(SeqInt, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt_id: Mapped[str] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    stream: Mapped[str] = mapped_column(String(210))
    offset: Mapped[int] = mapped_column(BigInteger)
    # Length of ``data`` in UTF-8 bytes: offsets count bytes, so readers find a chunk's end without decoding.
    size: Mapped[int] = mapped_column(Integer)
    data: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ModelVersion(Base):
    """A registered model: a name and a version (counting up per owner and name) for the
    model directory of a succeeded training job. Deleted versions keep their row (their
    number is never given again) but are hidden."""

    __tablename__ = "model_versions"
    __table_args__ = (
        UniqueConstraint("owner_id", "name", "version", name="uq_model_versions_owner_name_version"),
        CheckConstraint("version >= 1", name="version"),
        Index("ix_model_versions_owner_name", "owner_id", "name"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[str] = mapped_column(ForeignKey("tokens.id"))
    # The team it belongs to (docs/teams.md); None only for rows older than teams.
    team_id: Mapped[str | None] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(100))
    version: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    # The folder of a script job's outputs the model directory came from; None for a training job's.
    path: Mapped[str | None] = mapped_column(Text)
    architecture: Mapped[str] = mapped_column(String(100))
    classes: Mapped[list[str]] = mapped_column(JSON)
    image_size: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    has_onnx: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Checkpoint(Base):
    """A job's training-state checkpoint in the artifact store; the latest two are kept
    until the job ends. The file is ``<data dir>/checkpoints/<job id>/<id>.pt``."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        CheckConstraint("epoch >= 0 AND (step IS NULL OR step >= 0) AND size_bytes >= 0", name="position"),
        Index("ix_checkpoints_job_created", "job_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt_id: Mapped[str] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    attempt_number: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ObjectUpload(Base):
    """A direct upload in progress (docs/storage.md): the client PUTs its parts to the object
    store with presigned URLs, then asks the API to complete it. The row goes when it is
    completed, refused or abandoned (the upkeep drops those older than
    ``storage_upload_expiry_s``, parts and all)."""

    __tablename__ = "object_uploads"
    __table_args__ = (
        CheckConstraint("size_bytes >= 0 AND part_bytes > 0", name="sizes"),
        Index("ix_object_uploads_lookup", "kind", "owner_id", "sha256"),
        Index("ix_object_uploads_created", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    kind: Mapped[str] = mapped_column(String(32))
    key: Mapped[str] = mapped_column(Text)
    owner_id: Mapped[str] = mapped_column(ForeignKey("tokens.id"))
    job_id: Mapped[str | None] = mapped_column(String(32))
    store_upload_id: Mapped[str | None] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    part_bytes: Mapped[int] = mapped_column(BigInteger)
    part_sha256: Mapped[list[str]] = mapped_column(JSON)
    details: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiReplica(Base):
    """One running API process, as its reaper last wrote it (PostgreSQL): the cluster's
    listening clock. ``listening_since`` is when that replica last began hearing the nodes
    (its start, or the end of a database outage it saw); ``seen_at`` its latest reaper pass."""

    __tablename__ = "api_replicas"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    listening_since: Mapped[datetime] = mapped_column(UTCDateTime)
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Sweep(Base):
    """A hyperparameter search (docs/sweeps.md): its request as submitted (normalized), and how
    many trials it has asked for. Every decision is taken under this row's lock."""

    __tablename__ = "sweeps"
    __table_args__ = (
        CheckConstraint(f"status IN {sql_in(SweepStatus)}", name="status"),
        CheckConstraint("max_concurrent_trials >= 1 AND max_trials >= max_concurrent_trials", name="limits"),
        Index("ix_sweeps_owner_created", "owner_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[str] = mapped_column(ForeignKey("tokens.id"))
    # The team it belongs to (docs/teams.md); None only for rows older than teams.
    team_id: Mapped[str | None] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="running")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    algorithm: Mapped[str] = mapped_column(String(16))
    max_trials: Mapped[int] = mapped_column(Integer)
    max_concurrent_trials: Mapped[int] = mapped_column(Integer)
    # Trials asked for so far: the next trial's number.
    trials_created: Mapped[int] = mapped_column(Integer, default=0)
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class SweepTrial(Base):
    """One trial of a sweep: its parameters, the job that runs it, and what the search
    library knows of it (its per-epoch objective values and its own attributes)."""

    __tablename__ = "sweep_trials"
    __table_args__ = (
        UniqueConstraint("sweep_id", "number", name="uq_sweep_trials_sweep_number"),
        CheckConstraint(f"state IN {sql_in(TrialState)}", name="state"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), unique=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), default="queued")
    value: Mapped[float | None] = mapped_column(Float)
    epochs: Mapped[int] = mapped_column(Integer, default=0)
    # Objective value by epoch (keys are epoch numbers as text).
    intermediate: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    system_attrs: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    def steps(self) -> dict[int, float]:
        """The objective's value at each epoch reported so far (JSON keys are text)."""
        return {int(k): float(v) for k, v in (self.intermediate or {}).items()}


class Webhook(Base):
    """A subscription (docs/webhooks.md): the events of its owner's jobs and sweeps POSTed to
    ``url``, signed with its secret. The secret is stored encrypted (Fernet, under the key of
    ``TORCHYARD_WEBHOOK_KEY`` or the data directory's ``webhook.key``): signing needs it back.
    ``team``: the id of the team whose jobs and sweeps it receives, whoever submitted them;
    NULL for its owner's own."""

    __tablename__ = "webhooks"
    __table_args__ = (Index("ix_webhooks_owner_created", "owner_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[str] = mapped_column(ForeignKey("tokens.id"))
    team: Mapped[str | None] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[str]] = mapped_column(JSON)
    secret_encrypted: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WebhookDelivery(Base):
    """One event for one subscription: the outbox row written in the transaction of the change
    it tells of, then sent (and retried) by the API's delivery loop. ``body`` is the JSON sent,
    as signed; ``next_attempt_at`` is when a pending one is due (pushed ahead while a replica
    sends it, so that no other replica sends it at the same time)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        CheckConstraint("status IN ('pending', 'delivered', 'failed')", name="status"),
        CheckConstraint("attempts >= 0", name="attempts"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_webhook_created", "webhook_id", "created_at"),
        Index("ix_webhook_deliveries_finished", "finished_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    webhook_id: Mapped[str] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(32))
    body: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_status: Mapped[int | None] = mapped_column(Integer)
    last_response: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class AuditEvent(Base):
    """One change made through the API (docs/audit.md): who (the token, its user and role),
    how they signed in, from which address, what (an action on a target) and the answer's
    status. Append-only: written once, in its own transaction, and never updated or deleted
    by the service (operators archive the export)."""

    __tablename__ = "audit_events"
    __table_args__ = (
        Index("ix_audit_events_at", "at"),
        Index("ix_audit_events_action", "action"),
        Index("ix_audit_events_actor_name", "actor_name"),
    )

    id: Mapped[int] = mapped_column(SeqInt, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # The token that made the change (its name and id), its user's name and the role; all
    # None for a request whose token was refused (a failed sign-in, a 401).
    actor_name: Mapped[str | None] = mapped_column(String(200))
    actor_token_id: Mapped[str | None] = mapped_column(String(32))
    actor_token_name: Mapped[str | None] = mapped_column(String(200))
    actor_role: Mapped[str | None] = mapped_column(String(16))
    # How the request was authenticated: token (Authorization header), session (the web
    # UI's cookie), oidc (a sign-in through the identity provider), none.
    via: Mapped[str] = mapped_column(String(16))
    source: Mapped[str | None] = mapped_column(String(100))
    action: Mapped[str] = mapped_column(String(64))
    target_kind: Mapped[str | None] = mapped_column(String(32))
    target_id: Mapped[str | None] = mapped_column(String(300))
    outcome: Mapped[int] = mapped_column(Integer)
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

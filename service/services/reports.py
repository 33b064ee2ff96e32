"""Metrics, logs and progress: what worker agents report, stored for users to read back.

Storage is append-only rows with a global ``seq``:

* ``metrics``: one row per point; the key job/attempt/name/rank/epoch/step/occurrence
  makes a retried batch a no-op (insert-on-conflict-do-nothing; ``occurrence`` tells apart
  several values at one step, as MLflow keeps them, in the order they were logged);
* ``log_chunks``: one row per piece of a stream (``rank-N`` or ``agent-<node>``),
  keyed by attempt/stream/byte offset, so a retried chunk is skipped too. Offsets count
  UTF-8 bytes; ``size`` is the chunk's length in bytes. The service writes its own notes
  on a job to the stream ``service`` (agents cannot send it).

A job stores at most :attr:`MetricLimits.max_points` metric points, of at most
:attr:`MetricLimits.max_names` distinct names (the settings
``TORCHYARD_MAX_METRIC_POINTS_PER_JOB`` and ``TORCHYARD_MAX_METRIC_NAMES_PER_JOB``), counted
on the job's row as they are stored. Points past them are dropped, the rest of the report
is stored as usual, and the first drop is said in the ``service`` stream.

Every report of a job is written under the job's row lock (taken before the
placement's, the order every worker write follows), so within one job ``seq`` order
is commit order: a reader that remembers the last ``seq`` it saw and asks for what
comes after never skips a row that commits later. Followers (``follow=true``,
server-sent events) poll :func:`metric_points_after` and :func:`log_chunks_after`
with a short session per poll: no connection is held between polls, and a follower
on one API replica sees what arrived through another.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, String, Table, exists, func, literal, select, union_all
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, aliased

from service.db.models import Attempt, Job, LogChunk, Metric, Node, Placement, utcnow
from service.schemas.reports import LogStream, LogStreams
from service.services.kinds import kind_of
from service.services.leases import lock_lease
from service.services.tokens import Principal
from service.states import LIVE_ATTEMPT_STATUSES, JobStatus
from torchyard.contract.errors import NotFoundError, RequestValidationError
from torchyard.contract.metrics import VAL_METRICS
from torchyard.contract.reports import (
    ProgressIn,
    ReportAccepted,
    ReportBatch,
    ResultIn,
    TrackingIn,
    TrackingModelIn,
    TrackingRunIn,
    file_stream_node_rank,
    is_stream_name,
)
from torchyard.contract.responses import MetricPoint

# Rows one log read looks at; chunks are small, a reader continues from X-Next-Offset.
_LOG_ROWS_PER_READ = 2000
_INSERT_ROWS = 500
# Metric names looked up in one query (one index probe each) when a report brings them.
_NAMES_PER_QUERY = 100
_LIVE_ATTEMPT = [s.value for s in LIVE_ATTEMPT_STATUSES]
# The stream of the service's own notes on a job (never one an agent may send).
SERVICE_STREAM = "service"


@dataclass(frozen=True)
class MetricLimits:
    """What one job may store of metric points: the settings of the same names."""

    max_points: int
    max_names: int


# --- ingestion ------------------------------------------------------------------------------


def _insert_new(session: Session, table: Table, rows: list[dict[str, Any]]) -> int:
    """Insert rows, skipping those whose unique key is already stored; how many were new."""
    if not rows:
        return 0
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(table).on_conflict_do_nothing().returning(table.c.seq)
    inserted = 0
    for start in range(0, len(rows), _INSERT_ROWS):
        inserted += len(session.execute(stmt, rows[start : start + _INSERT_ROWS]).all())
    return inserted


def _stored_names(session: Session, job_id: str, names: list[str]) -> set[str]:
    """Those of ``names`` the job already has points of (one index probe per name)."""
    found: set[str] = set()
    for start in range(0, len(names), _NAMES_PER_QUERY):
        probes: list[Select[Any]] = [
            select(literal(name, String)).where(exists().where(Metric.job_id == job_id, Metric.name == name))
            for name in names[start : start + _NAMES_PER_QUERY]
        ]
        stmt = probes[0] if len(probes) == 1 else union_all(*probes)
        found.update(session.scalars(stmt))
    return found


def _store_metrics(
    session: Session, job: Job, rows: list[dict[str, Any]], limits: MetricLimits
) -> tuple[int, int]:
    """Insert the report's points within the job's limits, in report order; ``(stored, dropped)``.

    Points of a name the job does not have yet are dropped once it has ``max_names``
    names, and every point once it has ``max_points`` points. Points already stored (a
    retried report) are skipped without using any of the room, except at the very
    limit, where the rest of the report is dropped unread.
    """
    if not rows:
        return 0, 0
    names = list(dict.fromkeys(row["name"] for row in rows))
    known = _stored_names(session, job.id, names)
    names_left = limits.max_names - job.metric_names
    allowed = set(known)
    for name in names:
        if name not in allowed and names_left > 0:
            allowed.add(name)
            names_left -= 1
    kept = [row for row in rows if row["name"] in allowed]
    room = limits.max_points - job.metric_points
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    table = Metric.__table__
    stmt = insert(table).on_conflict_do_nothing().returning(table.c.name)  # type: ignore[arg-type]
    stored = position = 0
    stored_names: set[str] = set()
    while position < len(kept) and room > 0:
        part = kept[position : position + min(room, _INSERT_ROWS)]
        position += len(part)
        inserted = list(session.scalars(stmt, part))
        stored += len(inserted)
        room -= len(inserted)
        stored_names.update(inserted)
    job.metric_points += stored
    job.metric_names += len(stored_names - known)
    return stored, len(rows) - position  # the names refused, and what the room did not reach


def _count_dropped(
    session: Session,
    job: Job,
    attempt: Attempt,
    placement: Placement,
    limits: MetricLimits,
    dropped: int,
    now: datetime,
) -> bool:
    """Count ``dropped`` points on the job, saying so in its ``service`` stream the first
    time; whether the job changed as its readers see it (its first drop)."""
    if not dropped:
        return False
    first = not job.metrics_dropped
    if first:
        _note_first_drop(session, job, attempt, placement, limits, now)
    job.metrics_dropped += dropped
    return first


def _note_first_drop(
    session: Session, job: Job, attempt: Attempt, placement: Placement, limits: MetricLimits, now: datetime
) -> None:
    """Say in the job's ``service`` stream that its metric points are being dropped."""
    node_name = session.scalars(select(Node.name).where(Node.id == placement.node_id)).one()
    reached = (
        f"it stored {job.metric_points} points, the most a job may"
        if job.metric_points >= limits.max_points
        else f"it has points of {job.metric_names} metric names, the most a job may"
    )
    text = (
        f"{now.isoformat(timespec='seconds')} metric points reported from node {node_name} are being "
        f"dropped: {reached}. A job stores at most {limits.max_points} metric points of at most "
        f"{limits.max_names} names (TORCHYARD_MAX_METRIC_POINTS_PER_JOB, "
        "TORCHYARD_MAX_METRIC_NAMES_PER_JOB); points past them are not stored, the rest of each "
        "report is. The job's metrics_dropped counts them; this is said once.\n"
    )
    offset = _stream_end(session, job.id, attempt.id, SERVICE_STREAM)
    session.add(
        LogChunk(
            job_id=job.id,
            attempt_id=attempt.id,
            stream=SERVICE_STREAM,
            offset=offset,
            size=len(text.encode("utf-8")),
            data=text,
            created_at=now,
        )
    )


def _node_streams(session: Session, job: Job, placement: Placement) -> tuple[range, str]:
    """The global ranks this placement runs and its agent stream name."""
    per_node = job.process_count_per_node
    first = placement.node_rank * per_node
    node_name = session.scalars(select(Node.name).where(Node.id == placement.node_id)).one()
    return range(first, first + per_node), f"agent-{node_name}"


def _check_tracking(job: Job, tracking: TrackingIn, world_size: int) -> None:
    kind_of(job).check_tracking(job)
    ranks = [("runs", i, r.rank) for i, r in enumerate(tracking.runs)]
    ranks += [("models", i, m.rank) for i, m in enumerate(tracking.models)]
    for what, i, rank in ranks:
        if rank >= world_size:
            raise RequestValidationError(
                f"tracking.{what}[{i}]: rank {rank} is outside the job's world size {world_size}"
            )


def _check_batch(session: Session, job: Job, placement: Placement, batch: ReportBatch) -> None:
    world_size = job.node_count * job.process_count_per_node
    for i, point in enumerate(batch.metrics):
        if point.rank >= world_size:
            raise RequestValidationError(
                f"metrics[{i}]: rank {point.rank} is outside the job's world size {world_size}"
            )
    if batch.tracking is not None:
        _check_tracking(job, batch.tracking, world_size)
    if not batch.logs:
        return
    ranks, agent_stream = _node_streams(session, job, placement)
    allowed = {f"rank-{r}" for r in ranks} | {agent_stream}
    kind = kind_of(job)
    for i, chunk in enumerate(batch.logs):
        if chunk.stream in allowed or kind.accepts_log_stream(chunk.stream, placement.node_rank):
            continue
        raise RequestValidationError(
            f"logs[{i}]: stream {chunk.stream!r} is not one of this node's streams "
            f"({', '.join(sorted(allowed))}{kind.log_streams_hint(placement.node_rank)})"
        )


def _progress_of(attempt: Attempt, progress: ProgressIn) -> dict[str, Any]:
    fraction = min(1.0, progress.step / progress.total_steps) if progress.total_steps else None
    return {
        "attempt": attempt.number,
        "epoch": progress.epoch,
        "epochs": progress.epochs,
        "step": progress.step,
        "total_steps": progress.total_steps,
        "fraction": None if fraction is None else round(fraction, 4),
        "time": (progress.time or utcnow()).isoformat(),
    }


def _best_from_metrics(session: Session, job: Job, attempt: Attempt) -> dict[str, Any] | None:
    """The validation metrics of the attempt's epoch with the lowest ``val.loss`` so far.

    Ties keep the earliest epoch, as early stopping does: that epoch's weights are the
    ones the model directory will hold.
    """
    best = session.execute(
        select(Metric.epoch, Metric.step, Metric.rank, Metric.value)
        .where(Metric.job_id == job.id, Metric.attempt_id == attempt.id, Metric.name == "val.loss")
        .order_by(Metric.value, Metric.epoch, Metric.step)
        .limit(1)
    ).first()
    if best is None:
        return None
    values = session.execute(
        select(Metric.name, Metric.value)
        .where(
            Metric.job_id == job.id,
            Metric.attempt_id == attempt.id,
            Metric.epoch == best.epoch,
            Metric.step == best.step,
            Metric.rank == best.rank,
            Metric.name.in_(VAL_METRICS),
        )
        .order_by(Metric.seq)  # several values at the step (a script's): the latest of each name
    ).all()
    found = {name: value for name, value in values} | {"val.loss": best.value}
    return {"attempt": attempt.number, "epoch": best.epoch, **found}


def _tracking_of(job: Job, attempt: Attempt, placement: Placement, tracking: TrackingIn) -> dict[str, Any]:
    """The job's ``tracking``: this node's runs and logged models replace what it sent before;
    ``params`` and ``tags`` gather every run's (system tags ``mlflow.*`` left out; a later run
    wins a key); ``models`` (MLflow 3's logged models) only once there are any."""
    before = job.tracking or {}
    node = {"attempt": attempt.number, "node_rank": placement.node_rank}

    def merged(
        old: list[dict[str, Any]], new: list[TrackingRunIn] | list[TrackingModelIn]
    ) -> list[dict[str, Any]]:
        sent = {item.id for item in new}
        items = [r for r in old if r.get("id") not in sent]
        items += [{**item.model_dump(mode="json"), **node} for item in new]
        items.sort(key=lambda r: (r.get("attempt", 0), r.get("rank", 0), r.get("name", ""), r.get("id", "")))
        return items

    runs = merged(before.get("runs", []), tracking.runs)
    params: dict[str, str] = {}
    tags: dict[str, str] = {}
    for run in runs:
        params.update(run.get("params") or {})
        tags.update({k: v for k, v in (run.get("tags") or {}).items() if not k.startswith("mlflow.")})
    out: dict[str, Any] = {"params": params, "tags": tags, "runs": runs}
    models = merged(before.get("models", []), tracking.models)
    if models:
        out["models"] = models
    return out


def _apply_tracking(job: Job, attempt: Attempt, placement: Placement, tracking: TrackingIn) -> bool:
    """Store the node's runs in the job's ``tracking``; whether it changed."""
    merged = _tracking_of(job, attempt, placement, tracking)
    if merged == job.tracking:
        return False
    job.tracking = merged
    return True


def _result_of(attempt: Attempt, result: ResultIn) -> dict[str, Any]:
    dumped = result.model_dump(mode="json")
    if dumped.get("evaluation") is None:
        dumped.pop("evaluation", None)  # only evaluation jobs report one
    return {"attempt": attempt.number, **dumped}


def ingest_report(
    session: Session,
    principal: Principal,
    job_id: str,
    lease_token: str | None,
    batch: ReportBatch,
    *,
    limits: MetricLimits,
) -> ReportAccepted:
    """Store one report batch from the agent holding ``lease_token``, and commit.

    Updates the job's ``progress`` (latest epoch/step), ``best`` (validation metrics of
    the lowest-loss epoch so far) and ``result`` (the trainer's summary). A stale lease
    or an invalid batch changes nothing. Metric points past the job's ``limits`` are
    dropped (counted in the answer and on the job); the rest of the batch is stored.
    """
    job, placement = lock_lease(session, principal, lease_token, job_id=job_id)
    _check_batch(session, job, placement, batch)
    attempt = session.get_one(Attempt, placement.attempt_id)

    metric_rows = [
        {
            "job_id": job.id,
            "attempt_id": attempt.id,
            "attempt": attempt.number,
            "name": p.name,
            "value": p.value,
            "epoch": p.epoch,
            "step": p.step,
            "rank": p.rank,
            "time": p.time,
            "occurrence": p.occurrence,
        }
        for p in batch.metrics
    ]
    now = utcnow()
    log_rows = []
    for chunk in batch.logs:
        log_rows.append(
            {
                "job_id": job.id,
                "attempt_id": attempt.id,
                "stream": chunk.stream,
                "offset": chunk.offset,
                "size": len(chunk.data.encode("utf-8")),
                "data": chunk.data,
                "created_at": now,
            }
        )
    new_metrics, dropped = _store_metrics(session, job, metric_rows, limits)
    new_logs = _insert_new(session, LogChunk.__table__, log_rows)  # type: ignore[arg-type]

    changed = _count_dropped(session, job, attempt, placement, limits, dropped, now)
    if batch.progress is not None:
        progress = _progress_of(attempt, batch.progress)
        if progress != job.progress:
            job.progress = progress
            changed = True
    if batch.tracking is not None:
        changed = _apply_tracking(job, attempt, placement, batch.tracking) or changed
    if batch.result is not None:
        result = _result_of(attempt, batch.result)
        best: dict[str, Any] | None = {
            "attempt": attempt.number,
            "epoch": batch.result.best_epoch,
            **{str(name): value for name, value in batch.result.best.items()},
        }
        if result != job.result:
            job.result = result
            changed = True
    elif any(p.name in VAL_METRICS for p in batch.metrics):
        best = _best_from_metrics(session, job, attempt)
    else:
        best = None
    if best is not None and best != job.best:
        job.best = best
        changed = True
    if changed:
        job.updated_at = now
    session.commit()
    return ReportAccepted(
        metrics=new_metrics,
        metrics_duplicate=len(metric_rows) - new_metrics - dropped,
        metrics_dropped=dropped,
        logs=new_logs,
        logs_duplicate=len(log_rows) - new_logs,
        progress=batch.progress is not None,
        result=batch.result is not None,
        tracking=batch.tracking is not None,
    )


# --- metrics --------------------------------------------------------------------------------


def not_superseded() -> ColumnElement[bool]:
    """A ``Metric`` point that no later attempt reported again (the same name, epoch, step
    and rank): the rule of the default metrics history and of the chart series. Every value
    of an earlier attempt at that step goes, whatever its ``occurrence``: the step was redone."""
    later = aliased(Metric)
    return ~exists().where(
        later.job_id == Metric.job_id,
        later.name == Metric.name,
        later.rank == Metric.rank,
        later.epoch == Metric.epoch,
        later.step == Metric.step,
        later.attempt > Metric.attempt,
    )


def metric_points_after(
    session: Session,
    job_id: str,
    after_seq: int,
    names: Collection[str] | None,
    limit: int,
    *,
    include_superseded: bool = True,
) -> list[MetricPoint]:
    """The job's metric points with ``seq > after_seq`` (optionally only ``names``), oldest first.

    Without ``include_superseded``, a point that a later attempt reported again (the same
    name, epoch, step and rank: an epoch redone after a restart) is left out, so each
    appears once, from the latest attempt that reported it. Several values at one step
    (``occurrence``) come in the order they were logged (``seq``). No owner check here:
    callers resolve the job for the principal first.
    """
    stmt = (
        select(
            Metric.seq,
            Metric.name,
            Metric.value,
            Metric.epoch,
            Metric.step,
            Metric.rank,
            Metric.time,
            Attempt.number,
        )
        .join(Attempt, Attempt.id == Metric.attempt_id)
        .where(Metric.job_id == job_id, Metric.seq > after_seq)
    )
    if names:
        stmt = stmt.where(Metric.name.in_(sorted(set(names))))
    if not include_superseded:
        stmt = stmt.where(not_superseded())
    rows = session.execute(stmt.order_by(Metric.seq).limit(limit)).all()
    return [
        MetricPoint(
            seq=r.seq,
            name=r.name,
            value=r.value,
            epoch=r.epoch,
            step=r.step,
            rank=r.rank,
            time=r.time,
            attempt=r.number,
        )
        for r in rows
    ]


# --- logs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogPiece:
    """A stored log chunk, for followers: ``data`` starts at byte ``offset`` of ``stream``."""

    seq: int
    attempt: int
    stream: str
    offset: int
    data: str


def log_chunks_after(
    session: Session,
    job_id: str,
    stream: str | None,
    after_seq: int,
    *,
    attempt_id: str | None = None,
    limit: int = 1000,
) -> list[LogPiece]:
    """Log chunks of the job with ``seq > after_seq``, oldest first: one stream, or all with None.

    Within a stream, chunks arrive in offset order, so concatenating ``data`` in seq order
    rebuilds the text. No owner check here: callers resolve the job first.
    """
    stmt = (
        select(LogChunk.seq, Attempt.number, LogChunk.stream, LogChunk.offset, LogChunk.data)
        .join(Attempt, Attempt.id == LogChunk.attempt_id)
        .where(LogChunk.job_id == job_id, LogChunk.seq > after_seq)
    )
    if stream is not None:
        stmt = stmt.where(LogChunk.stream == stream)
    if attempt_id is not None:
        stmt = stmt.where(LogChunk.attempt_id == attempt_id)
    rows = session.execute(stmt.order_by(LogChunk.seq).limit(limit)).all()
    return [
        LogPiece(seq=r.seq, attempt=r.number, stream=r.stream, offset=r.offset, data=r.data) for r in rows
    ]


def resolve_attempt(session: Session, job: Job, number: int | None) -> Attempt | None:
    """Attempt ``number`` of the job (404 if there is none), or its latest (None before any)."""
    stmt = select(Attempt).where(Attempt.job_id == job.id)
    if number is None:
        return session.scalars(stmt.order_by(Attempt.number.desc()).limit(1)).first()
    attempt = session.scalars(stmt.where(Attempt.number == number)).first()
    if attempt is None:
        raise NotFoundError(f"job {job.id!r} has no attempt {number}")
    return attempt


def resolve_stream(
    session: Session, job: Job, attempt: Attempt | None, *, rank: int | None, stream: str | None
) -> str | None:
    """The stored stream name a log request means: ``rank`` N, ``agent`` (node rank 0's
    agent), ``agent-<node>`` or ``rank-N``; rank 0 when neither is given. None when the
    attempt has no such stream yet (``agent`` before placement)."""
    world_size = job.node_count * job.process_count_per_node
    if rank is not None and stream is not None:
        raise RequestValidationError("give either rank or stream, not both")
    if stream is None:
        rank = 0 if rank is None else rank
        stream = f"rank-{rank}"
    elif stream == "agent":
        if attempt is None:
            return None
        node_name = session.scalars(
            select(Node.name)
            .join(Placement, Placement.node_id == Node.id)
            .where(Placement.attempt_id == attempt.id, Placement.node_rank == 0)
        ).first()
        return None if node_name is None else f"agent-{node_name}"
    elif stream == SERVICE_STREAM:
        return stream
    elif not is_stream_name(stream):
        raise RequestValidationError(
            f"stream {stream!r} is not a log stream: use rank-<N>, agent, agent-<node name>, "
            f"file-<node rank>/<path> or {SERVICE_STREAM}"
        )
    if stream.startswith("rank-") and int(stream.removeprefix("rank-")) >= world_size:
        raise RequestValidationError(
            f"the job has ranks 0..{world_size - 1}; there is no {stream}",
            details={"field": "rank", "allowed": f"0..{world_size - 1}"},
        )
    return stream


def _attempt_complete(job: Job, attempt: Attempt | None) -> bool:
    """Nothing more will be written for this attempt: it, or the whole job, has ended."""
    if JobStatus(job.status).is_final():
        return True
    return attempt is not None and attempt.status not in _LIVE_ATTEMPT


def _stream_end(session: Session, job_id: str, attempt_id: str, stream: str) -> int:
    end = session.scalar(
        select(func.max(LogChunk.offset + LogChunk.size)).where(
            LogChunk.job_id == job_id, LogChunk.attempt_id == attempt_id, LogChunk.stream == stream
        )
    )
    return int(end or 0)


def start_offset(
    session: Session,
    job: Job,
    attempt: Attempt | None,
    stream: str | None,
    *,
    tail: int | None = None,
    since: datetime | None = None,
) -> int:
    """Where a log read with ``tail`` (the last lines) or ``since`` (text that arrived at or
    after a time) begins: a byte offset of ``stream``, 0 when neither is given."""
    if attempt is None or stream is None:
        return 0
    of_stream = (LogChunk.job_id == job.id, LogChunk.attempt_id == attempt.id, LogChunk.stream == stream)
    start = 0
    if since is not None:
        first = session.scalar(
            select(func.min(LogChunk.offset)).where(*of_stream, LogChunk.created_at >= since)
        )
        start = _stream_end(session, job.id, attempt.id, stream) if first is None else int(first)
    if tail is not None:
        start = max(start, _tail_offset(session, of_stream, tail))
    return start


def _tail_offset(session: Session, of_stream: tuple[ColumnElement[bool], ...], lines: int) -> int:
    """The offset of the start of the last ``lines`` lines (a last line without its newline
    counts), reading the chunks from the end."""
    wanted = lines + 1  # newlines to pass: the one ending the last line, then one per line
    seen_text = False
    before: int | None = None
    while True:
        stmt = select(LogChunk.offset, LogChunk.data).where(*of_stream)
        if before is not None:
            stmt = stmt.where(LogChunk.offset < before)
        rows = session.execute(stmt.order_by(LogChunk.offset.desc()).limit(_LOG_ROWS_PER_READ)).all()
        if not rows:
            return 0
        for chunk_offset, data in rows:
            raw = data.encode("utf-8")
            end = len(raw)
            if not seen_text and raw:
                seen_text = True
                if not raw.endswith(b"\n"):
                    wanted -= 1  # the last line has no newline of its own
            while True:
                at = raw.rfind(b"\n", 0, end)
                if at < 0:
                    break
                wanted -= 1
                if wanted == 0:
                    return int(chunk_offset) + at + 1
                end = at
            before = chunk_offset


@dataclass(frozen=True)
class LogSlice:
    """Bytes of one stream from ``offset`` on; continue from ``next_offset``."""

    data: bytes
    offset: int
    next_offset: int
    stream: str | None
    attempt: int | None
    complete: bool


def read_log(
    session: Session,
    job: Job,
    attempt: Attempt | None,
    stream: str | None,
    offset: int,
    limit_bytes: int,
) -> LogSlice:
    """Up to ``limit_bytes`` of ``stream`` starting at byte ``offset``.

    ``complete`` is True when the attempt (or job) has ended and the reader is at the
    end of the stream: nothing more will come. Bytes that never arrived (a batch the
    agent had to drop) are skipped rather than waited for.
    """
    if attempt is None or stream is None:
        return LogSlice(b"", offset, offset, stream, None, _attempt_complete(job, attempt))
    of_stream = (
        LogChunk.job_id == job.id,
        LogChunk.attempt_id == attempt.id,
        LogChunk.stream == stream,
    )
    # Start at the chunk holding ``offset``: the last one that begins at or before it.
    first = select(func.max(LogChunk.offset)).where(*of_stream, LogChunk.offset <= offset).scalar_subquery()
    rows = session.execute(
        select(LogChunk.offset, LogChunk.size, LogChunk.data)
        .where(*of_stream, LogChunk.offset >= func.coalesce(first, 0))
        .order_by(LogChunk.offset)
        .limit(_LOG_ROWS_PER_READ)
    ).all()
    out = bytearray()
    start = position = offset
    for chunk_offset, size, data in rows:
        if chunk_offset + size <= position:
            continue
        if len(out) >= limit_bytes:
            break
        if chunk_offset > position:
            if out:
                break  # a gap: return the contiguous part; the next read skips it
            start = position = chunk_offset
        raw = data.encode("utf-8")
        piece = raw[position - chunk_offset : position - chunk_offset + limit_bytes - len(out)]
        out += piece
        position += len(piece)
    complete = _attempt_complete(job, attempt) and position >= _stream_end(
        session, job.id, attempt.id, stream
    )
    return LogSlice(bytes(out), start, position, stream, attempt.number, complete)


def _stream_sort_key(name: str) -> tuple[int, int, str]:
    if name.startswith("rank-"):
        return (1, int(name.removeprefix("rank-")), "")
    node_rank = file_stream_node_rank(name)
    if node_rank is not None:
        return (2, node_rank, name)
    return (0, 0, name)


def list_streams(session: Session, job: Job, attempt: Attempt | None) -> LogStreams:
    """The attempt's log streams with their sizes: every rank and every node's agent log,
    including those that have not written anything yet."""
    if attempt is None:
        return LogStreams(attempt=None, complete=_attempt_complete(job, None), streams=[])
    sizes: dict[str, int] = {
        name: int(end)
        for name, end in session.execute(
            select(LogChunk.stream, func.max(LogChunk.offset + LogChunk.size))
            .where(LogChunk.job_id == job.id, LogChunk.attempt_id == attempt.id)
            .group_by(LogChunk.stream)
        ).all()
    }
    for global_rank in range(job.node_count * job.process_count_per_node):
        sizes.setdefault(f"rank-{global_rank}", 0)
    nodes: dict[int, str] = {
        node_rank: node_name
        for node_rank, node_name in session.execute(
            select(Placement.node_rank, Node.name)
            .join(Placement, Placement.node_id == Node.id)
            .where(Placement.attempt_id == attempt.id)
        ).all()
    }
    for node_name in nodes.values():
        sizes.setdefault(f"agent-{node_name}", 0)
    streams = []
    for name in sorted(sizes, key=_stream_sort_key):
        rank = int(name.removeprefix("rank-")) if name.startswith("rank-") else None
        node = name.removeprefix("agent-") if name.startswith("agent-") else None
        file_node = file_stream_node_rank(name)
        if file_node is not None:
            node = nodes.get(file_node)
        streams.append(LogStream(name=name, size=sizes[name], rank=rank, node=node))
    return LogStreams(attempt=attempt.number, complete=_attempt_complete(job, attempt), streams=streams)

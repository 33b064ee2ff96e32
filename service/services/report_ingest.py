"""Storing what worker agents report: metric points, log chunks, progress, the result
and a script's MLflow runs, one batch at a time.

Storage is append-only rows with a global ``seq``:

* ``metrics``: one row per point; the key job/attempt/name/rank/epoch/step/occurrence
  makes a retried batch a no-op (insert-on-conflict-do-nothing; ``occurrence`` tells apart
  several values at one step, as MLflow keeps them, in the order they were logged); a job's
  points are bounded (:mod:`service.services.metric_store`);
* ``log_chunks``: one row per piece of a stream (``rank-N`` or ``agent-<node>``),
  keyed by attempt/stream/byte offset, so a retried chunk is skipped too. Offsets count
  UTF-8 bytes; ``size`` is the chunk's length in bytes. The service writes its own notes
  on a job to the stream ``service`` (agents cannot send it).

Every report of a job is written under the job's row lock (taken before the
placement's, the order every worker write follows), so within one job ``seq`` order
is commit order: a reader that remembers the last ``seq`` it saw and asks for what
comes after never skips a row that commits later. Followers (``follow=true``,
server-sent events) poll :func:`service.services.metric_points.metric_points_after` and
:func:`service.services.log_reads.log_chunks_after` with a short session per poll: no
connection is held between polls, and a follower on one API replica sees what arrived
through another.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Table, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.db.models import Attempt, Job, LogChunk, Metric, Node, Placement
from service.db.types import utcnow
from service.services import job_progress
from service.services.kinds import kind_of
from service.services.leases import lock_lease
from service.services.metric_store import INSERT_ROWS, MetricLimits, count_dropped, store_metrics
from service.services.tokens import Principal
from torchyard.contract.errors import RequestValidationError
from torchyard.contract.jobspec import JobKind
from torchyard.contract.metrics import VAL_METRICS
from torchyard.contract.reports import (
    ReportAccepted,
    ReportBatch,
    ResultIn,
    TrackingIn,
    TrackingModelIn,
    TrackingRunIn,
)


def _insert_new(session: Session, table: Table, rows: list[dict[str, Any]]) -> int:
    """Insert rows, skipping those whose unique key is already stored; how many were new."""
    if not rows:
        return 0
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(table).on_conflict_do_nothing().returning(table.c.seq)
    inserted = 0
    for start in range(0, len(rows), INSERT_ROWS):
        inserted += len(session.execute(stmt, rows[start : start + INSERT_ROWS]).all())
    return inserted


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


def _progress_of(job: Job, attempt: Attempt, batch: ReportBatch, now: datetime) -> dict[str, Any] | None:
    """The job's progress after the batch (None: unchanged): the trainer's progress event, or a
    script job's metric points (service/services/job_progress.py)."""
    progress = batch.progress
    if progress is None:
        if job.type != JobKind.SCRIPT or not batch.metrics:
            return None
        return job_progress.from_script_metrics(job.progress, attempt.number, batch.metrics, now)
    return job_progress.advanced(
        job.progress,
        attempt=attempt.number,
        epoch=progress.epoch,
        epochs=progress.epochs,
        step=progress.step,
        total_steps=progress.total_steps or None,
        time=progress.time or now,
        received=now,
    )


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
    new_metrics, dropped = store_metrics(session, job, metric_rows, limits)
    new_logs = _insert_new(session, LogChunk.__table__, log_rows)  # type: ignore[arg-type]

    changed = count_dropped(session, job, attempt, placement, limits, dropped, now)
    progress = _progress_of(job, attempt, batch, now)
    if progress is not None and progress != job.progress:
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

"""Storing a report's metric points within the job's limits.

A job stores at most :attr:`MetricLimits.max_points` metric points, of at most
:attr:`MetricLimits.max_names` distinct names (the settings
``TORCHYARD_MAX_METRIC_POINTS_PER_JOB`` and ``TORCHYARD_MAX_METRIC_NAMES_PER_JOB``), counted
on the job's row as they are stored. Points past them are dropped, the rest of the report
is stored as usual, and the first drop is said in the ``service`` stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, String, exists, literal, select, union_all
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.db.models import Attempt, Job, LogChunk, Metric, Node, Placement
from service.services.log_reads import SERVICE_STREAM, stream_end

INSERT_ROWS = 500
# Metric names looked up in one query (one index probe each) when a report brings them.
_NAMES_PER_QUERY = 100


@dataclass(frozen=True)
class MetricLimits:
    """What one job may store of metric points: the settings of the same names."""

    max_points: int
    max_names: int


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


def store_metrics(
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
        part = kept[position : position + min(room, INSERT_ROWS)]
        position += len(part)
        inserted = list(session.scalars(stmt, part))
        stored += len(inserted)
        room -= len(inserted)
        stored_names.update(inserted)
    job.metric_points += stored
    job.metric_names += len(stored_names - known)
    return stored, len(rows) - position  # the names refused, and what the room did not reach


def count_dropped(
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
    offset = stream_end(session, job.id, attempt.id, SERVICE_STREAM)
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

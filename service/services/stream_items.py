"""What a job's followers read: status changes, metric points and log chunks as items in
``seq`` order, read from the database in pages after a :class:`Cursor`.

Positions are a :class:`Cursor` of three sequence numbers (status, metric, log). Every
report of a job is written under the job's row lock, so within one job ``seq`` order
is commit order and "everything after this cursor" never skips a late commit. The final
status of a job is always the last item: a read that reaches it while more metric points
or log chunks are pending delivers those first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db.models import Job, JobEvent, LogChunk, Metric
from service.services.jobs import failure_of
from service.services.log_reads import LogPiece, log_chunks_after
from service.services.metric_points import metric_points_after
from service.states import JobStatus
from torchyard.contract.errors import RequestValidationError

# Items one database read returns at the most.
READ_LIMIT = 1000

_CURSOR = re.compile(r"^s([0-9]{1,19})\.m([0-9]{1,19})\.l([0-9]{1,19})$")
_SEQ_MAX = 2**63 - 1  # seq columns are 64-bit


# --------------------------------------------------------------------------- positions and items


@dataclass(frozen=True)
class Cursor:
    """The last delivered ``seq`` of each kind (0: nothing yet)."""

    status: int = 0
    metric: int = 0
    log: int = 0

    def encode(self) -> str:
        return f"s{self.status}.m{self.metric}.l{self.log}"

    @classmethod
    def decode(cls, text: str | None) -> Cursor:
        """Parse a ``Last-Event-ID``; empty means the beginning."""
        if not text:
            return cls()
        match = _CURSOR.match(text.strip())
        seqs = [int(g) for g in match.groups()] if match else []
        if match is None or max(seqs) > _SEQ_MAX:
            raise RequestValidationError(
                f"Last-Event-ID {text[:80]!r} is not an event id of this service (s<n>.m<n>.l<n>)",
                details={"field": "Last-Event-ID"},
            )
        return cls(*seqs)

    def covers(self, other: Cursor) -> bool:
        """Whether this position is at or past ``other`` for every kind."""
        return self.status >= other.status and self.metric >= other.metric and self.log >= other.log

    def after(self, item: Item) -> Cursor:
        if item.seq <= getattr(self, item.kind):
            return self
        return replace(self, **{item.kind: item.seq})


@dataclass(frozen=True)
class Item:
    """One thing that happened to a job, in the order followers receive it."""

    kind: str  # "status", "metric" or "log"
    seq: int
    data: dict[str, Any]
    final: bool = False
    stream: str | None = None
    attempt: int | None = None
    offset: int = 0
    text: str = ""

    @property
    def weight(self) -> int:
        return len(self.text) + 64

    @cached_property
    def payload(self) -> str:
        """``data`` as JSON, encoded once however many followers send it."""
        return json.dumps(self.data, separators=(",", ":"), allow_nan=False)


@dataclass
class Batch:
    items: list[Item]
    cursor: Cursor
    drained: bool  # nothing more to read up to ``upto`` (or now)
    final: bool  # the job's final status is among the items


def _status_item(ev: JobEvent, job: Job | None) -> Item:
    status = ev.status
    data: dict[str, Any] = {
        "seq": ev.seq,
        "status": ev.status,
        "message": ev.message,
        "at": ev.at.isoformat(),
    }
    if status is JobStatus.QUEUED and ev.message != "submitted":
        # Back in the queue: a restart after a retryable failure, or a preemption.
        data["requeued"] = True
    final = status.is_final()
    if final and job is not None:
        data["final"] = True
        failure = failure_of(job)
        # The event names the failure; its traceback is the job's (GET /v1/jobs/{id}).
        data["failure"] = None if failure is None else failure.model_dump(mode="json", exclude={"traceback"})
        data["best"] = job.best
        data["result"] = job.result
        data["model_sha256"] = job.model_sha256
    return Item("status", ev.seq, data, final=final)


def _metric_item(point: Any) -> Item:
    data = point.model_dump(mode="json")
    return Item("metric", point.seq, data)


def _log_item(piece: LogPiece) -> Item:
    rank = int(piece.stream.removeprefix("rank-")) if piece.stream.startswith("rank-") else None
    data = {
        "seq": piece.seq,
        "stream": piece.stream,
        "rank": rank,
        "attempt": piece.attempt,
        "offset": piece.offset,
        "text": piece.data,
    }
    return Item(
        "log",
        piece.seq,
        data,
        stream=piece.stream,
        attempt=piece.attempt,
        offset=piece.offset,
        text=piece.data,
    )


def _exhausted(rows: list[Any], limit: int, upto_seq: int | None) -> bool:
    """A kind's read is exhausted when it came back short, or reached ``upto``."""
    return len(rows) < limit or (upto_seq is not None and rows[-1].seq >= upto_seq)


def _status_items(session: Session, job_id: str, events: list[JobEvent], drained: bool) -> list[Item]:
    """The status changes read, up to the final one, which waits until the rest is out."""
    statuses: list[Item] = []
    for ev in events:
        if ev.status.is_final():
            if drained:
                statuses.append(_status_item(ev, session.get(Job, job_id)))
            break
        statuses.append(_status_item(ev, None))
    return statuses


def read_batch(
    session: Session, job_id: str, after: Cursor, *, upto: Cursor | None = None, limit: int = READ_LIMIT
) -> Batch:
    """What happened to the job after ``after`` (and not past ``upto``), final status last.

    Status changes are read first: every metric point and log chunk committed before a
    final status is then visible to the reads that follow, so none is left behind it.
    """
    stmt = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > after.status)
    if upto is not None:
        stmt = stmt.where(JobEvent.seq <= upto.status)
    events = list(session.scalars(stmt.order_by(JobEvent.seq).limit(limit)))
    metrics = metric_points_after(session, job_id, after.metric, None, limit)
    pieces = log_chunks_after(session, job_id, None, after.log, limit=limit)
    drained = (
        len(events) < limit
        and _exhausted(metrics, limit, None if upto is None else upto.metric)
        and _exhausted(pieces, limit, None if upto is None else upto.log)
    )
    if upto is not None:
        metrics = [m for m in metrics if m.seq <= upto.metric]
        pieces = [p for p in pieces if p.seq <= upto.log]
    statuses = _status_items(session, job_id, events, drained)
    # Status changes before the data of the same poll, except the final one, which ends it.
    items = (
        [s for s in statuses if not s.final]
        + [_metric_item(m) for m in metrics]
        + [_log_item(p) for p in pieces]
    )
    items += [s for s in statuses if s.final]
    cursor = after
    for item in items:
        cursor = cursor.after(item)
    return Batch(items, cursor, drained, any(s.final for s in statuses))


@dataclass(frozen=True)
class Heads:
    cursor: Cursor  # the job's current last seq of each kind
    items: int  # how many items the job has so far
    final: bool  # its final status is recorded


def read_heads(session: Session, job_id: str) -> Heads:
    """Where the job's history ends now, how long it is, and whether it is over."""
    values = []
    count = 0
    for table in (JobEvent, Metric, LogChunk):
        last, n = session.execute(
            select(func.max(table.seq), func.count()).where(table.job_id == job_id)
        ).one()
        values.append(int(last or 0))
        count += int(n)
    job_status = session.scalar(select(Job.status).where(Job.id == job_id))
    final = job_status is not None and job_status.is_final()
    return Heads(Cursor(*values), count, final)

"""Reading a job's metric points back: in ``seq`` order after a cursor, and the rule that
leaves out the points a later attempt reported again."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import ColumnElement, exists, select
from sqlalchemy.orm import Session, aliased

from service.db.models import Attempt, Metric
from torchyard.contract.responses import MetricPoint


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

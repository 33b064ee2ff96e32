"""A job's metric history reduced for charts: every metric as x/y arrays of at most about
a given number of points, however long the job ran.

A metric with more points than asked is cut into ``points / 2`` stretches of equal
length in report order, and each stretch gives its lowest and its highest value at the
stretch's middle step (min/max decimation, done by the database in one GROUP BY): spikes
and dips survive, so a loss curve drawn from 2,000 points looks like the one drawn from
100,000. The first statement reads only the ``(job_id, name, seq)`` index.

The rule that leaves out points a later attempt redid costs a correlated look-up per
stored point; it is applied only to jobs with more than one attempt (a job's only attempt
supersedes nothing). A reduced answer is kept in memory, keyed by the job, the points
asked and the job's metric count and last seq: a page opened again while nothing new was
reported is answered without reading the points (any new point, whichever transaction
commits first, changes the count).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, func, select, true
from sqlalchemy.orm import Session

from service.db.models import Attempt, Metric
from service.services.reports import not_superseded

CACHED_ANSWERS = 64  # reduced answers kept (a few KB each at 2,000 points per metric)


@dataclass(frozen=True)
class Series:
    x: list[float] = field(default_factory=list)  # training steps
    y: list[float] = field(default_factory=list)
    count: int = 0  # points stored, before reduction


_Key = tuple[str, str, int, int, int]  # database, job, points asked, metric count, last seq
_cache: OrderedDict[_Key, tuple[dict[str, Series], int]] = OrderedDict()
_cache_lock = threading.Lock()


def metric_series(session: Session, job_id: str, points: int) -> tuple[dict[str, Series], int]:
    """Every metric of the job, reduced to at most about ``points`` points each, and the
    last metric seq they include (follow on from it with the events stream or
    ``metrics?after=``).

    A point that a later attempt reported again (an epoch redone after a restart) is left
    out, by the same rule as the default metrics history (``reports.not_superseded``).
    The answer is shared between callers: do not change it.

    No owner check here: callers resolve the job for the principal first.
    """
    stored, newest = session.execute(
        select(func.count(), func.max(Metric.seq)).where(Metric.job_id == job_id)
    ).one()
    if not stored:
        return {}, 0
    key = (str(session.get_bind().engine.url), job_id, points, stored, newest)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    answer = _reduce(session, job_id, points)
    with _cache_lock:
        _cache[key] = answer
        while len(_cache) > CACHED_ANSWERS:
            _cache.popitem(last=False)
    return answer


def _reduce(session: Session, job_id: str, points: int) -> tuple[dict[str, Series], int]:
    attempts = session.scalar(select(func.count()).where(Attempt.job_id == job_id)) or 0
    current: ColumnElement[bool] = not_superseded() if attempts > 1 else true()
    stats = session.execute(
        select(Metric.name, func.count(), func.min(Metric.seq), func.max(Metric.seq))
        .where(Metric.job_id == job_id, current)
        .group_by(Metric.name)
        .order_by(Metric.name)
    ).all()
    if not stats:
        return {}, 0
    last_seq = max(row[3] for row in stats)
    out = {name: Series(count=count) for name, count, *_ in stats}
    small = [name for name, count, *_ in stats if count <= points]
    big = [row for row in stats if row[1] > points]
    in_range = (Metric.job_id == job_id, Metric.seq <= last_seq, current)
    for name in small:  # one indexed read each: a few points
        for step, value in session.execute(
            select(Metric.step, Metric.value).where(*in_range, Metric.name == name).order_by(Metric.seq)
        ):
            out[name].x.append(float(step))
            out[name].y.append(value)
    if big:
        lo = min(row[2] for row in big)
        hi = max(row[3] for row in big)
        buckets = max(1, points // 2)
        bucket = ((Metric.seq - lo) * buckets // (hi - lo + 1)).label("bucket")
        rows = session.execute(
            select(
                Metric.name,
                bucket,
                func.min(Metric.value),
                func.max(Metric.value),
                func.min(Metric.step),
                func.max(Metric.step),
                func.avg(Metric.value),
            )
            .where(*in_range, Metric.name.in_([row[0] for row in big]))
            .group_by(Metric.name, bucket)
            .order_by(Metric.name, bucket)
        )
        previous: dict[str, float] = {}
        for name, _, low, high, first_step, last_step, mean in rows:
            series = out[name]
            x = (first_step + last_step) / 2
            before = previous.get(name)
            # Going down: the high end of the stretch comes first, so the line does not zigzag.
            pair = (
                (low,)
                if low == high
                else (high, low)
                if before is not None and mean < before
                else (low, high)
            )
            for value in pair:
                series.x.append(x)
                series.y.append(value)
            previous[name] = mean
    return out, last_seq

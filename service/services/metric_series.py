"""A job's metric history reduced for charts: every metric as x/y arrays of at most about
a given number of points, however long the job ran.

A metric with more points than asked is cut into ``points / 2`` stretches of equal
length in report order, and each stretch gives its lowest and its highest value at the
stretch's middle step (min/max decimation, done by the database in one GROUP BY): spikes
and dips survive, so a loss curve drawn from 2,000 points looks like the one drawn from
100,000.

A reduced answer is kept in memory, keyed by the job, the points asked, and the job's
metric count and last seq (one read of the ``(job_id, seq)`` index): a page opened again
while nothing new was reported is answered without reading the points, and any new
point, whichever transaction commits first, changes the key. The rule that leaves out
points a later attempt redid costs a correlated look-up per stored point; it is applied
only to jobs with more than one attempt (a job's only attempt supersedes nothing).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sqlalchemy import ColumnElement, func, select, true
from sqlalchemy.orm import Session

from service.db.models import Attempt, Metric
from service.services.metric_points import not_superseded

# Reduced answers kept in memory, oldest dropped first: at most this many points in all
# (about 30 answers of a job with seven metrics at 2,000 points each; some 15 MB).
CACHED_POINTS = 400_000


@dataclass(frozen=True)
class Series:
    x: list[float] = field(default_factory=list)  # training steps
    y: list[float] = field(default_factory=list)
    count: int = 0  # points stored, before reduction


Answer = tuple[dict[str, Series], int]  # the series by name, and the last seq they include
Version = tuple[str, str, int, int]  # database, job, metric count, last seq: a new point changes it
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """Values by key, the least recently used dropped first once their sizes add up to more
    than ``limit`` (a value larger than that is not kept); each value counts 1 by default."""

    def __init__(self, limit: int, size: Callable[[V], int] = lambda _value: 1) -> None:
        self.limit = limit
        self.size = size
        self.total = 0
        self._values: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        size = self.size(value)
        if size > self.limit:
            return
        with self._lock:
            if key in self._values:
                return
            self._values[key] = value
            self.total += size
            while self.total > self.limit:
                _, dropped = self._values.popitem(last=False)
                self.total -= self.size(dropped)

    def __len__(self) -> int:
        return len(self._values)


def _answer_points(answer: Answer) -> int:
    return sum(len(s.x) for s in answer[0].values())


class AnswerCache(LruCache[tuple[Version, int], Answer]):
    """Reduced answers by job version and points asked, bounded by the points they hold."""

    def __init__(self, max_points: int) -> None:
        super().__init__(max_points, _answer_points)

    @property
    def points(self) -> int:
        return self.total


_cache = AnswerCache(CACHED_POINTS)


def job_version(session: Session, job_id: str) -> Version:
    """What a cached answer about the job's metrics is valid for (one read of the
    ``(job_id, seq)`` index): any new point, whichever transaction commits first, changes it."""
    stored, newest = session.execute(
        select(func.count(), func.max(Metric.seq)).where(Metric.job_id == job_id)
    ).one()
    return str(session.get_bind().engine.url), job_id, int(stored or 0), int(newest or 0)


def current_points(session: Session, job_id: str) -> ColumnElement[bool]:
    """The rule that leaves out points a later attempt redid, for a job that has any: it costs
    a correlated look-up per point, and a job's only attempt supersedes nothing."""
    attempts = session.scalar(select(func.count()).where(Attempt.job_id == job_id)) or 0
    return not_superseded() if attempts > 1 else true()


def metric_series(session: Session, job_id: str, points: int, version: Version | None = None) -> Answer:
    """Every metric of the job, reduced to at most about ``points`` points each, and the
    last metric seq they include (follow on from it with the events stream or
    ``metrics?after=``).

    A point that a later attempt reported again (an epoch redone after a restart) is left
    out, by the same rule as the default metrics history (``reports.not_superseded``).
    The answer is shared between callers: do not change it. ``version`` is the job's
    :func:`job_version`, when the caller has read it already.

    No owner check here: callers resolve the job for the principal first.
    """
    version = version or job_version(session, job_id)
    if not version[2]:
        return {}, 0
    key = (version, points)
    answer = _cache.get(key)
    if answer is None:
        answer = _reduce(session, job_id, points)
        _cache.put(key, answer)
    return answer


def _reduce(session: Session, job_id: str, points: int) -> Answer:
    current = current_points(session, job_id)
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

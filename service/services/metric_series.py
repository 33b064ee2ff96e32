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
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, func, select, true
from sqlalchemy.orm import Session

from service.db.models import Attempt, Metric
from service.services.reports import not_superseded

# Reduced answers kept in memory, oldest dropped first: at most this many points in all
# (about 30 answers of a job with seven metrics at 2,000 points each; some 15 MB).
CACHED_POINTS = 400_000


@dataclass(frozen=True)
class Series:
    x: list[float] = field(default_factory=list)  # training steps
    y: list[float] = field(default_factory=list)
    count: int = 0  # points stored, before reduction


Answer = tuple[dict[str, Series], int]  # the series by name, and the last seq they include
_Key = tuple[str, str, int, int, int]  # database, job, points asked, metric count, last seq


class AnswerCache:
    """Reduced answers by key, the least recently used dropped first once they hold more
    than ``max_points`` points in all (an answer larger than that is not kept)."""

    def __init__(self, max_points: int) -> None:
        self.max_points = max_points
        self.points = 0
        self._answers: OrderedDict[_Key, Answer] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def size(answer: Answer) -> int:
        return sum(len(s.x) for s in answer[0].values())

    def get(self, key: _Key) -> Answer | None:
        with self._lock:
            answer = self._answers.get(key)
            if answer is not None:
                self._answers.move_to_end(key)
            return answer

    def put(self, key: _Key, answer: Answer) -> None:
        size = self.size(answer)
        if size > self.max_points:
            return
        with self._lock:
            if key in self._answers:
                return
            self._answers[key] = answer
            self.points += size
            while self.points > self.max_points:
                _, dropped = self._answers.popitem(last=False)
                self.points -= self.size(dropped)

    def __len__(self) -> int:
        return len(self._answers)


_cache = AnswerCache(CACHED_POINTS)


def metric_series(session: Session, job_id: str, points: int) -> Answer:
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
    answer = _cache.get(key)
    if answer is None:
        answer = _reduce(session, job_id, points)
        _cache.put(key, answer)
    return answer


def _reduce(session: Session, job_id: str, points: int) -> Answer:
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

"""A job's metric history reduced for charts: every metric as x/y arrays of at most a
given number of points, however long the job ran.

Reduction keeps, for each of ``points / 2`` consecutive buckets of a series, its lowest
and its highest value in their order (min/max decimation): spikes and dips survive, so a
loss curve drawn from 1,000 points looks like the one drawn from 100,000.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db.models import Metric


@dataclass
class Series:
    x: list[int] = field(default_factory=list)  # the training step of each point
    y: list[float] = field(default_factory=list)
    epoch: list[int] = field(default_factory=list)
    count: int = 0  # points stored, before reduction


def decimate(
    xs: list[int], ys: list[float], es: list[int], points: int
) -> tuple[list[int], list[float], list[int]]:
    """At most ``points`` of the series: each bucket's min and max, in order; the last
    point is always kept so a chart ends where the job is."""
    n = len(xs)
    if n <= points:
        return xs, ys, es
    buckets = max(1, points // 2)
    out_x: list[int] = []
    out_y: list[float] = []
    out_e: list[int] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo >= hi:
            continue
        chunk = ys[lo:hi]
        i_min = lo + min(range(len(chunk)), key=chunk.__getitem__)
        i_max = lo + max(range(len(chunk)), key=chunk.__getitem__)
        for i in sorted({i_min, i_max}):
            out_x.append(xs[i])
            out_y.append(ys[i])
            out_e.append(es[i])
    if out_x[-1] != xs[-1] or out_y[-1] != ys[-1]:
        out_x.append(xs[-1])
        out_y.append(ys[-1])
        out_e.append(es[-1])
    return out_x, out_y, out_e


def metric_series(session: Session, job_id: str, points: int) -> tuple[dict[str, Series], int]:
    """Every metric of the job, reduced to at most about ``points`` points each, and the
    last metric seq read (follow on from it with the events stream or ``metrics?after=``).

    No owner check here: callers resolve the job for the principal first.
    """
    last_seq = session.scalar(select(func.max(Metric.seq)).where(Metric.job_id == job_id)) or 0
    rows = session.execute(
        select(Metric.name, Metric.step, Metric.value, Metric.epoch)
        .where(Metric.job_id == job_id, Metric.seq <= last_seq)
        .order_by(Metric.seq)
    ).all()
    raw: dict[str, tuple[list[int], list[float], list[int]]] = {}
    for name, step, value, epoch in rows:
        xs, ys, es = raw.setdefault(name, ([], [], []))
        xs.append(step)
        ys.append(value)
        es.append(epoch)
    out: dict[str, Series] = {}
    for name, (xs, ys, es) in raw.items():
        dx, dy, de = decimate(xs, ys, es, points)
        out[name] = Series(x=dx, y=dy, epoch=de, count=len(xs))
    return out, last_seq

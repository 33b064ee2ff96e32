"""Several jobs side by side: their spec's parameters (the ones that differ named), status,
duration, throughput, and for each metric its best and final value with the epoch and its
series reduced as the job page's are (``metric_series``).

Jobs are named as everywhere else (id, name or unique id prefix) and resolved for the
caller: a job they may not see is "not found", like one that does not exist. A metric that
no job has is an empty entry, not an error.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import ColumnElement, func, select, true
from sqlalchemy.orm import Session

from service.db.models import Attempt, Job, Metric
from service.services import jobs as jobs_service
from service.services import metric_series
from service.services.reports import not_superseded
from service.services.tokens import Principal
from torchyard.contract.errors import NotFoundError, RequestValidationError

MAX_JOBS = 20
MAX_METRICS = 50
THROUGHPUT_METRIC = "train.images_per_sec"
# Spec keys that name the job rather than describe how it ran.
_NOT_PARAMETERS = frozenset({"name"})

Goal = Literal["max", "min"]


def goal_of(metric: str) -> Goal:
    """Which way is better: a loss is minimised, everything else (accuracy, images/s) maximised."""
    return "min" if metric.rsplit(".", 1)[-1].endswith("loss") else "max"


@dataclass(frozen=True)
class Point:
    value: float
    epoch: int
    step: int


@dataclass
class ComparedMetric:
    best: Point | None = None
    final: Point | None = None
    series: metric_series.Series = field(default_factory=metric_series.Series)


@dataclass
class ComparedJob:
    job: Job
    parameters: dict[str, Any]
    duration_s: float | None
    images_per_sec: float | None
    metrics: dict[str, ComparedMetric]


@dataclass
class Comparison:
    jobs: list[ComparedJob]
    metrics: list[str]
    goals: dict[str, Goal]
    differing: list[str]
    points: int


def split_list(raw: str | None, what: str, limit: int) -> list[str]:
    """A comma-separated query parameter as its distinct non-empty items, in order."""
    items = list(dict.fromkeys(part.strip() for part in (raw or "").split(",") if part.strip()))
    if len(items) > limit:
        raise RequestValidationError(
            f"{what}: at most {limit} may be compared at once ({len(items)} given)",
            details={"field": what, "limit": limit, "given": len(items)},
        )
    return items


def flatten(spec: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A spec as dotted keys (``parameters.learning_rate``); lists are kept whole."""
    out: dict[str, Any] = {}
    for key, value in spec.items():
        if not prefix and key in _NOT_PARAMETERS:
            continue
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def differing_keys(parameters: Sequence[dict[str, Any]]) -> list[str]:
    """Keys whose value is not the same in every job (a key some lack counts as differing)."""
    keys = sorted({k for p in parameters for k in p})
    return [k for k in keys if len({repr(p.get(k, ...)) for p in parameters}) > 1]


def resolve_jobs(session: Session, principal: Principal, refs: Iterable[str]) -> list[Job]:
    """The jobs named, once each in the order given; 404 naming every one not found."""
    found: dict[str, Job] = {}
    missing: list[str] = []
    for ref in refs:
        try:
            job = jobs_service.get_job(session, principal, ref)
        except NotFoundError:
            missing.append(ref)
            continue
        found.setdefault(job.id, job)
    if missing:
        names = ", ".join(repr(m) for m in missing)
        raise NotFoundError(
            f"job{'s' if len(missing) > 1 else ''} {names} not found "
            "(no job you may see has this id, name or id prefix)",
            details={"not_found": missing},
        )
    return list(found.values())


def _metric_names(session: Session, job_ids: list[str]) -> list[str]:
    rows = session.scalars(select(Metric.name).where(Metric.job_id.in_(job_ids)).distinct())
    return sorted(rows)


def _current(session: Session, job_id: str) -> ColumnElement[bool]:
    """Leave out points a later attempt redid (only jobs with more than one attempt have any)."""
    attempts = session.scalar(select(func.count()).where(Attempt.job_id == job_id)) or 0
    return not_superseded() if attempts > 1 else true()


def _point(row: Any) -> Point | None:
    return None if row is None else Point(float(row.value), int(row.epoch), int(row.step))


def _compared_metric(
    session: Session, job_id: str, name: str, current: ColumnElement[bool]
) -> ComparedMetric:
    where = (Metric.job_id == job_id, Metric.name == name, current)
    order = Metric.value.asc() if goal_of(name) == "min" else Metric.value.desc()
    columns = (Metric.value, Metric.epoch, Metric.step)
    best = session.execute(select(*columns).where(*where).order_by(order, Metric.seq).limit(1)).first()
    final = session.execute(select(*columns).where(*where).order_by(Metric.seq.desc()).limit(1)).first()
    return ComparedMetric(best=_point(best), final=_point(final))


# Best/final values per job, keyed by the job's metric count and last seq (any new point
# changes the key), so comparing finished runs again reads no points. Oldest dropped first.
_Values = tuple[dict[str, tuple[Point | None, Point | None]], float | None]
_values: OrderedDict[tuple[str, str, int, int, tuple[str, ...]], _Values] = OrderedDict()
_values_lock = threading.Lock()
_CACHED_JOBS = 500


def _job_values(session: Session, job_id: str, names: Sequence[str]) -> _Values:
    stored, newest = session.execute(
        select(func.count(), func.max(Metric.seq)).where(Metric.job_id == job_id)
    ).one()
    key = (str(session.get_bind().engine.url), job_id, int(stored or 0), int(newest or 0), tuple(names))
    with _values_lock:
        cached = _values.get(key)
        if cached is not None:
            _values.move_to_end(key)
            return cached
    current = _current(session, job_id)
    per_metric = {}
    for name in names:
        entry = _compared_metric(session, job_id, name, current)
        per_metric[name] = (entry.best, entry.final)
    rate = session.scalar(
        select(func.avg(Metric.value)).where(
            Metric.job_id == job_id, Metric.name == THROUGHPUT_METRIC, current
        )
    )
    values: _Values = (per_metric, None if rate is None else float(rate))
    with _values_lock:
        _values[key] = values
        while len(_values) > _CACHED_JOBS:
            _values.popitem(last=False)
    return values


def _duration(job: Job) -> float | None:
    if job.started_at is None:
        return None
    end = job.finished_at or job.updated_at
    return max(0.0, (end - job.started_at).total_seconds())


def compare(
    session: Session, principal: Principal, refs: Sequence[str], metrics: Sequence[str] | None, points: int
) -> Comparison:
    if not refs:
        raise RequestValidationError("ids: name at least one job to compare", details={"field": "ids"})
    jobs = resolve_jobs(session, principal, refs)
    names = list(metrics) if metrics else _metric_names(session, [j.id for j in jobs])
    compared: list[ComparedJob] = []
    for job in jobs:
        reduced, _ = metric_series.metric_series(session, job.id, points)
        values, rate = _job_values(session, job.id, names)
        per_metric = {
            name: ComparedMetric(
                best=values[name][0], final=values[name][1], series=reduced.get(name, metric_series.Series())
            )
            for name in names
        }
        compared.append(
            ComparedJob(
                job=job,
                parameters=flatten(job.spec),
                duration_s=_duration(job),
                images_per_sec=rate,
                metrics=per_metric,
            )
        )
    return Comparison(
        jobs=compared,
        metrics=names,
        goals={name: goal_of(name) for name in names},
        differing=differing_keys([c.parameters for c in compared]),
        points=points,
    )

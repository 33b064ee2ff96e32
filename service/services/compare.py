"""Several jobs side by side: their spec's parameters (the ones that differ named), what a
script's MLflow runs logged (params and tags), status, duration, throughput, whether the job
counts its metrics by epoch or by step, and for each metric its best and final value with
its epoch and step and its series reduced as the job page's are (``metric_series``).

Jobs are named as everywhere else (id, name or unique id prefix) and resolved for the
caller: a job they may not see is "not found", like one that does not exist. A metric that
no job has is an empty entry, not an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from service.db.models import Job, Metric
from service.schemas.jobs import ComparedJob, ComparedMetric, JobComparison
from service.services import jobs as jobs_service
from service.services import metric_series
from service.services.tokens import Principal
from torchyard.contract.errors import NotFoundError, RequestValidationError
from torchyard.contract.jobspec import JobKind
from torchyard.contract.responses import ComparedPoint, MetricSeries

MAX_JOBS = 20
MAX_METRICS = 50
THROUGHPUT_METRIC = "train.images_per_sec"
# Spec keys that name the job rather than describe how it ran.
_NOT_PARAMETERS = frozenset({"name"})

Goal = Literal["max", "min"]


def goal_of(metric: str) -> Goal:
    """Which way is better: a loss is minimised, everything else (accuracy, images/s) maximised."""
    return "min" if metric.rsplit(".", 1)[-1].endswith("loss") else "max"


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


def _run_labels(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Each run's name, told apart by its rank (then its id) where two runs share one."""
    names = [str(r.get("name") or "") or str(r.get("id") or "")[:8] for r in runs]
    labels = [
        n if names.count(n) == 1 else f"{n} (rank {r.get('rank', 0)})"
        for n, r in zip(names, runs, strict=True)
    ]
    return [
        label if labels.count(label) == 1 else f"{label} {str(r.get('id') or '')[:8]}"
        for label, r in zip(labels, runs, strict=True)
    ]


def logged_rows(tracking: dict[str, Any] | None) -> dict[str, str]:
    """A script job's MLflow params and tags as rows to compare: ``mlflow: lr`` for a param,
    ``mlflow tag: team`` for a tag (MLflow's own ``mlflow.*`` tags left out), each run's of
    the latest attempt that has runs (an earlier attempt's runs were redone); with several
    runs, each key names its run (``mlflow: train: lr``). Params first."""
    runs = [r for r in (tracking or {}).get("runs") or [] if isinstance(r, dict)]
    if not runs:
        return {}
    latest = max(int(r.get("attempt") or 0) for r in runs)
    runs = [r for r in runs if int(r.get("attempt") or 0) == latest]
    labels = _run_labels(runs) if len(runs) > 1 else [""]
    params: dict[str, str] = {}
    tags: dict[str, str] = {}
    for run, label in zip(runs, labels, strict=True):
        prefix = f"{label}: " if label else ""
        for key, value in sorted((run.get("params") or {}).items()):
            params[f"mlflow: {prefix}{key}"] = str(value)
        for key, value in sorted((run.get("tags") or {}).items()):
            if not key.startswith("mlflow."):
                tags[f"mlflow tag: {prefix}{key}"] = str(value)
    return {**params, **tags}


def _logged_differing(logged: Sequence[dict[str, str]]) -> list[str]:
    """The logged keys not the same in every job: params, then tags, each by name."""
    keys = sorted({k for rows in logged for k in rows}, key=lambda k: (k.startswith("mlflow tag: "), k))
    return [k for k in keys if len({rows.get(k) for rows in logged}) > 1]


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


def _point(row: Any) -> ComparedPoint | None:
    return None if row is None else ComparedPoint(value=row.value, epoch=row.epoch, step=row.step)


def _best_and_final(
    session: Session, job_id: str, name: str, current: ColumnElement[bool]
) -> tuple[ComparedPoint | None, ComparedPoint | None]:
    where = (Metric.job_id == job_id, Metric.name == name, current)
    order = Metric.value.asc() if goal_of(name) == "min" else Metric.value.desc()
    columns = (Metric.value, Metric.epoch, Metric.step)
    best = session.execute(select(*columns).where(*where).order_by(order, Metric.seq).limit(1)).first()
    final = session.execute(select(*columns).where(*where).order_by(Metric.seq.desc()).limit(1)).first()
    return _point(best), _point(final)


# Best/final values, mean throughput and whether the points span more than one epoch per
# job version (any new point changes it), so comparing finished runs again reads no points.
_Values = tuple[dict[str, tuple[ComparedPoint | None, ComparedPoint | None]], float | None, bool]
_values: metric_series.LruCache[tuple[metric_series.Version, tuple[str, ...]], _Values] = (
    metric_series.LruCache(500)
)


def _job_values(session: Session, version: metric_series.Version, names: Sequence[str]) -> _Values:
    key = (version, tuple(names))
    values = _values.get(key)
    if values is None:
        job_id = version[1]
        current = metric_series.current_points(session, job_id)
        rate = session.scalar(
            select(func.avg(Metric.value)).where(
                Metric.job_id == job_id, Metric.name == THROUGHPUT_METRIC, current
            )
        )
        first, last = session.execute(
            select(func.min(Metric.epoch), func.max(Metric.epoch)).where(Metric.job_id == job_id)
        ).one()
        values = (
            {name: _best_and_final(session, job_id, name, current) for name in names},
            None if rate is None else float(rate),
            first is not None and first != last,
        )
        _values.put(key, values)
    return values


def _compared(
    best_and_final: tuple[ComparedPoint | None, ComparedPoint | None], series: metric_series.Series | None
) -> ComparedMetric:
    series = series or metric_series.Series()
    return ComparedMetric(
        best=best_and_final[0],
        final=best_and_final[1],
        series=MetricSeries(x=series.x, y=series.y, count=series.count),
    )


def _duration(started: datetime | None, ended: datetime) -> float | None:
    return None if started is None else max(0.0, (ended - started).total_seconds())


def compare(
    session: Session, principal: Principal, refs: Sequence[str], metrics: Sequence[str] | None, points: int
) -> JobComparison:
    if not refs:
        raise RequestValidationError("ids: name at least one job to compare", details={"field": "ids"})
    jobs = resolve_jobs(session, principal, refs)
    names = list(metrics) if metrics else _metric_names(session, [j.id for j in jobs])
    compared: list[ComparedJob] = []
    for job in jobs:
        version = metric_series.job_version(session, job.id)
        reduced, _ = metric_series.metric_series(session, job.id, points, version)
        values, rate, epochs = _job_values(session, version, names)
        compared.append(
            ComparedJob(
                id=job.id,
                name=job.name,
                type=job.type,
                status=job.status,
                parameters=flatten(job.spec),
                created_at=job.created_at,
                started_at=job.started_at,
                finished_at=job.finished_at,
                duration_s=_duration(job.started_at, job.finished_at or job.updated_at),
                images_per_sec=rate,
                axis="epoch" if job.type == JobKind.TRAIN or epochs else "step",
                logged=logged_rows(job.tracking),
                metrics={name: _compared(values[name], reduced.get(name)) for name in names},
            )
        )
    return JobComparison(
        jobs=compared,
        metrics=names,
        goals={name: goal_of(name) for name in names},
        differing=differing_keys([c.parameters for c in compared]),
        logged_differing=_logged_differing([c.logged for c in compared]),
        points=points,
    )

"""Jobs and their recorded metrics: submit, list, get, cancel, metric pages."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torchyard.apiclient.models import Job, JobComparison, MetricPage, MetricPoint, Page
from torchyard.apiclient.transport import Transport, segment


def _one_or_many(value: str | Sequence[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


class JobCalls:
    """The ``/v1/jobs`` routes that answer with one body (not a stream)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def submit_job(self, spec: Mapping[str, Any]) -> Job:
        """Submit a job spec (docs/api.md shape); returns the normalized job, status ``queued``."""
        return Job.model_validate(self._transport.json("POST", "/v1/jobs", json=dict(spec)))

    def list_jobs(
        self,
        *,
        status: str | Sequence[str] | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        tag: str | Sequence[str] | None = None,
        sweep: str | None = None,
        team: str | None = None,
    ) -> Page[Job]:
        """A page of the jobs you may read (yours and your teams'), newest first: with
        ``status`` one of these, with ``tag`` every one of these tags, with ``sweep`` the trials
        of that sweep (id, name or id prefix), with ``team`` that team's (one of yours)."""
        params: dict[str, Any] = {}
        if status:
            params["status"] = _one_or_many(status)
        if tag:
            params["tag"] = _one_or_many(tag)
        if sweep:
            params["sweep"] = sweep
        if team:
            params["team"] = team
        if limit is not None:
            params["limit"] = limit
        if cursor:
            params["cursor"] = cursor
        return Page[Job].model_validate(self._transport.json("GET", "/v1/jobs", params=params))

    def iter_jobs(
        self,
        *,
        status: str | Sequence[str] | None = None,
        tag: str | Sequence[str] | None = None,
        sweep: str | None = None,
        team: str | None = None,
    ) -> Iterator[Job]:
        cursor: str | None = None
        while True:
            page = self.list_jobs(status=status, limit=200, cursor=cursor, tag=tag, sweep=sweep, team=team)
            yield from page.items
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    def get_job(self, job_id: str) -> Job:
        return Job.model_validate(self._transport.json("GET", f"/v1/jobs/{segment(job_id)}"))

    def cancel_job(self, job_id: str) -> Job:
        """Idempotent cancel; the job ends ``cancelled`` once its ranks are stopped."""
        return Job.model_validate(self._transport.json("POST", f"/v1/jobs/{segment(job_id)}/cancel"))

    def update_job(self, job_id: str, **fields: Any) -> Job:
        """``PATCH``: ``tags`` (a list replacing the job's) and/or ``note`` (None clears it)."""
        return Job.model_validate(self._transport.json("PATCH", f"/v1/jobs/{segment(job_id)}", json=fields))

    def delete_job(self, job_id: str) -> dict[str, Any]:
        """Delete a finished job with its metrics, logs, checkpoints and files (409 while it
        runs, or while its model is a registered model version)."""
        result: dict[str, Any] = self._transport.json("DELETE", f"/v1/jobs/{segment(job_id)}")
        return result

    def clone_job(self, job_id: str) -> Job:
        """Submit a job's spec again as a new job; returns the new job, status ``queued``."""
        return Job.model_validate(self._transport.json("POST", f"/v1/jobs/{segment(job_id)}/clone"))

    def compare(
        self, job_ids: Sequence[str], *, metrics: Sequence[str] | None = None, points: int | None = None
    ) -> JobComparison:
        """Up to 20 jobs side by side (ids, names or id prefixes): parameters (``differing``
        names the keys that are not the same in all), and per metric the best and final value
        with its epoch and the reduced series."""
        params: dict[str, Any] = {"ids": ",".join(job_ids)}
        if metrics:
            params["metrics"] = ",".join(metrics)
        if points is not None:
            params["points"] = points
        return JobComparison.model_validate(self._transport.json("GET", "/v1/jobs/compare", params=params))

    def metrics(
        self,
        job_id: str,
        *,
        name: str | Sequence[str] | None = None,
        after: int | None = None,
        limit: int | None = None,
        include_superseded: bool = False,
    ) -> MetricPage:
        """One page of metric points after the ``after`` cursor (with ``include_superseded``,
        also the points of epochs a later attempt redid)."""
        params: dict[str, Any] = {}
        if include_superseded:
            params["include_superseded"] = "true"
        if name:
            params["name"] = _one_or_many(name)
        if after is not None:
            params["after"] = after
        if limit is not None:
            params["limit"] = limit
        path = f"/v1/jobs/{segment(job_id)}/metrics"
        return MetricPage.model_validate(self._transport.json("GET", path, params=params))

    def metric_names(self, job_id: str) -> list[str]:
        """The names of the metrics the job has reported (from its reduced series)."""
        body = self._transport.json(
            "GET", f"/v1/jobs/{segment(job_id)}/metrics/series", params={"points": 10}
        )
        return sorted(body.get("series", {}))

    def iter_metrics(
        self, job_id: str, *, name: str | Sequence[str] | None = None, after: int | None = None
    ) -> Iterator[MetricPoint]:
        """Every metric point recorded so far (after ``after``), following the pages."""
        cursor = after
        while True:
            page = self.metrics(job_id, name=name, after=cursor, limit=1000)
            yield from page.items
            if not page.items or page.next_after is None or page.next_after == cursor:
                return
            cursor = page.next_after

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, status
from pydantic import Field

from service.api.deps import CurrentUser, ReadSessionDep, SchedulingDep, SessionDep, SettingsDep
from service.api.routing import SessionScopedRoute
from service.schemas.jobs import JobComparison, JobCreate, JobList, JobPublic, JobUpdate
from service.services import compare as compare_service
from service.services import job_delete
from service.services import jobs as jobs_service
from service.services import sweeps as sweeps_service
from service.services import teams as teams_service
from service.services.kinds import kind_of
from service.states import JobStatus
from torchyard.contract.errors import ConflictError, NotFoundError

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=SessionScopedRoute)


@router.post("", status_code=status.HTTP_201_CREATED)
def submit_job(
    body: JobCreate,
    session: SessionDep,
    settings: SettingsDep,
    scheduling: SchedulingDep,
    user: CurrentUser,
) -> JobPublic:
    """Submit a job: ``type`` ``train`` (the built-in trainer, the default) or ``script`` (your own
    code, see POST /v1/code); 201 with the normalized spec (every default filled), status ``queued``."""
    job = jobs_service.submit_job(session, settings, user, body)
    public = jobs_service.submitted_public(session, job)
    scheduling.request()  # a pass soon, shared with every submission until it starts
    return public


@router.get("")
def list_jobs(
    session: ReadSessionDep,
    user: CurrentUser,
    status_: Annotated[list[JobStatus] | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
    tag: Annotated[
        list[Annotated[str, Field(max_length=64)]] | None,
        Query(max_length=20, description="Only jobs with this tag (repeatable: with every one of them)."),
    ] = None,
    sweep: Annotated[
        str | None,
        Query(max_length=200, description="Only the trials of this sweep (its id, name or id prefix)."),
    ] = None,
    team: Annotated[
        str | None,
        Query(max_length=100, description="Only the jobs of this team (one of yours; admins: any)."),
    ] = None,
) -> JobList:
    """The jobs you may read (yours, your teams', docs/teams.md) newest first; filter by one
    or more ``status``, by ``tag`` (a job with every tag given), by ``sweep`` and by ``team``
    (404 for a team you are not in); follow ``next_cursor`` for more (with the same filters)."""
    sweep_id = None if sweep is None else sweeps_service.get_sweep(session, user, sweep).id
    team_id = None if team is None else teams_service.visible_team(session, user, team).id
    rows, next_cursor = jobs_service.list_jobs(
        session,
        user,
        statuses=status_,
        limit=limit,
        cursor=cursor,
        tags=tag,
        sweep_id=sweep_id,
        team_id=team_id,
    )
    attempts = jobs_service.attempts_public(session, [j.id for j in rows])
    teams = jobs_service.team_names_of(session, rows)
    return JobList(
        items=[
            jobs_service.job_public(session, j, detail=False, attempts=attempts[j.id], team_names=teams)
            for j in rows
        ],
        next_cursor=next_cursor,
    )


@router.get("/compare")
def compare_jobs(
    session: ReadSessionDep,
    user: CurrentUser,
    ids: Annotated[
        str,
        Query(max_length=4000, description="Jobs to compare: ids, names or id prefixes, comma-separated."),
    ],
    metrics: Annotated[
        str | None,
        Query(
            max_length=4000, description="Metric names, comma-separated (default: every metric any job has)."
        ),
    ] = None,
    points: Annotated[
        int, Query(ge=10, le=100_000, description="At most this many points per series (about).")
    ] = 2000,
) -> JobComparison:
    """Up to 20 jobs side by side: each one's parameters (``differing`` names the keys that are
    not the same in all), status, duration and images/s, and per metric its best and final
    value with the epoch and its series reduced as on the job page. A job that is unknown or
    not yours is a 404 naming it; a metric no job has is an empty entry."""
    refs = compare_service.split_list(ids, "ids", compare_service.MAX_JOBS)
    names = compare_service.split_list(metrics, "metrics", compare_service.MAX_METRICS)
    return compare_service.compare(session, user, refs, names or None, points)


@router.get("/{job_id}")
def get_job(job_id: str, session: ReadSessionDep, user: CurrentUser) -> JobPublic:
    """Status, waiting reason, failure, progress, best metrics, nodes, attempts and history."""
    return jobs_service.job_public(session, jobs_service.get_job(session, user, job_id))


@router.patch("/{job_id}")
def update_job(job_id: str, body: JobUpdate, session: SessionDep, user: CurrentUser) -> JobPublic:
    """Set the job's ``tags`` (the list replaces the job's) and/or ``note`` (null clears it),
    at any status; fields left out are kept."""
    job = jobs_service.update_job(session, user, job_id, body)
    return jobs_service.job_public(session, job)


@router.delete("/{job_id}")
def delete_job(job_id: str, session: SessionDep, settings: SettingsDep, user: CurrentUser) -> dict[str, Any]:
    """Delete a finished job: its metrics, logs, history, attempts, checkpoints, model
    directory and outputs. 409 while it has not ended (cancel it first), while its model is
    a registered model version (delete those first), or while an unfinished job fine-tunes
    from it."""
    job = job_delete.delete_job(session, settings, user, job_id)
    return {"id": job.id, "name": job.name, "deleted": True}


@router.post("/{job_id}/clone", status_code=status.HTTP_201_CREATED)
def clone_job(
    job_id: str,
    session: SessionDep,
    settings: SettingsDep,
    scheduling: SchedulingDep,
    user: CurrentUser,
) -> JobPublic:
    """Submit the job's spec again as a new job (any status; 201, status ``queued``). The
    datasets, code package or model version it names must still exist."""
    job = jobs_service.clone_job(session, settings, user, job_id)
    public = jobs_service.submitted_public(session, job)
    scheduling.request()
    return public


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str, session: SessionDep, user: CurrentUser) -> JobPublic:
    """Idempotent cancel: running ranks are stopped by their agents; status ends ``cancelled``."""
    job = jobs_service.cancel_job(session, user, job_id)
    return jobs_service.job_public(session, job)


@router.get("/{job_id}/result")
def get_result(job_id: str, session: ReadSessionDep, user: CurrentUser) -> dict[str, Any]:
    """What the job produced: an evaluation's top-1, top-5, loss, per-class precision, recall
    and F1 and confusion matrix; a training job's summary (best epoch, best and final
    metrics). 409 until the job has reported it."""
    job = jobs_service.get_job(session, user, job_id)
    kind = kind_of(job)
    if job.result is None:
        never = kind.missing_result(job)
        if never is not None:
            raise never
        if job.status.is_final():
            raise NotFoundError(f"job {job.id} is {job.status}: it has no result and will not have one")
        raise ConflictError(f"job {job.id} is {job.status}: it has no result yet")
    return kind.result_document(job, dict(job.result))

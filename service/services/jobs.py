"""Jobs: submission, listing, cancellation and every status change (no HTTP here)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import ColumnElement, Text, cast, delete, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Attempt, Checkpoint, Job, JobEvent, Node, Placement, Team
from service.db.types import utcnow
from service.schemas.jobs import (
    JOB_CREATE,
    JOB_CREATE_MODELS,
    AttemptPublic,
    EvaluateJobCreate,
    JobPublic,
    JobUpdate,
    PlacementPublic,
    ScriptJobCreate,
    TrainJobCreate,
)
from service.services import metrics, refs
from service.services.job_lookup import get_job as get_job  # also the jobs API of the routes
from service.services.job_lookup import readable_jobs
from service.services.job_progress import progress_public
from service.services.kinds import kind_named, kind_of
from service.services.kinds.base import submitted_change
from service.services.tokens import Principal
from service.services.webhooks import emit as emit_webhook
from service.states import PLACED_STATUSES, AttemptStatus, JobStatus, can_transition
from torchyard.contract.errors import IllegalTransitionError
from torchyard.contract.failures import Failure
from torchyard.contract.responses import EndReason, StatusChange


def submit_job(
    session: Session,
    settings: Settings,
    principal: Principal,
    spec: TrainJobCreate | ScriptJobCreate | EvaluateJobCreate,
    *,
    commit: bool = True,
) -> Job:
    """Validate a spec of any kind against what it names, then queue it (``commit=False``:
    the caller commits, with what else it writes)."""
    return kind_named(spec.type).submit(session, settings, principal, spec, commit=commit)


def transition(
    session: Session,
    job: Job,
    new: JobStatus,
    message: str | None = None,
    *,
    failure: Failure | None = None,
) -> None:
    """Move ``job`` to ``new`` if the state machine allows it; record the change.

    The caller holds the job's row (in a write transaction) and commits.
    """
    current = job.status
    if not can_transition(current, new):
        raise IllegalTransitionError(f"job {job.id} cannot go from {current} to {new}")
    now = utcnow()
    job.status = new
    job.updated_at = now
    if new is JobStatus.SCHEDULED:
        job.scheduled_at = now
        # Its time in the queue (torchyard_queue_wait_seconds), once this write commits.
        metrics.job_placed(session, job.id, now)
        job.wait_reason = None
        job.requeue_reason = None
    elif new is JobStatus.RUNNING and job.started_at is None:
        job.started_at = now
    elif new is JobStatus.QUEUED:
        job.scheduled_at = None
    if new.is_final():
        job.finished_at = now
        job.wait_reason = None
        job.requeue_reason = None
    if failure is not None:
        job.failure_code = failure.code
        job.failure_message = failure.message
        job.failure_rank = failure.rank
        job.failure_node = failure.node
        job.failure_traceback = failure.traceback
    session.add(JobEvent(job_id=job.id, status=new, message=message, at=now))
    if new.is_final():
        # Its checkpoints are of no more use (the reaper removes their files).
        session.execute(delete(Checkpoint).where(Checkpoint.job_id == job.id))
    event = _WEBHOOK_EVENTS.get(new)
    if event is not None:
        emit_job_event(session, job, event)


# The job statuses that webhooks tell of (docs/webhooks.md); ``job.preempted`` is told by the
# preemption (:func:`service.services.attempt_outcomes.finish_preemption`).
_WEBHOOK_EVENTS = {
    JobStatus.RUNNING: "job.started",
    JobStatus.SUCCEEDED: "job.succeeded",
    JobStatus.FAILED: "job.failed",
    JobStatus.CANCELLED: "job.cancelled",
}


def emit_job_event(session: Session, job: Job, event: str) -> None:
    """Record ``event`` of ``job`` for its owner's webhooks and its team's, in the caller's
    transaction."""
    emit_webhook(
        session,
        job.owner_id,
        event,
        "job",
        lambda: job_public(session, job, detail=False).model_dump(mode="json"),
        team_id=job.team_id,
    )


def list_jobs(
    session: Session,
    principal: Principal,
    *,
    statuses: list[JobStatus] | None,
    limit: int,
    cursor: str | None,
    tags: list[str] | None = None,
    sweep_id: str | None = None,
    team_id: str | None = None,
) -> tuple[list[Job], str | None]:
    """The jobs the principal may read, newest first; ``cursor`` continues after the last
    job of the previous page. With ``tags``, only jobs that have every one of them; with
    ``sweep_id``, only its trials; with ``team_id``, only that team's."""
    stmt = select(Job).where(Job.deleted_at.is_(None), *readable_jobs(principal))
    if team_id is not None:
        stmt = stmt.where(Job.team_id == team_id)
    if statuses:
        stmt = stmt.where(Job.status.in_(statuses))
    for tag in dict.fromkeys(tags or []):
        stmt = stmt.where(has_tag(tag))
    if sweep_id is not None:
        stmt = stmt.where(Job.sweep_id == sweep_id)
    return refs.page_newest_first(session, Job, stmt, limit=limit, cursor=cursor)


def has_tag(tag: str) -> ColumnElement[bool]:
    """The job's tags hold ``tag``, on SQLite and PostgreSQL alike: the JSON text of the
    list holds the JSON text of the tag (both written by ``json.dumps``: a quote inside a
    tag is escaped, so ``"tag"`` matches one whole item; LIKE's wildcards are escaped)."""
    return cast(Job.tags, Text).contains(json.dumps(tag), autoescape=True)


def cancel_job(session: Session, principal: Principal, job_id: str) -> Job:
    """Idempotent: a queued job is cancelled at once; a placed one is ``cancelling`` until
    its agents report the ranks stopped; a finished job is left as it is."""
    job = get_job(session, principal, job_id, for_update=True, write=True)
    request_cancel(session, job, f"cancel requested by {principal.name}")
    session.commit()
    return job


def request_cancel(session: Session, job: Job, reason: str) -> bool:
    """Cancel the job (its row held by the caller, who commits): at once when queued,
    ``cancelling`` while placed; a finished job is left as it is. True if it changed."""
    status = job.status
    if status is JobStatus.QUEUED:
        transition(session, job, JobStatus.CANCELLED, f"{reason} (before it was placed)")
        job.cancel_requested_at = job.finished_at
    elif status in PLACED_STATUSES:
        job.cancel_requested_at = utcnow()
        transition(session, job, JobStatus.CANCELLING, reason)
    else:
        return False
    job.cancel_reason = reason
    return True


def attempts_public(session: Session, job_ids: list[str]) -> dict[str, list[AttemptPublic]]:
    """Every attempt of the given jobs (oldest first), with its placements, in one query."""
    out: dict[str, list[AttemptPublic]] = {job_id: [] for job_id in job_ids}
    if not job_ids:
        return out
    rows = session.execute(
        select(Attempt, Placement, Node.name)
        .outerjoin(Placement, Placement.attempt_id == Attempt.id)
        .outerjoin(Node, Node.id == Placement.node_id)
        .where(Attempt.job_id.in_(job_ids))
        .order_by(Attempt.job_id, Attempt.number, Placement.node_rank)
    ).all()
    by_id: dict[str, AttemptPublic] = {}
    for attempt, placement, node_name in rows:
        pub = by_id.get(attempt.id)
        if pub is None:
            pub = AttemptPublic.model_validate(attempt, from_attributes=True)
            if attempt.failure_code is not None:
                pub.end_reason = EndReason(code=attempt.failure_code, message=attempt.failure_message or "")
            elif attempt.status == AttemptStatus.PREEMPTED:
                pub.end_reason = EndReason(code="preempted", message=attempt.failure_message or "preempted")
            elif attempt.status in (AttemptStatus.SUCCEEDED, AttemptStatus.CANCELLED):
                pub.end_reason = EndReason(code=attempt.status, message=f"attempt {attempt.status}")
            by_id[attempt.id] = pub
            out[attempt.job_id].append(pub)
        if placement is not None:
            pub.placements.append(
                PlacementPublic(
                    node=node_name,
                    node_rank=placement.node_rank,
                    units=placement.units,
                    status=placement.status,
                )
            )
            pub.nodes.append(node_name)
    return out


def failure_of(job: Job) -> Failure | None:
    """Why the job failed (None unless it did)."""
    if job.failure_code is None:
        return None
    return Failure(
        code=job.failure_code,
        message=job.failure_message or "",
        rank=job.failure_rank,
        node=job.failure_node,
        traceback=job.failure_traceback,
    )


def job_public(
    session: Session,
    job: Job,
    *,
    detail: bool = True,
    attempts: list[AttemptPublic] | None = None,
    history: list[StatusChange] | None = None,
    team_names: dict[str, str] | None = None,
) -> JobPublic:
    """The job as users see it; ``detail`` adds its status history. ``attempts``,
    ``history`` and ``team_names`` (:func:`team_names_of`), when given, save the queries for
    them (a list of jobs reads every job's attempts and teams at once; a job just submitted
    has no attempt and one status change)."""
    spec: dict[str, Any] = job.spec
    failure = failure_of(job)
    if not detail:
        history = None
    elif history is None:
        history = [
            StatusChange(status=e.status, at=e.at, message=e.message)
            for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.seq))
        ]
    if attempts is None:
        attempts = attempts_public(session, [job.id])[job.id]
    nodes = [p.node for p in attempts[-1].placements] if attempts else []
    # Each kind shows its own fields; the common ones are set below.
    own = kind_of(job).shown(job)
    return JobPublic(
        **own,
        id=job.id,
        type=job.type,
        name=job.name,
        owner=job.owner_id,
        team=_team_name(session, job.team_id, team_names),
        status=job.status,
        resources=spec["resources"],
        priority=job.priority,
        reason=job.wait_reason,
        failure=failure,
        progress=progress_public(job.status, job.progress, utcnow()),
        best=job.best,
        result=job.result,
        model_sha256=job.model_sha256,
        model_size=job.model_size,
        metric_points=job.metric_points or 0,
        metrics_dropped=job.metrics_dropped or 0,
        nodes=nodes,
        restarts=job.restarts or 0,
        attempts=attempts,
        history=history,
        created_at=job.created_at,
        updated_at=job.updated_at,
        scheduled_at=job.scheduled_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        cancel_requested_at=job.cancel_requested_at,
        tags=job.tags or [],
        note=job.note,
        cancel_reason=job.cancel_reason,
        sweep_id=job.sweep_id,
        trial_number=job.trial_number,
    )


def team_names_of(session: Session, jobs: list[Job]) -> dict[str, str]:
    """The names of the jobs' teams, by team id, in one query."""
    ids = {job.team_id for job in jobs if job.team_id is not None}
    if not ids:
        return {}
    return {
        team_id: name for team_id, name in session.execute(select(Team.id, Team.name).where(Team.id.in_(ids)))
    }


def _team_name(session: Session, team_id: str | None, known: dict[str, str] | None) -> str | None:
    if team_id is None:
        return None
    if known is not None and team_id in known:
        return known[team_id]
    team = session.get(Team, team_id)
    return team.name if team is not None else None


def submitted_public(session: Session, job: Job) -> JobPublic:
    """What a submission answers: the job just queued (and committed) by this session, as
    :func:`job_public` shows it, without reading back what the submission wrote: no
    attempt yet, and its one status change, ``queued``."""
    return job_public(session, job, attempts=[], history=[submitted_change(job)])


def update_job(session: Session, principal: Principal, job_ref: str, update: JobUpdate) -> Job:
    """Replace the job's tags and/or note (those fields the request gives), at any status."""
    job = get_job(session, principal, job_ref, for_update=True, write=True)
    given = update.model_fields_set
    if "tags" in given:
        # Order kept, repeats dropped.
        job.tags = list(dict.fromkeys(update.tags or []))
    if "note" in given:
        job.note = update.note or None
    job.updated_at = utcnow()
    session.commit()
    return job


def clone_spec(job: Job) -> dict[str, Any]:
    """The request that submits ``job`` again: its stored spec, cut to the fields its type's
    request takes (every default was filled in at submission, so the copy trains the same)."""
    fields = JOB_CREATE_MODELS[job.type].model_fields
    return {k: v for k, v in job.spec.items() if k in fields} | {"type": job.type}


def clone_job(session: Session, settings: Settings, principal: Principal, job_ref: str) -> Job:
    """Submit a copy of a job (any status) as a new job, checked as any submission is."""
    source = get_job(session, principal, job_ref)
    spec = JOB_CREATE.validate_python(clone_spec(source))
    return submit_job(session, settings, principal, spec)

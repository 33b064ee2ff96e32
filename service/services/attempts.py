"""Attempts at run time: claims, heartbeats and the status agents report for their placements.

Every write here happens under the job's row lock (taken before any of its
placements), so reports from several nodes of one attempt, the reaper of any API
replica and a user's cancel serialise per job. Placement rows are locked in id order.

Rules:

* a claim hands the node its oldest ``assigned`` placement of a live attempt, marks
  it ``running`` (claimed) and renews its lease;
* the first ``running`` report of any node makes the attempt and the job running;
* node rank 0's ``succeeded`` (after the model upload recorded ``model_sha256``)
  makes them succeeded; for a script job with ``"outputs": "all"`` the last node's
  ``succeeded`` does (every node uploads its outputs before it reports);
* any ``failed`` fails the attempt and the job with that failure — the first one
  wins — and the other nodes are told to stop at their next heartbeat; a retryable
  failure with restarts left puts the job back to ``queued`` instead (a restart);
* ``preempted`` (or any end of a placement of an attempt asked to preempt, after a
  drain) ends the attempt ``preempted`` once all its placements are done, and the
  job goes back to ``queued`` with reason ``preempted`` (no restart counted);
* a ``cancelling`` job becomes ``cancelled`` once every placement is done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Attempt, Job, Node, Placement, utcnow
from service.services.jobs import transition
from service.services.kinds import kind_of
from service.services.kinds.base import Claim
from service.services.leases import lock_lease
from service.services.nodes import get_own_node, touch_node
from service.services.scheduler import is_postgres
from service.services.tokens import Principal
from service.services.transitions import set_attempt_status, set_placement_status
from service.states import (
    ABORTED_ATTEMPT_STATUSES,
    ENGINE_AGENTS,
    LIVE_ATTEMPT_STATUSES,
    PLACED_STATUSES,
    AttemptStatus,
    JobStatus,
    NodeStatus,
    PlacementStatus,
)
from torchyard.contract.errors import (
    ConflictError,
    JobTimeoutError,
    RankFailedError,
    WorkerLostError,
    is_retryable,
)
from torchyard.contract.failures import Failure
from torchyard.contract.jobspec import DEFAULT_MAX_RESTARTS
from torchyard.contract.protocol import (
    ClaimedPlacement,
    HeartbeatResponse,
    LeaseRenewal,
    PlacementStatusReport,
    PlacementStatusResponse,
    StopOrder,
)

log = logging.getLogger(__name__)


def _lock_job(session: Session, job_id: str) -> Job:
    return session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()


def _lock_attempt(session: Session, attempt_id: str) -> Attempt:
    return session.scalars(select(Attempt).where(Attempt.id == attempt_id).with_for_update()).one()


def _end_attempt(
    attempt: Attempt, status: AttemptStatus, now: datetime, failure: Failure | None = None
) -> None:
    set_attempt_status(attempt, status, now)
    if failure is not None:
        attempt.failure_code = failure.code
        attempt.failure_message = failure.message


def fail_attempt(session: Session, job: Job, attempt: Attempt, failure: Failure, message: str) -> None:
    """Fail a live attempt and, unless it is being cancelled, its job (first failure wins).

    A retryable failure (docs/restarts.md, ``RETRYABLE_FAILURES``) with restarts left puts the job back
    to ``queued`` instead (see :func:`restart_verdict`). An attempt that already ended (a late
    report of a node of an attempt that failed elsewhere) changes nothing of the job: the job
    may already run a newer attempt.
    """
    if attempt.status not in LIVE_ATTEMPT_STATUSES:
        return
    now = utcnow()
    _end_attempt(attempt, AttemptStatus.FAILED, now, failure)
    if job.status not in PLACED_STATUSES or job.failure_code is not None:
        return
    restart = restart_verdict(session, job, attempt, failure)
    if restart is None:
        transition(session, job, JobStatus.FAILED, message, failure=failure)
        return
    job.restarts = (job.restarts or 0) + 1
    requeue(session, job, restart)
    log.warning("job %s: %s", job.id, restart)


def max_restarts(job: Job) -> int:
    value = ((job.spec or {}).get("resources") or {}).get("max_restarts", DEFAULT_MAX_RESTARTS)
    return int(value)


def restart_verdict(session: Session, job: Job, attempt: Attempt, failure: Failure) -> str | None:
    """The requeue reason if ``failure`` ending ``attempt`` earns a restart, else None (final).

    A restart needs a retryable code, a restart left, and a failure other than the previous
    attempt's (the same code and message on two attempts in a row is final).
    """
    if not is_retryable(failure.code):
        return None
    allowed = max_restarts(job)
    used = job.restarts or 0
    if used >= allowed:
        return None
    previous = session.scalars(
        select(Attempt)
        .where(Attempt.job_id == job.id, Attempt.number < attempt.number)
        .order_by(Attempt.number.desc())
    ).first()
    if (
        previous is not None
        and previous.status == AttemptStatus.FAILED
        and (previous.failure_code, previous.failure_message) == (failure.code, failure.message)
    ):
        return None
    where = f" on node {failure.node}" if failure.node else ""
    return f"restarting after {failure.code}{where} (restart {used + 1} of {allowed})"


def requeue(session: Session, job: Job, reason: str) -> None:
    """Put a placed job back to ``queued`` with ``reason`` (a restart or a preemption)."""
    transition(session, job, JobStatus.QUEUED, reason)
    job.requeue_reason = reason
    job.wait_reason = reason


def finish_cancellation(session: Session, job: Job) -> bool:
    """A cancelling job whose placements are all done becomes cancelled; True if it did."""
    if job.status != JobStatus.CANCELLING:
        return False
    open_count = session.scalar(
        select(func.count(Placement.id)).where(
            Placement.job_id == job.id, Placement.status != PlacementStatus.DONE
        )
    )
    if open_count:
        return False
    now = utcnow()
    for attempt in session.scalars(
        select(Attempt)
        .where(Attempt.job_id == job.id, Attempt.status.in_(LIVE_ATTEMPT_STATUSES))
        .with_for_update()
    ):
        _end_attempt(attempt, AttemptStatus.CANCELLED, now)
    transition(session, job, JobStatus.CANCELLED, "every rank stopped")
    return True


def finish_preemption(session: Session, job: Job, attempt: Attempt) -> bool:
    """A live attempt being preempted whose placements are all done ends ``preempted``, and
    its job goes back to ``queued`` (reason ``preempted``, no restart counted); True if it did."""
    if attempt.status not in LIVE_ATTEMPT_STATUSES or attempt.preempt_requested_at is None:
        return False
    if attempt.engine != ENGINE_AGENTS and attempt.engine_state is None:
        # An engine's job (Slurm's) says how it ended: preempted, or cancelled from outside.
        return False
    open_count = session.scalar(
        select(func.count(Placement.id)).where(
            Placement.attempt_id == attempt.id, Placement.status != PlacementStatus.DONE
        )
    )
    if open_count:
        return False
    _end_attempt(attempt, AttemptStatus.PREEMPTED, utcnow())
    attempt.failure_message = (
        "preempted: a node of the attempt was drained"
        if attempt.engine == ENGINE_AGENTS
        else f"preempted: {attempt.engine} stopped its job ({attempt.engine_state})"
    )
    if job.status in PLACED_STATUSES:
        requeue(session, job, "preempted")
        log.info("job %s: attempt %d preempted, back to the queue", job.id, attempt.number)
    return True


def preempt_node_attempts(session: Session, node: Node) -> list[str]:
    """Ask every live attempt with a placement on ``node`` to checkpoint and stop.

    Placements not yet claimed have no process: they are done at once, and an attempt with
    nothing left running is preempted here. Returns the ids of the jobs touched. The caller
    holds no job lock yet (jobs are locked here, one by one, before their placements).
    """
    job_ids = list(
        session.scalars(
            select(Placement.job_id)
            .where(Placement.node_id == node.id, Placement.status != PlacementStatus.DONE)
            .distinct()
            .order_by(Placement.job_id)
        )
    )
    now = utcnow()
    for job_id in job_ids:
        job = _lock_job(session, job_id)
        for attempt in session.scalars(
            select(Attempt)
            .where(Attempt.job_id == job_id, Attempt.status.in_(LIVE_ATTEMPT_STATUSES))
            .with_for_update()
            .execution_options(populate_existing=True)
        ).all():
            if attempt.preempt_requested_at is None:
                attempt.preempt_requested_at = now
            for placement in session.scalars(
                select(Placement)
                .where(Placement.attempt_id == attempt.id, Placement.status == PlacementStatus.ASSIGNED)
                .order_by(Placement.id)
                .with_for_update()
            ):
                set_placement_status(placement, PlacementStatus.DONE, now)
            finish_preemption(session, job, attempt)
        finish_cancellation(session, job)
    return job_ids


# --- claim -------------------------------------------------------------------------------


def claimed_placement(session: Session, placement: Placement, settings: Settings) -> ClaimedPlacement:
    """What the node that claimed ``placement`` needs to launch it (its kind's payload)."""
    job = session.get_one(Job, placement.job_id)
    attempt = session.get_one(Attempt, placement.attempt_id)
    common: dict[str, Any] = {
        "job_id": job.id,
        "job_name": job.name,
        "attempt_id": attempt.id,
        "attempt_number": attempt.number,
        "lease_token": placement.lease_token,
        "lease_expires_at": placement.lease_expires_at,
        "node_rank": placement.node_rank,
        "node_count": job.node_count,
        "process_count_per_node": job.process_count_per_node,
        "world_size": job.node_count * job.process_count_per_node,
        "master_addr": attempt.master_addr,
        "master_port": attempt.master_port,
        "restarts": job.restarts or 0,
        "heartbeat_interval_s": settings.heartbeat_interval_s,
        "lease_timeout_s": settings.lease_timeout_s,
    }
    return kind_of(job).claimed(session, job, Claim(attempt, placement, common, settings))


@dataclass
class ClaimCheck:
    """What one claim check found: the placement handed over (or None), the node's id, and
    whether the check brought a lost node back (capacity for a scheduling pass)."""

    placement: ClaimedPlacement | None
    node_id: str
    revived: bool = False


def claim(
    session: Session,
    settings: Settings,
    principal: Principal,
    node_name: str,
    *,
    fresh: bool = True,
) -> ClaimCheck:
    """Hand the node its next assigned placement, if a scheduling pass put one there.

    Only the node's own placements are read: scheduling happens elsewhere (see
    :mod:`service.services.scheduler_loop`). ``fresh``: the agent has just asked (a sign of
    life: the node is touched, and a lost node is ready again). A re-check of a long-poll
    the API holds (``fresh=False``) says nothing of the agent, which may have died or frozen
    since it asked: it neither touches the node nor revives a lost one (nor hands a lost
    node work). The caller commits.
    """
    node = get_own_node(session, principal, node_name)
    revived = False
    if fresh:
        revived = touch_node(session, node)
    elif node.status == NodeStatus.LOST:
        return ClaimCheck(None, node.id)
    stmt = (
        select(Placement)
        .join(Job, Job.id == Placement.job_id)
        .join(Attempt, Attempt.id == Placement.attempt_id)
        .where(
            Placement.node_id == node.id,
            Placement.status == PlacementStatus.ASSIGNED,
            Job.status.in_(PLACED_STATUSES),
            Attempt.status.in_(LIVE_ATTEMPT_STATUSES),
            Attempt.preempt_requested_at.is_(None),
        )
        .order_by(Placement.created_at, Placement.id)
        .limit(1)
    )
    if is_postgres(session):
        stmt = stmt.with_for_update(skip_locked=True, of=Placement)
    placement = session.scalars(stmt).first()
    if placement is None:
        return ClaimCheck(None, node.id, revived)
    now = utcnow()
    set_placement_status(placement, PlacementStatus.RUNNING, now)
    placement.lease_expires_at = now + timedelta(seconds=settings.lease_timeout_s)
    log.info("node %s claimed job %s (node rank %d)", node.name, placement.job_id, placement.node_rank)
    return ClaimCheck(claimed_placement(session, placement, settings), node.id, revived)


def work_pending(session: Session, node_id: str) -> bool:
    """Read-only: whether the node has an assigned placement (its own rows only)."""
    assigned = session.scalars(
        select(Placement.id)
        .where(Placement.node_id == node_id, Placement.status == PlacementStatus.ASSIGNED)
        .limit(1)
    ).first()
    return assigned is not None


# --- heartbeat ---------------------------------------------------------------------------


def heartbeat(
    session: Session,
    settings: Settings,
    principal: Principal,
    node_name: str,
    leases: list[str],
    *,
    node: Node | None = None,
) -> HeartbeatResponse:
    """Renew the node and the leases it lists; say which placements must stop. The caller commits.
    ``node``: its row, already read and locked by the caller."""
    if node is None:
        node = get_own_node(session, principal, node_name, for_update=True)
    touch_node(session, node)
    renewed, stop = renew_leases(
        session,
        settings,
        leases,
        owns=lambda placement: placement.node_id == node.id,
        draining=node.status != NodeStatus.READY,
    )
    return HeartbeatResponse(
        node=node.name,
        status=node.status,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        lease_timeout_s=settings.lease_timeout_s,
        claim_poll_timeout_s=settings.claim_poll_timeout_s,
        renewed=renewed,
        stop=stop,
    )


def renew_leases(
    session: Session,
    settings: Settings,
    leases: list[str],
    *,
    owns: Callable[[Placement], bool],
    draining: bool = False,
) -> tuple[list[LeaseRenewal], list[StopOrder]]:
    """Renew the listed leases the caller ``owns`` (another's count as unknown) and say which
    placements must stop: finished, cancelling, preempted (``draining``: the node of a
    resident agent is drained), or of an attempt that ended."""
    now = utcnow()
    expires = now + timedelta(seconds=settings.lease_timeout_s)
    wanted = set(leases)
    rows = (
        session.execute(
            select(Placement, Attempt, Job.status)
            .join(Attempt, Attempt.id == Placement.attempt_id)
            .join(Job, Job.id == Placement.job_id)
            .where(Placement.lease_token.in_(wanted))
            .order_by(Placement.id)
            .with_for_update(of=Placement)
        ).all()
        if wanted
        else []
    )
    renewed: list[LeaseRenewal] = []
    stop: list[StopOrder] = []
    seen: set[str] = set()
    for placement, attempt, job_status in rows:
        token = placement.lease_token
        if not owns(placement):
            continue  # another node's token: treated as unknown below
        seen.add(token)
        if placement.status == PlacementStatus.DONE:
            stop.append(
                StopOrder(
                    lease_token=token,
                    job_id=placement.job_id,
                    reason="stale",
                    message="the placement is finished",
                )
            )
            continue
        # A lease past its expiry but not ended by the reaper is renewed: it ran out while
        # nobody could hear the node (the API or its database was down), and only the
        # reaper, after its grace period, decides that a node is gone.
        placement.lease_expires_at = expires
        renewed.append(LeaseRenewal(lease_token=token, lease_expires_at=expires))
        if job_status == JobStatus.CANCELLING:
            stop.append(
                StopOrder(
                    lease_token=token,
                    job_id=placement.job_id,
                    reason="cancelled",
                    message="the job is being cancelled",
                )
            )
        elif attempt.status in LIVE_ATTEMPT_STATUSES and (
            attempt.preempt_requested_at is not None or draining
        ):
            if attempt.preempt_requested_at is None:
                attempt.preempt_requested_at = now
            stop.append(
                StopOrder(
                    lease_token=token,
                    job_id=placement.job_id,
                    reason="preempted",
                    message=f"attempt {attempt.number} is preempted (a node of it is draining): "
                    "checkpoint at the next step boundary, upload it, then report preempted",
                )
            )
        elif attempt.status in ABORTED_ATTEMPT_STATUSES:
            stop.append(
                StopOrder(
                    lease_token=token,
                    job_id=placement.job_id,
                    reason="attempt_ended",
                    message=f"attempt {attempt.number} {attempt.status}"
                    + (f": {attempt.failure_message}" if attempt.failure_message else ""),
                )
            )
    for token in sorted(wanted - seen):
        stop.append(StopOrder(lease_token=token, reason="stale", message="unknown lease token"))
    return renewed, stop


# --- status reports ----------------------------------------------------------------------


def _stop_reason(job: Job, attempt: Attempt) -> str | None:
    if job.status == JobStatus.CANCELLING:
        return "the job is being cancelled"
    if attempt.status in ABORTED_ATTEMPT_STATUSES:
        return f"attempt {attempt.number} {attempt.status}"
    if attempt.preempt_requested_at is not None:
        return f"attempt {attempt.number} is preempted"
    return None


def report_status(
    session: Session, principal: Principal, lease_token: str | None, report: PlacementStatusReport
) -> tuple[PlacementStatusResponse, bool]:
    """Apply one node's report on its placement. Returns the answer and whether the placement
    ended (capacity was freed). The caller commits."""
    job, placement = lock_lease(session, principal, lease_token)
    now = utcnow()
    attempt = _lock_attempt(session, placement.attempt_id)
    node = session.get_one(Node, placement.node_id)
    ended = False

    if report.state == "running":
        _report_running(session, job, attempt, placement, node, now)
    else:
        _report_ended(session, job, attempt, placement, node, report, now)
        ended = True
    reason = _stop_reason(job, attempt)
    answer = PlacementStatusResponse(
        job_id=job.id,
        job_status=job.status,
        attempt_status=attempt.status,
        placement_status=placement.status,
        stop=reason is not None and placement.status != PlacementStatus.DONE,
        reason=reason,
    )
    return answer, ended


def _report_running(
    session: Session, job: Job, attempt: Attempt, placement: Placement, node: Node, now: datetime
) -> None:
    set_placement_status(placement, PlacementStatus.RUNNING, now)
    if attempt.status is AttemptStatus.SCHEDULED:
        set_attempt_status(attempt, AttemptStatus.RUNNING, now)
    if job.status == JobStatus.SCHEDULED and attempt.status in LIVE_ATTEMPT_STATUSES:
        transition(session, job, JobStatus.RUNNING, f"ranks started on {node.name}")


def _report_ended(
    session: Session,
    job: Job,
    attempt: Attempt,
    placement: Placement,
    node: Node,
    report: PlacementStatusReport,
    now: datetime,
) -> None:
    """A final report: the placement is done, and the attempt and job follow."""
    if report.state == "succeeded":
        _check_kept(job, placement)
    set_placement_status(placement, PlacementStatus.DONE, now)
    placement.exit_code = report.exit_code
    if report.state == "succeeded":
        _report_succeeded(session, job, attempt, placement, node, now)
    elif report.state == "failed":
        _report_failed(session, job, attempt, _failure(report, node.name), node)
    if attempt.status in LIVE_ATTEMPT_STATUSES and (
        report.state == "preempted" or attempt.preempt_requested_at is not None
    ):
        if attempt.preempt_requested_at is None:
            # The node's agent got SIGTERM: its peers checkpoint and stop too.
            attempt.preempt_requested_at = now
        finish_preemption(session, job, attempt)
    finish_cancellation(session, job)


def _check_kept(job: Job, placement: Placement) -> None:
    """Node rank 0's success comes after what its kind keeps of it (the model directory)."""
    if (
        placement.node_rank == 0
        and kind_of(job).keeps_model
        and job.status in PLACED_STATUSES
        and job.model_sha256 is None
    ):
        raise ConflictError("node rank 0 reported success before its model directory was uploaded")


def _report_succeeded(
    session: Session, job: Job, attempt: Attempt, placement: Placement, node: Node, now: datetime
) -> None:
    if attempt.status not in LIVE_ATTEMPT_STATUSES or not _attempt_succeeded(
        session, job, attempt, placement
    ):
        return
    _end_attempt(attempt, AttemptStatus.SUCCEEDED, now)
    if job.status in PLACED_STATUSES:
        kind = kind_of(job)
        on = "every node" if kind.waits_for_every_node(job) else node.name
        transition(session, job, JobStatus.SUCCEEDED, f"{kind.work_name} finished on {on}")


def _report_failed(session: Session, job: Job, attempt: Attempt, failure: Failure, node: Node) -> None:
    if job.status == JobStatus.CANCELLING:
        log.info("job %s: %s failed while cancelling (%s)", job.id, node.name, failure.code)
    elif attempt.preempt_requested_at is not None and is_retryable(failure.code):
        # A peer stopping for the preemption broke a collective: part of the preemption.
        log.info("job %s: %s failed while preempted (%s)", job.id, node.name, failure.code)
    else:
        where = f"rank {failure.rank} on {failure.node}" if failure.rank is not None else failure.node
        fail_attempt(session, job, attempt, failure, f"{failure.code} ({where}): {failure.message}")


def _attempt_succeeded(session: Session, job: Job, attempt: Attempt, placement: Placement) -> bool:
    """Whether a success report (``placement`` is already done) ends the attempt succeeded.

    Node rank 0's success does, except for a script job with ``"outputs": "all"``: there
    every node's outputs are part of the result, so the attempt succeeds when no placement
    of it is left open (each node reports success after its upload; a failure or a lost
    node fails the attempt first, a drain preempts it).
    """
    if not kind_of(job).waits_for_every_node(job):
        return placement.node_rank == 0
    if attempt.preempt_requested_at is not None:
        return False
    open_count = session.scalar(
        select(func.count(Placement.id)).where(
            Placement.attempt_id == attempt.id, Placement.status != PlacementStatus.DONE
        )
    )
    return not open_count


def _failure(report: PlacementStatusReport, node_name: str) -> Failure:
    if report.failure is None:
        code = report.exit_code
        return Failure(
            code=RankFailedError.code,
            message=f"the ranks on node {node_name} exited with code {code}",
            node=node_name,
        )
    f = report.failure
    return Failure(
        code=f.code, message=f.message, rank=f.rank, node=f.node or node_name, traceback=f.traceback
    )


# --- loss of nodes and leases (used by the reaper) --------------------------------------------


def lose_placements(
    session: Session, job_id: str, placement_ids: list[str], message_for: dict[str, str]
) -> bool:
    """Mark placements whose node went silent as done and fail their live attempt.

    ``message_for`` maps a placement id to the failure message naming its node. Each
    placement is re-checked under the job's lock (another replica may have handled it).
    Returns True if anything changed.
    """
    job = _lock_job(session, job_id)
    placements = list(
        session.scalars(
            select(Placement)
            .where(Placement.id.in_(placement_ids), Placement.status != PlacementStatus.DONE)
            .order_by(Placement.id)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
    )
    if not placements:
        return False
    now = utcnow()
    for placement in placements:
        set_placement_status(placement, PlacementStatus.DONE, now)
        attempt = _lock_attempt(session, placement.attempt_id)
        node = session.get_one(Node, placement.node_id)
        message = message_for.get(placement.id) or f"node {node.name} stopped heartbeating"
        if attempt.status in LIVE_ATTEMPT_STATUSES and job.status != JobStatus.CANCELLING:
            failure = Failure(code=WorkerLostError.code, message=message, node=node.name)
            fail_attempt(session, job, attempt, failure, f"{WorkerLostError.code}: {message}")
    finish_cancellation(session, job)
    return True


def overrun_limit_s(spec: dict[str, Any] | None, started_at: datetime | None, now: datetime) -> int | None:
    """The job's ``resources.max_runtime_s`` if a job that started at ``started_at`` has
    reached it by ``now``; None when it has no limit, has not started or is within it."""
    limit = ((spec or {}).get("resources") or {}).get("max_runtime_s")
    if limit is None or started_at is None or started_at + timedelta(seconds=limit) > now:
        return None
    return int(limit)


def time_out(session: Session, job_id: str, now: datetime) -> bool:
    """Fail a running job that has outrun its ``max_runtime_s`` with ``TimeoutError``.

    Its live attempt fails with it, so every node is told to stop its ranks at its next
    heartbeat (as when a rank fails elsewhere). Re-checked under the job's lock; True if
    the job was timed out here.
    """
    job = _lock_job(session, job_id)
    limit = overrun_limit_s(job.spec, job.started_at, now)
    if job.status != JobStatus.RUNNING or limit is None:
        return False
    message = f"the job ran longer than its limit of {limit} s (resources.max_runtime_s)"
    failure = Failure(code=JobTimeoutError.code, message=message)
    attempts = session.scalars(
        select(Attempt)
        .where(Attempt.job_id == job.id, Attempt.status.in_(LIVE_ATTEMPT_STATUSES))
        .with_for_update()
    ).all()
    for attempt in attempts:
        fail_attempt(session, job, attempt, failure, f"{JobTimeoutError.code}: {message}")
    if job.status == JobStatus.RUNNING:  # no live attempt left to fail with it
        transition(session, job, JobStatus.FAILED, f"{JobTimeoutError.code}: {message}", failure=failure)
    return True

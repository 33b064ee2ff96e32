"""The status a node reports for its placement (``POST .../status``), and what follows.

Rules:

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

A report is applied under the job's row lock, then the attempt's (see
:mod:`service.services.attempt_outcomes`).
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy.orm import Session

from service.db.models import Attempt, Job, Node, Placement
from service.db.types import utcnow
from service.services.attempt_outcomes import (
    end_attempt,
    fail_attempt,
    finish_cancellation,
    finish_preemption,
    locked_attempt,
    open_placements,
)
from service.services.jobs import transition
from service.services.kinds import kind_of
from service.services.leases import lock_lease
from service.services.tokens import Principal
from service.services.transitions import set_attempt_status, set_placement_status
from service.states import (
    ABORTED_ATTEMPT_STATUSES,
    LIVE_ATTEMPT_STATUSES,
    PLACED_STATUSES,
    AttemptStatus,
    JobStatus,
    PlacementStatus,
)
from torchyard.contract.errors import ConflictError, RankFailedError, is_retryable
from torchyard.contract.failures import Failure
from torchyard.contract.protocol import PlacementStatusReport, PlacementStatusResponse

log = logging.getLogger(__name__)


def report_status(
    session: Session, principal: Principal, lease_token: str | None, report: PlacementStatusReport
) -> tuple[PlacementStatusResponse, bool]:
    """Apply one node's report on its placement. Returns the answer and whether the placement
    ended (capacity was freed). The caller commits."""
    job, placement = lock_lease(session, principal, lease_token)
    now = utcnow()
    attempt = locked_attempt(session, placement.attempt_id)
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


def _stop_reason(job: Job, attempt: Attempt) -> str | None:
    if job.status == JobStatus.CANCELLING:
        return "the job is being cancelled"
    if attempt.status in ABORTED_ATTEMPT_STATUSES:
        return f"attempt {attempt.number} {attempt.status}"
    if attempt.preempt_requested_at is not None:
        return f"attempt {attempt.number} is preempted"
    return None


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
    end_attempt(attempt, AttemptStatus.SUCCEEDED, now)
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
    return not open_placements(session, Placement.attempt_id == attempt.id)


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

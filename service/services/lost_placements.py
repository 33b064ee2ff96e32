"""Placements whose node is gone: done, and their live attempt failed with
``WorkerLostError`` naming the node (the job restarts or fails, as ``max_restarts`` says).

A lease ran out, a node went silent or its engine lost it, or its agent restarted without
its ranks: every such placement ends here.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.engine import Database
from service.db.models import Node, Placement
from service.db.types import utcnow
from service.services.attempt_outcomes import fail_attempt, finish_cancellation, locked_attempt, locked_job
from service.services.transitions import set_placement_status
from service.states import LIVE_ATTEMPT_STATUSES, JobStatus, PlacementStatus
from torchyard.contract.errors import WorkerLostError
from torchyard.contract.failures import Failure


def lose_placements(
    session: Session, job_id: str, placement_ids: list[str], message_for: dict[str, str]
) -> bool:
    """Mark placements whose node went silent as done and fail their live attempt.

    ``message_for`` maps a placement id to the failure message naming its node. Each
    placement is re-checked under the job's lock (another replica may have handled it).
    Returns True if anything changed.
    """
    job = locked_job(session, job_id)
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
        attempt = locked_attempt(session, placement.attempt_id)
        node = session.get_one(Node, placement.node_id)
        message = message_for.get(placement.id) or f"node {node.name} stopped heartbeating"
        if attempt.status in LIVE_ATTEMPT_STATUSES and job.status != JobStatus.CANCELLING:
            failure = Failure(code=WorkerLostError.code, message=message, node=node.name)
            fail_attempt(session, job, attempt, failure, f"{WorkerLostError.code}: {message}")
    finish_cancellation(session, job)
    return True


def unfinished_placements(
    session: Session, node_id: str, *, claimed_only: bool = False
) -> list[tuple[str, str]]:
    """(job id, placement id) of every placement of the node that is not done (with
    ``claimed_only``, of those an agent has claimed: the ones with processes behind them)."""
    wanted = (
        [PlacementStatus.RUNNING] if claimed_only else [PlacementStatus.ASSIGNED, PlacementStatus.RUNNING]
    )
    rows = session.execute(
        select(Placement.job_id, Placement.id).where(
            Placement.node_id == node_id, Placement.status.in_(wanted)
        )
    ).all()
    return [(job_id, placement_id) for job_id, placement_id in rows]


def lose_node_placements(
    db: Database,
    node_id: str,
    message: str,
    known: dict[str, str] | None = None,
    rows: list[tuple[str, str]] | None = None,
) -> int:
    """Every placement of the node that is not done is lost (its job fails, ``message``
    naming the node): the node went silent, or its agent restarted without its ranks.
    ``known`` gives a placement's own message where it was lost for a reason of its own;
    ``rows`` (from :func:`unfinished_placements`) limits it to the placements read then."""
    if rows is None:
        with db.read_session() as session:
            rows = unfinished_placements(session, node_id)
    by_job: dict[str, list[str]] = {}
    for job_id, placement_id in rows:
        by_job.setdefault(job_id, []).append(placement_id)
    own = known or {}
    for job_id, placement_ids in by_job.items():
        with db.transaction() as session:
            messages = {pid: own.get(pid, message) for pid in placement_ids}
            lose_placements(session, job_id, placement_ids, messages)
    return len(rows)

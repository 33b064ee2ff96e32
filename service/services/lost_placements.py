"""Placements whose node is gone: done, and their live attempt failed with
``WorkerLostError`` naming the node (the job restarts or fails, as ``max_restarts`` says).

A lease ran out, a node went silent or its engine lost it, or its agent restarted without
its ranks: every such placement ends here.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Node, Placement, utcnow
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

"""Every status write of an attempt, a placement or a node goes through here.

Each function moves its row to ``new`` if the row type's table in :mod:`service.states`
allows the move (``ATTEMPT_TRANSITIONS``, ``PLACEMENT_TRANSITIONS``, ``NODE_TRANSITIONS``),
stamps what the move dates, and raises ``IllegalTransitionError`` otherwise: a move the
tables do not list is a bug. Writing the status a row already has changes nothing (a
report repeated, an inventory mirrored again). A row not flushed yet (no status) takes any.
The caller holds the row and commits. Jobs have theirs: :func:`service.services.jobs.transition`.
"""

from __future__ import annotations

from datetime import datetime

from service.db.models import Attempt, Node, Placement
from service.states import (
    ATTEMPT_TRANSITIONS,
    FINAL_ATTEMPT_STATUSES,
    NODE_TRANSITIONS,
    PLACEMENT_TRANSITIONS,
    AttemptStatus,
    NodeStatus,
    PlacementStatus,
)
from torchyard.contract.errors import IllegalTransitionError


def set_attempt_status(attempt: Attempt, new: AttemptStatus, now: datetime) -> bool:
    """Move ``attempt`` to ``new``: ``running`` starts it at ``now``, a final status ends it
    at ``now``. True if it moved."""
    current: AttemptStatus | None = attempt.status
    if current == new:
        return False
    if current is not None and new not in ATTEMPT_TRANSITIONS[current]:
        raise IllegalTransitionError(f"attempt {attempt.id} cannot go from {current} to {new}")
    attempt.status = new
    if new is AttemptStatus.RUNNING:
        attempt.started_at = now
    elif new in FINAL_ATTEMPT_STATUSES:
        attempt.finished_at = now
    return True


def set_placement_status(placement: Placement, new: PlacementStatus, now: datetime) -> bool:
    """Move ``placement`` to ``new``: ``done`` ends it at ``now`` (its units are free). True if
    it moved."""
    current: PlacementStatus | None = placement.status
    if current == new:
        return False
    if current is not None and new not in PLACEMENT_TRANSITIONS[current]:
        raise IllegalTransitionError(f"placement {placement.id} cannot go from {current} to {new}")
    placement.status = new
    if new is PlacementStatus.DONE:
        placement.finished_at = now
    return True


def set_node_status(node: Node, new: NodeStatus) -> bool:
    """Move ``node`` to ``new``. True if it moved."""
    current: NodeStatus | None = node.status
    if current == new:
        return False
    if current is not None and new not in NODE_TRANSITIONS[current]:
        raise IllegalTransitionError(f"node {node.name} cannot go from {current} to {new}")
    node.status = new
    return True

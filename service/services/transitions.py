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
from enum import StrEnum
from typing import TypeVar

from service.db.models import Attempt, Node, Placement
from service.services import metrics
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

S = TypeVar("S", bound=StrEnum)


def set_attempt_status(attempt: Attempt, new: AttemptStatus, now: datetime) -> bool:
    """Move ``attempt`` to ``new``: ``running`` starts it at ``now``, a final status ends it
    at ``now``. True if it moved."""
    if not _is_move(f"attempt {attempt.id}", attempt.status, new, ATTEMPT_TRANSITIONS):
        return False
    attempt.status = new
    if new is AttemptStatus.RUNNING:
        attempt.started_at = now
    elif new in FINAL_ATTEMPT_STATUSES:
        attempt.finished_at = now
        # torchyard_attempts_ended_total, once this write commits (with its failure code).
        metrics.attempt_ended(attempt, new.value)
    return True


def set_placement_status(placement: Placement, new: PlacementStatus, now: datetime) -> bool:
    """Move ``placement`` to ``new``: ``done`` ends it at ``now`` (its units are free). True if
    it moved."""
    if not _is_move(f"placement {placement.id}", placement.status, new, PLACEMENT_TRANSITIONS):
        return False
    placement.status = new
    if new is PlacementStatus.DONE:
        placement.finished_at = now
    return True


def set_node_status(node: Node, new: NodeStatus) -> bool:
    """Move ``node`` to ``new``. True if it moved."""
    if not _is_move(f"node {node.name}", node.status, new, NODE_TRANSITIONS):
        return False
    node.status = new
    return True


def _is_move(row: str, current: S | None, new: S, table: dict[S, frozenset[S]]) -> bool:
    """Whether writing ``new`` over ``current`` moves the row (not when it is the status it
    has); a move ``table`` does not list raises."""
    if current == new:
        return False
    if current is not None and new not in table[current]:
        raise IllegalTransitionError(f"{row} cannot go from {current} to {new}")
    return True

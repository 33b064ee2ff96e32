"""The state machines of attempts, placements and nodes (service.states), and the one
function per row type every status write goes through (service.services.transitions)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from service.db.models import Attempt, Node, Placement
from service.services.transitions import set_attempt_status, set_node_status, set_placement_status
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

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


def test_every_status_has_a_row_in_its_table() -> None:
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptStatus)
    assert set(PLACEMENT_TRANSITIONS) == set(PlacementStatus)
    assert set(NODE_TRANSITIONS) == set(NodeStatus)


def test_an_attempt_ends_once_and_a_placement_is_done_for_good() -> None:
    for status in AttemptStatus:
        assert (ATTEMPT_TRANSITIONS[status] == frozenset()) == (status in FINAL_ATTEMPT_STATUSES)
    assert PLACEMENT_TRANSITIONS[PlacementStatus.DONE] == frozenset()
    for table in (ATTEMPT_TRANSITIONS, PLACEMENT_TRANSITIONS, NODE_TRANSITIONS):
        assert all(status not in moves for status, moves in table.items())  # no move to itself


def test_an_attempt_is_stamped_when_it_starts_and_when_it_ends() -> None:
    attempt = Attempt(id="a1", status=AttemptStatus.SCHEDULED)
    assert set_attempt_status(attempt, AttemptStatus.RUNNING, NOW)
    assert attempt.status is AttemptStatus.RUNNING and attempt.started_at == NOW
    assert not set_attempt_status(attempt, AttemptStatus.RUNNING, NOW)  # the same status: no move
    assert set_attempt_status(attempt, AttemptStatus.FAILED, NOW)
    assert attempt.finished_at == NOW
    with pytest.raises(IllegalTransitionError, match="attempt a1 cannot go from failed to running"):
        set_attempt_status(attempt, AttemptStatus.RUNNING, NOW)
    assert attempt.status is AttemptStatus.FAILED


@pytest.mark.parametrize("end", sorted(FINAL_ATTEMPT_STATUSES))
def test_a_scheduled_attempt_may_end_before_it_ran(end: AttemptStatus) -> None:
    attempt = Attempt(id="a1", status=AttemptStatus.SCHEDULED)
    assert set_attempt_status(attempt, end, NOW)
    assert attempt.finished_at == NOW and attempt.started_at is None


def test_a_placement_is_done_once() -> None:
    placement = Placement(id="p1", status=PlacementStatus.ASSIGNED)
    assert set_placement_status(placement, PlacementStatus.RUNNING, NOW)
    assert placement.finished_at is None
    assert set_placement_status(placement, PlacementStatus.DONE, NOW)
    assert placement.finished_at == NOW
    with pytest.raises(IllegalTransitionError, match="placement p1 cannot go from done to running"):
        set_placement_status(placement, PlacementStatus.RUNNING, NOW)
    unclaimed = Placement(id="p2", status=PlacementStatus.ASSIGNED)
    assert set_placement_status(unclaimed, PlacementStatus.DONE, NOW)


def test_node_moves() -> None:
    node = Node(name="n1", status=NodeStatus.READY)
    assert set_node_status(node, NodeStatus.LOST)
    assert set_node_status(node, NodeStatus.DRAINING)
    assert set_node_status(node, NodeStatus.READY)
    assert not set_node_status(node, NodeStatus.READY)
    assert set_node_status(node, NodeStatus.DRAINED)
    with pytest.raises(IllegalTransitionError, match="node n1 cannot go from drained to draining"):
        set_node_status(node, NodeStatus.DRAINING)
    fresh = Node(name="n2")  # not flushed yet: no status, any first one
    assert set_node_status(fresh, NodeStatus.DRAINED) and fresh.status is NodeStatus.DRAINED

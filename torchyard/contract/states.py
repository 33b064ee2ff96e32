"""Status and role names of the contract: jobs, attempts, placements, nodes, tokens.

The API's state machine over them (which moves are allowed) is in ``service.states``.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def is_final(self) -> bool:
        return self in FINAL_STATUSES

    def is_live(self) -> bool:
        """Placed on nodes (or about to be): holds processing units."""
        return self in LIVE_STATUSES


FINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
LIVE_STATUSES = frozenset({JobStatus.SCHEDULED, JobStatus.RUNNING, JobStatus.CANCELLING})
ACTIVE_STATUSES = frozenset({JobStatus.QUEUED}) | LIVE_STATUSES


class AttemptStatus(StrEnum):
    SCHEDULED = "scheduled"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # Its nodes were drained (or their agents got SIGTERM): the ranks checkpointed and
    # stopped, and the job went back to ``queued`` without counting a restart.
    PREEMPTED = "preempted"


LIVE_ATTEMPT_STATUSES = frozenset({AttemptStatus.SCHEDULED, AttemptStatus.RUNNING})


class NodeStatus(StrEnum):
    READY = "ready"
    LOST = "lost"
    # Drained by an admin or preempted (its agent got SIGTERM): no new placements;
    # ``draining`` while its ranks still checkpoint and stop, then ``drained``.
    DRAINING = "draining"
    DRAINED = "drained"


class Role(StrEnum):
    ADMIN = "admin"
    USER = "user"
    WORKER = "worker"


class PlacementStatus(StrEnum):
    """One node's share of an attempt: ``assigned`` until its ranks start, ``running``,
    then ``done`` (its units are free again)."""

    ASSIGNED = "assigned"
    RUNNING = "running"
    DONE = "done"

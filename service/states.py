"""The job state machine (SPEC §5), in one place.

``queued`` → ``scheduled`` (placed on nodes) → ``running`` → ``succeeded`` | ``failed`` |
``cancelled``, with ``cancelling`` between a cancel request and the ranks being stopped.
A scheduled or running job whose attempt is lost may go back to ``queued`` for a retry.
"""

from __future__ import annotations

from enum import StrEnum

from torchyard.contract.states import (
    ACTIVE_STATUSES,
    FINAL_STATUSES,
    LIVE_ATTEMPT_STATUSES,
    LIVE_STATUSES,
    AttemptStatus,
    JobStatus,
    NodeStatus,
    PlacementStatus,
    Role,
)

__all__ = [
    "ACTIVE_STATUSES",
    "FINAL_STATUSES",
    "LIVE_ATTEMPT_STATUSES",
    "LIVE_STATUSES",
    "TRANSITIONS",
    "AttemptStatus",
    "JobStatus",
    "NodeStatus",
    "PlacementStatus",
    "Role",
    "can_transition",
    "sql_in",
]

TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.SCHEDULED, JobStatus.CANCELLED, JobStatus.FAILED}),
    JobStatus.SCHEDULED: frozenset(
        {JobStatus.RUNNING, JobStatus.QUEUED, JobStatus.CANCELLING, JobStatus.FAILED}
    ),
    JobStatus.RUNNING: frozenset(
        {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLING, JobStatus.QUEUED}
    ),
    JobStatus.CANCELLING: frozenset({JobStatus.CANCELLED}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


def can_transition(current: JobStatus, new: JobStatus) -> bool:
    return new in TRANSITIONS[current]


def sql_in(values: frozenset[StrEnum] | list[StrEnum] | type[StrEnum]) -> str:
    """A SQL ``IN (...)`` list of enum values, for check constraints and partial indexes."""
    return "(" + ", ".join(f"'{v.value}'" for v in sorted(values, key=lambda v: v.value)) + ")"

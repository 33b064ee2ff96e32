"""The job state machine (SPEC §5), in one place.

``queued`` → ``scheduled`` (placed on nodes) → ``running`` → ``succeeded`` | ``failed`` |
``cancelled``, with ``cancelling`` between a cancel request and the ranks being stopped.
A scheduled or running job whose attempt is lost may go back to ``queued`` for a retry.
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


class AttemptStatus(StrEnum):
    SCHEDULED = "scheduled"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


LIVE_ATTEMPT_STATUSES = frozenset({AttemptStatus.SCHEDULED, AttemptStatus.RUNNING})


class NodeStatus(StrEnum):
    READY = "ready"
    LOST = "lost"


class Role(StrEnum):
    ADMIN = "admin"
    USER = "user"
    WORKER = "worker"


def sql_in(values: frozenset[StrEnum] | list[StrEnum] | type[StrEnum]) -> str:
    """A SQL ``IN (...)`` list of enum values, for check constraints and partial indexes."""
    return "(" + ", ".join(f"'{v.value}'" for v in sorted(values, key=lambda v: v.value)) + ")"

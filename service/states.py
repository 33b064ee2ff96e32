"""The job state machine (docs/api.md), in one place.

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
    "ABORTED_ATTEMPT_STATUSES",
    "ACTIVE_STATUSES",
    "DRAINED_NODE_STATUSES",
    "ENGINE_AGENTS",
    "ENGINE_SLURM",
    "FINAL_ATTEMPT_STATUSES",
    "FINAL_STATUSES",
    "LIVE_ATTEMPT_STATUSES",
    "LIVE_STATUSES",
    "PLACED_STATUSES",
    "TRANSITIONS",
    "AttemptStatus",
    "EngineName",
    "JobStatus",
    "NodeStatus",
    "PlacementStatus",
    "Role",
    "SweepStatus",
    "TrialState",
    "can_transition",
    "sql_in",
]


class EngineName(StrEnum):
    """The engines that run attempts (docs/slurm.md; TORCHYARD_ENGINE), as attempts and nodes
    name them: ``agents`` (resident worker agents), ``slurm``, ``kubernetes``."""

    AGENTS = "agents"
    SLURM = "slurm"
    KUBERNETES = "kubernetes"


ENGINE_AGENTS = EngineName.AGENTS
ENGINE_SLURM = EngineName.SLURM

# A drained node (by an admin, its agent or its engine): no new placements.
DRAINED_NODE_STATUSES = frozenset({NodeStatus.DRAINING, NodeStatus.DRAINED})
# A job placed on nodes and not being cancelled: its ranks may start, run and report.
PLACED_STATUSES = frozenset({JobStatus.SCHEDULED, JobStatus.RUNNING})
FINAL_ATTEMPT_STATUSES = frozenset(AttemptStatus) - LIVE_ATTEMPT_STATUSES
# An attempt that ended without succeeding: its placements still running are told to stop.
ABORTED_ATTEMPT_STATUSES = FINAL_ATTEMPT_STATUSES - {AttemptStatus.SUCCEEDED}

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


class SweepStatus(StrEnum):
    """A sweep (docs/sweeps.md): ``running`` until its last trial ends."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TrialState(StrEnum):
    """A sweep's trial, from its job's status (``pruned``: cancelled by the early-stopping rule;
    ``cancelled``: stopped with its sweep or by its owner)."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    PRUNED = "pruned"
    FAILED = "failed"
    CANCELLED = "cancelled"

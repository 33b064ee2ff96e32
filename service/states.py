"""The state machines of jobs, attempts, placements and nodes (docs/api.md), in one place.

A job: ``queued`` → ``scheduled`` (placed on nodes) → ``running`` → ``succeeded`` |
``failed`` | ``cancelled``, with ``cancelling`` between a cancel request and the ranks being
stopped. A scheduled or running job whose attempt is lost may go back to ``queued`` for a
retry. An attempt: ``scheduled`` → ``running`` → how it ended. A placement: ``assigned`` →
``running`` (claimed) → ``done``. A node: ``ready``, ``lost`` when silent, ``draining`` and
``drained`` when drained. Every status write goes through one function per row type
(:func:`service.services.jobs.transition` for jobs, :mod:`service.services.transitions` for
the others), which refuses a move these tables do not allow.
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
    "ATTEMPT_TRANSITIONS",
    "DRAINED_NODE_STATUSES",
    "ENGINE_AGENTS",
    "ENGINE_SLURM",
    "FINAL_ATTEMPT_STATUSES",
    "FINAL_STATUSES",
    "LIVE_ATTEMPT_STATUSES",
    "LIVE_STATUSES",
    "NODE_TRANSITIONS",
    "PLACED_STATUSES",
    "PLACEMENT_TRANSITIONS",
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


# An attempt ends once; a scheduled one may end before any of its ranks reported running.
ATTEMPT_TRANSITIONS: dict[AttemptStatus, frozenset[AttemptStatus]] = {
    AttemptStatus.SCHEDULED: frozenset({AttemptStatus.RUNNING}) | FINAL_ATTEMPT_STATUSES,
    AttemptStatus.RUNNING: FINAL_ATTEMPT_STATUSES,
    **{status: frozenset() for status in FINAL_ATTEMPT_STATUSES},
}

# A placement is claimed (``running``) or done without ever being claimed (cancelled,
# preempted or lost first); ``done`` is final.
PLACEMENT_TRANSITIONS: dict[PlacementStatus, frozenset[PlacementStatus]] = {
    PlacementStatus.ASSIGNED: frozenset({PlacementStatus.RUNNING, PlacementStatus.DONE}),
    PlacementStatus.RUNNING: frozenset({PlacementStatus.DONE}),
    PlacementStatus.DONE: frozenset(),
}

# A node's agent (or an engine's inventory) may bring it back from any status; a silent or
# failed node is lost from any status but ``lost``; a drain holds until undrained (an
# admin's drain of a lost node, re-registered, is ``drained``; an engine's inventory may
# say ``drained`` of itself). Only a drained node is not drained again.
NODE_TRANSITIONS: dict[NodeStatus, frozenset[NodeStatus]] = {
    NodeStatus.READY: frozenset({NodeStatus.LOST, NodeStatus.DRAINING, NodeStatus.DRAINED}),
    NodeStatus.LOST: frozenset({NodeStatus.READY, NodeStatus.DRAINING, NodeStatus.DRAINED}),
    NodeStatus.DRAINING: frozenset({NodeStatus.READY, NodeStatus.LOST, NodeStatus.DRAINED}),
    NodeStatus.DRAINED: frozenset({NodeStatus.READY, NodeStatus.LOST}),
}


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

"""The engine port: what a driver answers, typed in and out (see :mod:`service.engines`).

A driver talks to one kind of cluster and knows nothing of torchyard's database: it lists
the cluster's nodes (:meth:`Driver.inventory`), starts one attempt as one engine job
(:meth:`Driver.submit`), says how its jobs are doing (:meth:`Driver.poll`) and stops one
(:meth:`Driver.cancel`). The service's reconciler (:mod:`service.services.reconciler`)
does the rest — the lock, the node rows, handing queued jobs over, and what an engine
job's end means for its attempt — the same way for every driver. What differs between
engines is declared in :class:`Capabilities`, never tested by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from service.states import EngineName
from torchyard.contract.states import NodeStatus


class EngineUnavailable(RuntimeError):
    """The engine cannot be used as configured (a missing command, an unknown partition)."""


class EngineNotAnswering(RuntimeError):
    """The engine did not answer this time (a timeout, a command that failed): the pass is
    skipped and the next one asks again."""


class SubmitRefused(RuntimeError):
    """The engine refused an attempt for good (a bad option, a request it can never run):
    the attempt fails with ``EngineError`` carrying this message, and is not retried."""


@dataclass(frozen=True)
class Capabilities:
    """What sets an engine apart, as the service needs to know it.

    ``schedules``: the engine places attempts itself (submit, poll, cancel). Without it the
    service's gang scheduler places them on the nodes of resident agents, which claim them.
    ``nodes_heartbeat``: nodes are heard from by their own heartbeats (a silent node is
    lost after the lease timeout). Without it the engine's inventory says which nodes are
    ready, and nothing else is waited for.
    ``reports_ends``: the engine says how each of its jobs ended (preempted, cancelled from
    outside, a node failed): an attempt whose placements are done waits for that word
    before it is settled as preempted.
    ``binds_ranks``: the engine says which node each node rank runs on (a pod's node), and
    the reconciler binds the placements; the launchers wait for that. Without it the first
    launcher to check in binds them from its allocation's node list (Slurm's).
    """

    schedules: bool
    nodes_heartbeat: bool
    reports_ends: bool
    binds_ranks: bool = False


# Kubernetes schedules; its nodes are read from the API; pods' states say how an attempt
# ended; the engine says which node each rank's pod is on (the reconciler binds them).
# Declared with the port, not in service.engines.kubernetes: that module loads the
# kubernetes client, which only a replica running that engine needs.
KUBERNETES_CAPABILITIES = Capabilities(
    schedules=True, nodes_heartbeat=False, reports_ends=True, binds_ranks=True
)


@dataclass(frozen=True)
class NodeSeen:
    """One node of the engine's inventory."""

    name: str
    address: str
    # GPUs when the node has any, else CPU slots.
    units: int
    accelerator: str  # "gpu" | "cpu"
    status: NodeStatus  # READY, DRAINED or LOST
    # The engine's own word for the node's state (``mix``, ``down*``, ``Ready``).
    state: str
    # Why a lost or drained node is so, in the engine's words ("node n1 is down* in Slurm").
    why: str = ""
    # Shown with the node (``GET /v1/cluster``): partitions, GPUs and CPUs, labels.
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchRequest:
    """One attempt to start: one launcher per node rank, all at once."""

    job_id: str
    attempt_id: str
    attempt_number: int
    node_count: int
    process_count_per_node: int
    # The launchers' credential (``TORCHYARD_LAUNCH_TOKEN``): for this attempt only.
    launch_token: str
    # The job's own run-time limit (its spec's ``resources.max_runtime_s``), if any.
    max_runtime_s: float | None = None
    # The job's team's names in the engine (docs/teams.md): Slurm's account, Kueue's queue.
    account: str | None = None
    queue: str | None = None

    @property
    def name(self) -> str:
        return engine_job_name(self.job_id, self.attempt_number)


def engine_job_name(job_id: str, attempt_number: int) -> str:
    """An attempt's engine job name: the attempt is found by it again after an API restart."""
    return f"torchyard-{job_id}-{attempt_number}"


class Phase(StrEnum):
    PENDING = "pending"  # waiting for the engine's resources
    RUNNING = "running"
    ENDED = "ended"  # nothing of the engine job runs any more


class Ending(StrEnum):
    """How an ended engine job ended, as far as the engine can tell."""

    COMPLETED = "completed"  # ended by itself
    CANCELLED = "cancelled"  # stopped from outside torchyard (``scancel``, a deleted pod)
    PREEMPTED = "preempted"  # preempted, evicted, or its time limit came
    NODE_LOST = "node_lost"  # a node under it failed
    FAILED = "failed"  # anything else
    # The engine could not place the whole gang in time and released every part of it: the
    # job waits for the engine's resources (not a failure, not a restart).
    UNSCHEDULABLE = "unschedulable"


@dataclass(frozen=True)
class EngineJobState:
    """What the engine says of one of its jobs."""

    id: str
    phase: Phase
    # The engine's own word (``PENDING``, ``COMPLETED``, ``Failed``), kept on the attempt.
    state: str
    # Why it waits, or why it ended, in the engine's words (``Resources``).
    reason: str = ""
    ending: Ending | None = None
    # For an ended job: one line saying how ("Slurm job 12 ended FAILED (exit code 1:0, reason
    # NonZeroExitCode)") and the end of its output, for a job no launcher reported from.
    summary: str = ""
    output_tail: str = ""
    # With ``binds_ranks``: once every rank is on a node with an address, the node of each
    # rank (in rank order) and rank 0's address (the rendezvous).
    nodes: tuple[str, ...] = ()
    master_addr: str = ""
    # A running job the engine is taking back (a pod being evicted or deleted): why. The
    # whole attempt checkpoints and stops, and resumes later (a preemption).
    disrupted: str = ""


class Driver(Protocol):
    """One kind of cluster, behind the four operations of the port."""

    name: EngineName
    capabilities: Capabilities
    # What the engine's waiting jobs are called in a job's reason ("Slurm", "Kubernetes").
    display_name: str
    # The command the engine starts on each node, named when no launcher ever reported.
    launcher: str
    # How a job stopped from outside was stopped, for its reason ("scancel'ed", "deleted").
    cancel_verb: str

    @property
    def period_s(self) -> float | None:
        """Seconds between passes even when nothing asked for one (None: only when asked)."""

    def start(self) -> None:
        """Check the engine can be used (raise :class:`EngineUnavailable` with one clear line)."""

    def inventory(self) -> list[NodeSeen]:
        """The nodes jobs may run on, with their state (raises :class:`EngineNotAnswering`)."""
        ...

    def submit(self, request: LaunchRequest) -> str:
        """Start the attempt; its engine job id. An engine job of ``request.name`` that this
        service already submitted is adopted, not submitted twice (raises
        :class:`SubmitRefused`, :class:`EngineNotAnswering`)."""
        ...

    def poll(self, ids: Sequence[str]) -> dict[str, EngineJobState]:
        """The state of each of these engine jobs (one the engine forgot: ended)."""
        ...

    def cancel(self, engine_job_id: str) -> None:
        """Stop the engine job and everything of it (no error when it is gone already)."""

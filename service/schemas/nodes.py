"""Node registry schemas."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from service.schemas.common import StrictModel


class NodeRegister(StrictModel):
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    address: str = Field(min_length=1, max_length=255, description="Address other nodes can reach.")
    units: int = Field(ge=1, le=1024, description="Processing units: GPUs, or CPU slots.")
    accelerator: str = Field(default="cpu", min_length=1, max_length=64)
    info: dict[str, Any] | None = None
    agent_key: str | None = Field(
        default=None,
        min_length=16,
        max_length=200,
        description="The agent's per-node secret: while this agent heartbeats, another agent of the same "
        "token registering the name gets 409 NodeNameInUseError. Sent again in the X-Torchyard-Agent-Key "
        "header of heartbeats and claims.",
    )


class NodeAttemptPublic(BaseModel):
    """An attempt's share of a node, holding some of its units."""

    attempt_id: str
    attempt_number: int
    job_id: str | None = Field(
        description="The job, when the caller may see it (their own, or any for admins)."
    )
    node_rank: int
    units: int
    status: str = Field(description="assigned (placed, not yet claimed by the agent) or running.")


class NodePublic(BaseModel):
    name: str
    address: str = Field(description="Address the other nodes reach this one at.")
    units: int = Field(description="Processing units: GPUs, or CPU slots.")
    used_units: int = Field(description="Units held by attempts placed on the node.")
    free_units: int = Field(description="Units a new job could get now (0 on a lost node).")
    accelerator: str
    status: str = Field(
        description="ready; lost (marked lost, or silent past the lease timeout); draining (drained by "
        "an admin or its agent got SIGTERM, its placements still stopping) or drained (no placements "
        "left): a draining or drained node takes no new work."
    )
    last_heartbeat_at: datetime
    seconds_since_heartbeat: float
    registered_at: datetime
    sandbox: str | None = Field(
        default=None,
        description="How the node confines its runs: bwrap (each run in a bubblewrap sandbox); off "
        "(TORCHYARD_SANDBOX=off: not confined); unavailable (no working bubblewrap: the node refuses "
        "script jobs with SandboxUnavailableError); null for an agent that does not say.",
    )
    running_attempts: list[str] = Field(default=[], description="Ids of the attempts holding units here.")
    attempts: list[NodeAttemptPublic] = []
    engine: str = Field(
        default="agents",
        description="Who keeps the node: agents (a torchyard agent), slurm (Slurm's inventory).",
    )
    engine_state: str | None = Field(
        default=None, description="The engine's own state of the node (Slurm's)."
    )


class ClusterPublic(BaseModel):
    engine: str = Field(
        default="agents", description="What runs the jobs: agents or slurm (TORCHYARD_ENGINE)."
    )
    max_nodes: int = Field(description="Largest node_count a job may ask for.")
    max_nodes_source: str = Field(
        description="setting: TORCHYARD_MAX_NODES; ready_nodes: the number of nodes not lost."
    )
    max_units_per_node: int = Field(
        description="Largest process_count_per_node a job may ask for: the units of the largest ready node."
    )
    ready_nodes: int
    lost_nodes: int
    total_units: int = Field(description="Units of the ready nodes.")
    free_units: int = Field(description="Free units of the ready nodes.")
    nodes: list[NodePublic]


class NodeDrained(BaseModel):
    """A node after a drain or undrain."""

    name: str
    status: str = Field(description="draining, drained or ready (see NodePublic.status).")
    drained_by: str | None = Field(
        default=None, description="admin (held until undrained) or agent (its agent got SIGTERM)."
    )
    preempted_jobs: list[str] = Field(
        default=[], description="Jobs whose attempts were asked to checkpoint and stop (admins only)."
    )

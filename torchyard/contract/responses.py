"""Response bodies the API answers with and the Python client reads, declared once: the
service's routes name them as their response models and :mod:`torchyard.apiclient` parses
the answers with them (fields a newer service adds are ignored, not refused).

Their class names are the component names of the API's OpenAPI schema.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from torchyard.contract.states import Role

# --- jobs -------------------------------------------------------------------------------------


class StatusChange(BaseModel):
    status: str
    at: datetime
    message: str | None = None


class EndReason(BaseModel):
    """Why an attempt ended: a failure code, ``preempted``, ``succeeded`` or ``cancelled``."""

    code: str
    message: str


class ComparedPoint(BaseModel):
    value: float
    epoch: int
    step: int


# --- metrics ----------------------------------------------------------------------------------


class MetricPoint(BaseModel):
    seq: int = Field(description="Position in the job's metric history; pass it as ``after`` to continue.")
    name: str = Field(description="A trainer metric (docs/models.md) or a name a script job logged.")
    value: float
    epoch: int
    step: int
    rank: int
    time: datetime
    attempt: int


class MetricPage(BaseModel):
    items: list[MetricPoint]
    next_after: int = Field(
        description="The cursor for the next poll: the last item's seq, or the given after."
    )


class MetricSeries(BaseModel):
    x: list[float] = Field(
        description="The training step of each point (a stretch's middle step when reduced)."
    )
    y: list[float]
    count: int = Field(description="Points stored for this metric, before reduction.")


# --- nodes ------------------------------------------------------------------------------------


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


# --- tokens (the secret is returned once, by the creation; no other answer carries it or its hash)


class TokenCreated(BaseModel):
    id: str
    name: str
    role: Role
    token: str = Field(description="Shown once; only its hash is stored.")
    created_at: datetime


class TokenPublic(BaseModel):
    """A token as the admin sees it: never its secret nor its hash."""

    id: str
    name: str
    role: Role
    created_at: datetime
    last_used_at: datetime | None = Field(
        description="Last request made with the token, to within a minute (null: never used)."
    )
    revoked_at: datetime | None = Field(description="When it was revoked (null: still valid).")


# --- code packages and datasets ---------------------------------------------------------------


class CodePublic(BaseModel):
    id: str
    name: str
    owner: str = Field(description="Id of the token that uploaded the package.")
    sha256: str = Field(description="Content checksum: sha256 of the sorted manifest of its files.")
    size_bytes: int = Field(description="Total size of the files.")
    files: int = Field(description="Number of files.")
    created_at: datetime


class WeightsPublic(BaseModel):
    """Pretrained weights in the service's store (docs/fine-tuning.md)."""

    id: str
    architecture: str = Field(description="The torchvision architecture the state dict is for.")
    filename: str = Field(description="The uploaded file's name.")
    sha256: str = Field(description="sha256 of the file.")
    size_bytes: int
    uploaded_by: str = Field(description="Id of the token that uploaded them.")
    created_at: datetime


class DatasetPublic(BaseModel):
    id: str
    name: str
    owner: str = Field(description="Id of the token that created the dataset.")
    source: Literal["upload", "path"]
    path: str | None = Field(default=None, description="The registered folder (path datasets only).")
    classes: list[str] = Field(description="Class names, sorted: the label order of trained models.")
    class_counts: dict[str, int]
    num_images: int
    size_bytes: int = Field(description="Total size of the image files.")
    sha256: str = Field(description="Content checksum: sha256 of the sorted manifest of image files.")
    created_at: datetime

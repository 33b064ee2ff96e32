"""The worker protocol's payloads: registration, heartbeat, claim, launcher check-in and
placement status. The API validates requests with them (strictly) and answers with them; the
agent parses the answers with them (tolerantly: fields a newer API adds are ignored)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, TypeAdapter

from torchyard.contract.base import StrictModel
from torchyard.contract.failures import FailureReport
from torchyard.contract.jobspec import (
    DistributionFields,
    EnvironmentFields,
    JobKind,
    JobParameters,
    OutputsScope,
)


def _lease_token(value: str) -> str:
    # A database's text cannot hold NUL: refused here (422), not by PostgreSQL (a 500).
    if "\x00" in value:
        raise ValueError("a lease token may not contain NUL characters")
    return value


# What the API hands out is 43 characters; anything else is reported back as unknown.
LeaseToken = Annotated[str, Field(max_length=256), AfterValidator(_lease_token)]


class NodeRegister(StrictModel):
    """A worker agent registering its node (again, after a restart: the same name)."""

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


class NodeRegistered(BaseModel):
    id: str
    name: str
    status: str
    heartbeat_interval_s: float = Field(description="How often the agent should heartbeat.")
    lease_timeout_s: float = Field(description="A node or lease not renewed for this long is lost.")
    claim_poll_timeout_s: float = Field(description="Longest wait a claim long-poll is held for.")


class HeartbeatRequest(StrictModel):
    leases: list[LeaseToken] = Field(
        default_factory=list,
        max_length=4096,
        description="Lease tokens of every placement the agent still runs (or is stopping).",
    )


class LeaseRenewal(BaseModel):
    lease_token: str
    lease_expires_at: datetime


class StopOrder(BaseModel):
    """A placement whose ranks the agent must stop now."""

    lease_token: str
    job_id: str | None = None
    reason: Literal["cancelled", "attempt_ended", "stale", "preempted"] = Field(
        description="cancelled: the job is being cancelled; attempt_ended: another node failed or the "
        "attempt is over; stale: the lease is unknown, finished or expired; preempted: the node is "
        "draining: checkpoint at the next step boundary, upload it, then report state preempted."
    )
    message: str


class HeartbeatResponse(BaseModel):
    node: str
    status: str
    heartbeat_interval_s: float
    lease_timeout_s: float
    claim_poll_timeout_s: float | None = Field(
        default=None,
        description="Longest wait a claim long-poll is held for now (it grows with the cluster).",
    )
    renewed: list[LeaseRenewal] = []
    stop: list[StopOrder] = []


class ClaimedDataset(BaseModel):
    id: str
    sha256: str
    classes: list[str]
    num_images: int


class ClaimedDatasets(BaseModel):
    train: ClaimedDataset
    validation: ClaimedDataset


class ClaimedWeights(BaseModel):
    """The stored weights a ``pretrained`` training job starts from (GET /v1/worker/weights/{id}/file)."""

    id: str
    architecture: str
    filename: str
    sha256: str
    size_bytes: int


class ClaimedCode(BaseModel):
    """A script job's code package (GET /v1/worker/code/{id}/archive)."""

    id: str
    sha256: str
    files: int


class CheckpointRef(BaseModel):
    """The job's latest training-state checkpoint held by the service (docs/restarts.md)."""

    epoch: int = Field(description="Epochs completed when it was written.")
    step: int | None = Field(
        default=None,
        description="Steps into epoch ``epoch`` (a preemption checkpoint); null at an epoch end.",
    )
    sha256: str
    size_bytes: int
    attempt: int = Field(description="The attempt number that wrote it.")


class PlacementResources(BaseModel):
    """A claimed job's resources and limits (unset: no limit)."""

    node_count: int = 1
    process_count_per_node: int = 1
    max_runtime_s: int | None = None
    max_restarts: int | None = None
    hang_timeout_s: int | None = None


class PlacementModel(BaseModel):
    """The model a trainer run builds (a training job's, or the evaluated version's)."""

    architecture: str
    pretrained: bool = False
    memory_efficient: bool = False
    init_from_job: str | None = None


class TrainSpec(BaseModel):
    """What a training job's placement runs: the trainer with these model and parameters."""

    model: PlacementModel
    parameters: JobParameters = Field(default_factory=JobParameters)
    resources: PlacementResources = Field(default_factory=PlacementResources)


class EvaluateParameters(BaseModel):
    image_size: int
    batch_size: int


class EvaluateSpec(BaseModel):
    """What an evaluation's placement runs: the trainer in evaluation mode."""

    model: PlacementModel
    parameters: EvaluateParameters
    resources: PlacementResources = Field(default_factory=PlacementResources)


class ScriptSpec(BaseModel):
    """What a script job's placement runs: the user's command (docs/script-jobs.md)."""

    command: list[str]
    distribution: DistributionFields = Field(default_factory=DistributionFields)
    environment: EnvironmentFields = Field(default_factory=EnvironmentFields)
    outputs: OutputsScope = "node0"
    resources: PlacementResources = Field(default_factory=PlacementResources)


class ClaimedPlacement(BaseModel):
    """Everything one node needs to launch its share of an attempt, whatever the job's kind.

    A claim answers with one of its kinds (:data:`AnyClaimedPlacement`, told apart by
    ``type``); each narrows ``type`` and ``spec`` and makes its own inputs required.
    """

    job_id: str
    job_name: str
    attempt_id: str
    attempt_number: int
    lease_token: str = Field(description="Send as the X-Torchyard-Lease header on every write.")
    lease_expires_at: datetime
    node_rank: int
    node_count: int
    process_count_per_node: int
    world_size: int
    master_addr: str
    master_port: int
    type: JobKind = Field(default=JobKind.TRAIN, description="The job's kind: train, script or evaluate.")
    spec: TrainSpec | ScriptSpec | EvaluateSpec = Field(
        description="The job's normalized spec: model, parameters and resources of a training job or "
        "an evaluation; command, distribution, environment, outputs and resources of a script job."
    )
    datasets: ClaimedDatasets | None = Field(default=None, description="A training job's datasets.")
    classes: list[str] = []
    code: ClaimedCode | None = Field(default=None, description="A script job's code package.")
    inputs: dict[str, ClaimedDataset] = Field(
        default_factory=dict, description="A script job's input datasets by input name."
    )
    init_from_job: str | None = None
    checkpoint: CheckpointRef | None = Field(
        default=None, description="Resume from this checkpoint (GET /v1/worker/jobs/{id}/checkpoint)."
    )
    restarts: int = Field(default=0, description="Restarts used so far (preemptions not counted).")
    heartbeat_interval_s: float
    lease_timeout_s: float


class TrainPlacement(ClaimedPlacement):
    """A training job's placement: the trainer on two datasets, maybe from a checkpoint."""

    type: Literal[JobKind.TRAIN] = JobKind.TRAIN
    spec: TrainSpec
    datasets: ClaimedDatasets
    weights: ClaimedWeights | None = Field(
        default=None,
        description="With model.pretrained: the stored weights to start from; null when there are none "
        "(the node then downloads the default weights from the model hub, if it may).",
    )


class EvaluatePlacement(ClaimedPlacement):
    """An evaluation's placement: the model of ``init_from_job`` scored on one dataset."""

    type: Literal[JobKind.EVALUATE] = JobKind.EVALUATE
    spec: EvaluateSpec
    datasets: ClaimedDatasets


class ScriptPlacement(ClaimedPlacement):
    """A script job's placement: a code package, its input datasets and a command."""

    type: Literal[JobKind.SCRIPT] = JobKind.SCRIPT
    spec: ScriptSpec
    code: ClaimedCode


AnyClaimedPlacement = Annotated[
    TrainPlacement | ScriptPlacement | EvaluatePlacement, Field(discriminator="type")
]
CLAIMED_PLACEMENT: TypeAdapter[TrainPlacement | ScriptPlacement | EvaluatePlacement] = TypeAdapter(
    AnyClaimedPlacement
)


class PlacementStatusReport(StrictModel):
    state: Literal["running", "succeeded", "failed", "cancelled", "preempted"] = Field(
        description="preempted: the ranks stopped at a step boundary after a drain or SIGTERM and the "
        "checkpoint is uploaded; the job goes back to queued (not counted in restarts)."
    )
    exit_code: int | None = None
    failure: FailureReport | None = None


class PlacementStatusResponse(BaseModel):
    job_id: str
    job_status: str
    attempt_status: str
    placement_status: str
    stop: bool = Field(description="True when the agent must stop this placement's ranks.")
    reason: str | None = None


class LaunchCheckIn(StrictModel):
    """A one-placement launcher (docs/slurm.md) checking in for its share of an attempt.

    The first launcher of an attempt to check in binds every placement: node rank ``i``
    is ``nodes[i]``, and the rendezvous is at node rank 0's address."""

    node: str = Field(min_length=1, max_length=200, description="This node's name (Slurm's SLURMD_NODENAME).")
    node_rank: int = Field(ge=0, le=100_000, description="This node's rank (Slurm's SLURM_NODEID).")
    nodes: list[str] = Field(
        min_length=1,
        max_length=100_000,
        description="Every node of the allocation in node-rank order (Slurm's expanded SLURM_JOB_NODELIST).",
    )
    address: str = Field(
        min_length=1, max_length=255, description="The address other nodes reach this one at."
    )

"""Job request and response schemas (docs/datasets.md ranges, docs/api.md shapes)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, TypeAdapter, model_validator

from service.schemas.common import StrictModel
from torchyard.contract.failures import Failure
from torchyard.contract.jobspec import (
    DEFAULT_JOB_TYPE,
    DistributionFields,
    EnvironmentFields,
    JobKind,
    JobParameters,
    ModelFields,
    ResourceFields,
    ScriptFields,
    allowed,
)
from torchyard.contract.responses import ComparedPoint, EndReason, MetricSeries, StatusChange


class ModelSpec(ModelFields, StrictModel):
    init_from_job: str | None = Field(
        default=None,
        max_length=64,
        description="Id of a succeeded job whose model directory initialises the weights.",
    )


class Parameters(JobParameters, StrictModel):
    pass


class Resources(ResourceFields, StrictModel):
    pass


class Distribution(DistributionFields, StrictModel):
    pass


class Environment(EnvironmentFields, StrictModel):
    pass


_TYPE_DESCRIPTION = (
    "What runs: train (the built-in trainer, the default), script (your own code) or evaluate "
    "(a registered model scored on a labeled dataset)."
)
_TYPES = "train, script or evaluate"


class TrainJobCreate(StrictModel):
    """A training job spec (the built-in trainer). Unknown fields anywhere are refused."""

    type: Literal["train"] = Field(
        default="train", description=_TYPE_DESCRIPTION, json_schema_extra=allowed(_TYPES)
    )
    name: str | None = Field(default=None, min_length=1, max_length=200)
    model: ModelSpec
    train_dataset: str = Field(min_length=1, max_length=64, description="Training dataset id.")
    validation_dataset: str = Field(min_length=1, max_length=64, description="Validation dataset id.")
    parameters: Parameters = Field(default_factory=Parameters)
    resources: Resources = Field(default_factory=Resources)
    priority: int = Field(
        default=0,
        ge=-100,
        le=100,
        description="Higher runs first; FIFO among equal priorities.",
        json_schema_extra=allowed("-100..100"),
    )
    team: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        description="The team it belongs to (docs/teams.md): one of yours; default: your first.",
    )


class ScriptJobCreate(ScriptFields, StrictModel):
    """A script job spec (docs/script-jobs.md): the user's own code and command. Unknown fields are refused."""

    type: Literal["script"] = Field(description=_TYPE_DESCRIPTION, json_schema_extra=allowed(_TYPES))
    name: str | None = Field(default=None, min_length=1, max_length=200)
    distribution: Distribution = Field(default_factory=Distribution)
    environment: Environment = Field(default_factory=Environment)
    resources: Resources = Field(default_factory=Resources)
    priority: int = Field(
        default=0,
        ge=-100,
        le=100,
        description="Higher runs first; FIFO among equal priorities.",
        json_schema_extra=allowed("-100..100"),
    )
    team: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        description="The team it belongs to (docs/teams.md): one of yours; default: your first.",
    )

    @model_validator(mode="after")
    def _check_network(self) -> ScriptJobCreate:
        if self.environment.network != "none":
            return self
        if self.resources.node_count != 1:
            raise ValueError(
                "environment.network none is for one node: the nodes of a multi-node job talk over "
                "the network (use network host)"
            )
        if self.distribution.launch == "per_process" and self.resources.process_count_per_node != 1:
            raise ValueError(
                "environment.network none runs one sandbox per process with the per_process launch, "
                "and they could not reach each other: use distribution.launch per_node (the command, "
                "e.g. torchrun, starts its processes in one sandbox) or one process per node"
            )
        return self


class EvaluateJobCreate(StrictModel):
    """An evaluation job (docs/models.md): a registered model scored on a labeled dataset, on a worker."""

    type: Literal["evaluate"] = Field(description=_TYPE_DESCRIPTION, json_schema_extra=allowed(_TYPES))
    name: str | None = Field(default=None, min_length=1, max_length=200)
    model: str = Field(
        min_length=1,
        max_length=120,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}(:([1-9][0-9]{0,8}|latest))?$",
        description="The registered model as name:version (name alone: the latest version).",
    )
    dataset: str = Field(min_length=1, max_length=64, description="The labeled dataset to evaluate on.")
    batch_size: int = Field(default=64, ge=1, le=4096, description="Images per evaluation batch.")
    priority: int = Field(
        default=0,
        ge=-100,
        le=100,
        description="Higher runs first; FIFO among equal priorities.",
        json_schema_extra=allowed("-100..100"),
    )
    team: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        description="The team it belongs to (docs/teams.md): one of yours; default: your first.",
    )


def job_type_of(value: Any) -> str:
    """The union's tag: the spec's ``type``, ``train`` when it is left out."""
    found = value.get("type", DEFAULT_JOB_TYPE) if isinstance(value, dict) else getattr(value, "type", None)
    return found if isinstance(found, str) else DEFAULT_JOB_TYPE


# Every job kind's request model, by its ``type``. A new kind adds its model here.
JOB_CREATE_MODELS: dict[str, type[StrictModel]] = {
    JobKind.TRAIN: TrainJobCreate,
    JobKind.SCRIPT: ScriptJobCreate,
    JobKind.EVALUATE: EvaluateJobCreate,
}

JobCreate = Annotated[
    Annotated[TrainJobCreate, Tag("train")]
    | Annotated[ScriptJobCreate, Tag("script")]
    | Annotated[EvaluateJobCreate, Tag("evaluate")],
    Discriminator(
        job_type_of,
        custom_error_type="invalid_job_type",
        custom_error_message="type must be one of: train, script, evaluate",
        custom_error_context={"allowed": _TYPES},
    ),
]
JOB_CREATE: TypeAdapter[TrainJobCreate | ScriptJobCreate | EvaluateJobCreate] = TypeAdapter(JobCreate)


class PlacementPublic(BaseModel):
    node: str
    node_rank: int
    units: int
    status: str


class AttemptPublic(BaseModel):
    id: str
    number: int
    status: str = Field(description="scheduled, running, succeeded, failed, cancelled or preempted.")
    master_addr: str
    master_port: int
    failure_code: str | None = None
    failure_message: str | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    nodes: list[str] = Field(default=[], description="Names of the attempt's nodes, by node rank.")
    engine: str = Field(default="agents", description="What ran the attempt: agents or slurm.")
    engine_job_id: str | None = Field(
        default=None, description="The engine's job id (Slurm's) of the attempt."
    )
    engine_state: str | None = Field(default=None, description="The engine job's final state once it ended.")
    end_reason: EndReason | None = Field(default=None, description="Null while the attempt is live.")
    placements: list[PlacementPublic] = []


class JobPublic(BaseModel):
    id: str
    type: str = Field(description="train (the built-in trainer), script or evaluate.")
    name: str
    owner: str = Field(description="Id of the token that submitted the job.")
    team: str | None = Field(
        default=None,
        description="The team the job belongs to (docs/teams.md); null for jobs older than teams.",
    )
    status: str
    model: dict[str, Any] | str | None = Field(
        default=None, description="A training job's model; an evaluation's registered model (name:version)."
    )
    dataset: str | None = Field(default=None, description="Evaluation jobs: the dataset evaluated on.")
    batch_size: int | None = Field(default=None, description="Evaluation jobs: images per batch.")
    train_dataset: str | None = None
    validation_dataset: str | None = None
    parameters: dict[str, Any] | None = None
    resources: dict[str, Any]
    code: str | None = Field(default=None, description="Script jobs: the code package id.")
    command: list[str] | None = None
    distribution: dict[str, Any] | None = None
    inputs: dict[str, str] | None = None
    environment: dict[str, Any] | None = None
    outputs: str | None = Field(default=None, description="Script jobs: node0 or all.")
    outputs_sha256: str | None = Field(
        default=None, description="Script jobs: sha256 of the outputs archive, once uploaded."
    )
    outputs_size: int | None = None
    tracking: dict[str, Any] | None = Field(
        default=None,
        description="Script jobs: what their MLflow client logged: params and tags (of every run, "
        "system tags ``mlflow.*`` left out) and the runs with their own params and tags.",
    )
    priority: int
    reason: str | None = Field(default=None, description="Why a queued job waits.")
    failure: Failure | None = None
    progress: dict[str, Any] = Field(
        default_factory=lambda: dict.fromkeys(("epoch", "step", "fraction", "eta_s")),
        description="Where the job is: ``epoch``, ``step`` (optimizer steps of the whole job), "
        "``fraction`` (of its steps) and ``eta_s`` (seconds left at its recent rate), null where "
        "unknown; with ``epochs``, ``total_steps``, ``steps_per_s``, ``attempt`` and ``time`` "
        "(of the latest report) once it reported.",
    )
    best: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    model_sha256: str | None = None
    model_size: int | None = None
    metric_points: int = Field(default=0, description="Metric points stored (every attempt).")
    metrics_dropped: int = Field(
        default=0,
        description="Metric points its reports sent past the job's limits, not stored "
        "(TORCHYARD_MAX_METRIC_POINTS_PER_JOB, TORCHYARD_MAX_METRIC_NAMES_PER_JOB; the "
        "``service`` log stream says so).",
    )
    nodes: list[str] = []
    restarts: int = Field(
        default=0, description="Restarts used after retryable failures (preemptions not counted)."
    )
    attempts: list[AttemptPublic] | None = Field(
        default=None, description="Every attempt, oldest first: nodes, times and end reason."
    )
    history: list[StatusChange] | None = None
    created_at: datetime
    updated_at: datetime
    scheduled_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    tags: list[str] = Field(default=[], description="The owner's labels (PATCH /v1/jobs/{id}).")
    note: str | None = Field(default=None, description="The owner's free text (PATCH /v1/jobs/{id}).")

    cancel_reason: str | None = Field(
        default=None, description="Why it was cancelled: who asked, or the sweep rule that pruned it."
    )
    sweep_id: str | None = Field(default=None, description="A sweep's trial: the sweep.")
    trial_number: int | None = Field(default=None, description="A sweep's trial: its number (from 0).")


class JobUpdate(StrictModel):
    """PATCH /v1/jobs/{id}: the fields given replace the job's (``null`` clears the note)."""

    tags: list[Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\s,]+$")]] | None = Field(
        default=None,
        max_length=32,
        description="Labels, each 1..64 characters without spaces or commas; the list replaces the job's.",
    )
    note: str | None = Field(default=None, max_length=10_000, description="Free text; null clears it.")


class JobList(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None = None


class ComparedMetric(BaseModel):
    best: ComparedPoint | None = Field(
        default=None, description="The best value (lowest for a loss, else highest) and where it was."
    )
    final: ComparedPoint | None = Field(default=None, description="The last value reported.")
    series: MetricSeries = Field(description="x (step) / y, reduced as the job page's charts are.")


class ComparedJob(BaseModel):
    id: str
    name: str
    type: str
    status: str
    parameters: dict[str, Any] = Field(
        description="The job's spec as dotted keys (``parameters.learning_rate``)."
    )
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    duration_s: float | None = Field(default=None, description="Started to finished (or to now, if running).")
    images_per_sec: float | None = Field(default=None, description="Mean training throughput (all ranks).")
    axis: Literal["epoch", "step"] = Field(
        default="epoch",
        description="How the job counts its metrics: ``epoch`` for a training job or one whose points "
        "span more than one epoch, ``step`` otherwise (a script that reports steps only).",
    )
    logged: dict[str, str] = Field(
        default_factory=dict,
        description="What the job's MLflow runs logged (script jobs), as rows beside ``parameters``: "
        "``mlflow: <param>`` and ``mlflow tag: <tag>`` (MLflow's own ``mlflow.*`` tags left out), of "
        "the runs of the latest attempt that has runs; with several runs, each key names its run: "
        "``mlflow: <run>: <param>``.",
    )
    metrics: dict[str, ComparedMetric]


class JobComparison(BaseModel):
    jobs: list[ComparedJob] = Field(description="In the order asked, each once.")
    metrics: list[str] = Field(description="The metrics compared: those asked, or every one any job has.")
    goals: dict[str, Literal["max", "min"]] = Field(description="Which way is better, per metric.")
    differing: list[str] = Field(description="The parameter keys whose values are not the same in every job.")
    logged_differing: list[str] = Field(
        default_factory=list,
        description="The ``logged`` keys whose values are not the same in every job (params first).",
    )
    points: int = Field(description="The most points asked for per series.")

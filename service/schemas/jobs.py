"""Job request and response schemas (SPEC §2 ranges, SPEC §5 shapes)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, TypeAdapter

from service.schemas.common import StrictModel
from torchyard.contract.jobspec import (
    DEFAULT_JOB_TYPE,
    DistributionFields,
    EnvironmentFields,
    JobParameters,
    ModelFields,
    ResourceFields,
    ScriptFields,
    allowed,
)


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


_TYPE_DESCRIPTION = "What runs: train (the built-in trainer, the default) or script (your own code)."


class TrainJobCreate(StrictModel):
    """A training job spec (the built-in trainer). Unknown fields anywhere are refused."""

    type: Literal["train"] = Field(
        default="train", description=_TYPE_DESCRIPTION, json_schema_extra=allowed("train or script")
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


class ScriptJobCreate(ScriptFields, StrictModel):
    """A script job spec (SPEC §9): the user's own code and command. Unknown fields are refused."""

    type: Literal["script"] = Field(
        description=_TYPE_DESCRIPTION, json_schema_extra=allowed("train or script")
    )
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


def job_type_of(value: Any) -> str:
    """The union's tag: the spec's ``type``, ``train`` when it is left out."""
    found = value.get("type", DEFAULT_JOB_TYPE) if isinstance(value, dict) else getattr(value, "type", None)
    return found if isinstance(found, str) else DEFAULT_JOB_TYPE


# Every job type's request model, by its ``type``. A new type adds its model here.
JOB_CREATE_MODELS: dict[str, type[StrictModel]] = {"train": TrainJobCreate, "script": ScriptJobCreate}

JobCreate = Annotated[
    Annotated[TrainJobCreate, Tag("train")] | Annotated[ScriptJobCreate, Tag("script")],
    Discriminator(
        job_type_of,
        custom_error_type="invalid_job_type",
        custom_error_message="type must be one of: train, script",
        custom_error_context={"allowed": "train or script"},
    ),
]
JOB_CREATE: TypeAdapter[TrainJobCreate | ScriptJobCreate] = TypeAdapter(JobCreate)


class Failure(BaseModel):
    code: str
    message: str
    rank: int | None = None
    node: str | None = None
    traceback: str | None = None


class StatusChange(BaseModel):
    status: str
    at: datetime
    message: str | None = None


class PlacementPublic(BaseModel):
    node: str
    node_rank: int
    units: int
    status: str


class AttemptPublic(BaseModel):
    id: str
    number: int
    status: str
    master_addr: str
    master_port: int
    failure_code: str | None = None
    failure_message: str | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    placements: list[PlacementPublic] = []


class JobPublic(BaseModel):
    id: str
    type: str = Field(description="train (the built-in trainer) or script.")
    name: str
    owner: str
    status: str
    model: dict[str, Any] | None = None
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
    priority: int
    reason: str | None = Field(default=None, description="Why a queued job waits.")
    failure: Failure | None = None
    progress: dict[str, Any] | None = None
    best: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    model_sha256: str | None = None
    model_size: int | None = None
    nodes: list[str] = []
    attempts: list[AttemptPublic] | None = None
    history: list[StatusChange] | None = None
    created_at: datetime
    updated_at: datetime
    scheduled_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    cancel_requested_at: datetime | None = None


class JobList(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None = None

"""Job request and response schemas (SPEC §2 ranges, SPEC §5 shapes)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from service.schemas.common import StrictModel
from torchyard.contract.jobspec import JobParameters, ModelFields, ResourceFields, allowed


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


class JobCreate(StrictModel):
    """A training job spec. Unknown fields anywhere are refused."""

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


class EndReason(BaseModel):
    """Why an attempt ended: a failure code, ``preempted``, ``succeeded`` or ``cancelled``."""

    code: str
    message: str


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
    end_reason: EndReason | None = Field(default=None, description="Null while the attempt is live.")
    placements: list[PlacementPublic] = []


class JobPublic(BaseModel):
    id: str
    name: str
    owner: str
    status: str
    model: dict[str, Any]
    train_dataset: str
    validation_dataset: str
    parameters: dict[str, Any]
    resources: dict[str, Any]
    priority: int
    reason: str | None = Field(default=None, description="Why a queued job waits.")
    failure: Failure | None = None
    progress: dict[str, Any] | None = None
    best: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    model_sha256: str | None = None
    model_size: int | None = None
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


class JobList(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None = None

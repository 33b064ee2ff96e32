"""Job request and response schemas (SPEC §2 ranges, SPEC §5 shapes)."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from service.schemas.common import StrictModel

DOUBLE_EPSILON = 2.220446049250313e-16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_RUNTIME_S = 30 * 24 * 3600


def _allowed(text: str) -> dict[str, Any]:
    # Shown to clients in validation errors and in the OpenAPI schema.
    return {"allowed": text}


# A count of at least one, stored as a 32-bit integer.
_POSITIVE_INT32 = f"> 0 and <= {INT32_MAX}"


class ModelSpec(StrictModel):
    architecture: Annotated[
        str,
        Field(
            min_length=1,
            max_length=100,
            description="A torchvision classification model name (torchvision.models.list_models()).",
            json_schema_extra=_allowed("a torchvision classification model name"),
        ),
    ]
    pretrained: bool = Field(
        default=False, description="Start from pretrained weights found offline on the node."
    )
    memory_efficient: bool = Field(
        default=False, description="DenseNet only: checkpointed, memory-efficient implementation."
    )
    init_from_job: str | None = Field(
        default=None,
        max_length=64,
        description="Id of a succeeded job whose model directory initialises the weights.",
    )


class Parameters(StrictModel):
    epochs: int = Field(default=5, gt=0, le=INT32_MAX, json_schema_extra=_allowed(_POSITIVE_INT32))
    batch_size: int = Field(default=16, gt=0, le=INT32_MAX, json_schema_extra=_allowed(_POSITIVE_INT32))
    warmup_epochs: int = Field(
        default=0, ge=0, le=INT32_MAX, json_schema_extra=_allowed(">= 0 and <= epochs")
    )
    learning_rate: float = Field(
        default=0.001,
        ge=DOUBLE_EPSILON,
        allow_inf_nan=False,
        json_schema_extra=_allowed(f">= {DOUBLE_EPSILON!r} and finite"),
    )
    random_seed: int = Field(
        default=1, ge=INT64_MIN, le=INT64_MAX, json_schema_extra=_allowed("a 64-bit signed integer")
    )
    patience: int = Field(default=3, gt=0, le=INT32_MAX, json_schema_extra=_allowed(_POSITIVE_INT32))
    print_frequency: int = Field(default=10, gt=0, le=INT32_MAX, json_schema_extra=_allowed(_POSITIVE_INT32))
    image_size: int = Field(default=224, ge=16, le=1024, json_schema_extra=_allowed("16..1024"))
    augmentation: Literal["standard", "light", "none"] = Field(
        default="standard", json_schema_extra=_allowed("standard, light or none")
    )

    @model_validator(mode="after")
    def _warmup_within_epochs(self) -> Parameters:
        if self.warmup_epochs > self.epochs:
            raise ValueError(f"warmup_epochs ({self.warmup_epochs}) must be <= epochs ({self.epochs})")
        if not math.isfinite(self.learning_rate):
            raise ValueError("learning_rate must be finite")
        return self


class Resources(StrictModel):
    node_count: int = Field(
        default=1, ge=1, le=INT32_MAX, json_schema_extra=_allowed(">= 1 and <= the cluster's max nodes")
    )
    process_count_per_node: int = Field(
        default=1,
        ge=1,
        le=INT32_MAX,
        json_schema_extra=_allowed(">= 1 and <= the processing units of a node"),
    )
    max_runtime_s: int | None = Field(
        default=None,
        ge=1,
        le=MAX_RUNTIME_S,
        description="Wall-clock limit counted from the job's start (status running); past it every "
        "rank is stopped and the job fails with TimeoutError. Unset: no limit.",
        json_schema_extra=_allowed(f">= 1 and <= {MAX_RUNTIME_S} (30 days), or null for no limit"),
    )


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
        json_schema_extra=_allowed("-100..100"),
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

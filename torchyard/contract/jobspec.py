"""A training job's model, parameters and resources: ranges and defaults of SPEC §2,
defined once.

The API validates submissions against these (strictly: unknown fields refused); the
trainer reads them back from ``job.json`` (tolerantly: a newer agent's extra keys are
logged, not fatal). Each field's ``allowed`` text is what a 422 shows and what the
OpenAPI schema documents.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

DOUBLE_EPSILON = 2.220446049250313e-16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_RUNTIME_S = 30 * 24 * 3600

Augmentation = Literal["standard", "light", "none"]


def allowed(text: str) -> dict[str, Any]:
    """Shown to clients in validation errors and in the OpenAPI schema."""
    return {"allowed": text}


# A count of at least one, stored as a 32-bit integer.
_POSITIVE_INT32 = f"> 0 and <= {INT32_MAX}"


DEFAULT_MAX_RESTARTS = 3
MAX_RESTARTS = 100
DEFAULT_HANG_TIMEOUT_S = 1800
MIN_HANG_TIMEOUT_S = 10
MAX_HANG_TIMEOUT_S = 604_800


class ModelFields(BaseModel):
    """The untrained model: a torchvision architecture and how to build it."""

    architecture: Annotated[
        str,
        Field(
            min_length=1,
            max_length=100,
            description="A torchvision classification model name (torchvision.models.list_models()).",
            json_schema_extra=allowed("a torchvision classification model name"),
        ),
    ]
    pretrained: bool = Field(
        default=False, description="Start from pretrained weights found offline on the node."
    )
    memory_efficient: bool = Field(
        default=False, description="DenseNet only: checkpointed, memory-efficient implementation."
    )


class JobParameters(BaseModel):
    """Training parameters (SPEC §2)."""

    epochs: int = Field(default=5, gt=0, le=INT32_MAX, json_schema_extra=allowed(_POSITIVE_INT32))
    batch_size: int = Field(default=16, gt=0, le=INT32_MAX, json_schema_extra=allowed(_POSITIVE_INT32))
    warmup_epochs: int = Field(default=0, ge=0, le=INT32_MAX, json_schema_extra=allowed(">= 0 and <= epochs"))
    learning_rate: float = Field(
        default=0.001,
        ge=DOUBLE_EPSILON,
        allow_inf_nan=False,
        json_schema_extra=allowed(f">= {DOUBLE_EPSILON!r} and finite"),
    )
    random_seed: int = Field(
        default=1, ge=INT64_MIN, le=INT64_MAX, json_schema_extra=allowed("a 64-bit signed integer")
    )
    patience: int = Field(default=3, gt=0, le=INT32_MAX, json_schema_extra=allowed(_POSITIVE_INT32))
    print_frequency: int = Field(default=10, gt=0, le=INT32_MAX, json_schema_extra=allowed(_POSITIVE_INT32))
    image_size: int = Field(default=224, ge=16, le=1024, json_schema_extra=allowed("16..1024"))
    augmentation: Augmentation = Field(
        default="standard", json_schema_extra=allowed("standard, light or none")
    )

    @model_validator(mode="after")
    def _warmup_within_epochs(self) -> JobParameters:
        if self.warmup_epochs > self.epochs:
            raise ValueError(f"warmup_epochs ({self.warmup_epochs}) must be <= epochs ({self.epochs})")
        if not math.isfinite(self.learning_rate):
            raise ValueError("learning_rate must be finite")
        return self


class ResourceFields(BaseModel):
    """Where and how long a job runs (SPEC §2, §5)."""

    node_count: int = Field(
        default=1, ge=1, le=INT32_MAX, json_schema_extra=allowed(">= 1 and <= the cluster's max nodes")
    )
    process_count_per_node: int = Field(
        default=1,
        ge=1,
        le=INT32_MAX,
        json_schema_extra=allowed(">= 1 and <= the processing units of a node"),
    )
    max_runtime_s: int | None = Field(
        default=None,
        ge=1,
        le=MAX_RUNTIME_S,
        description="Wall-clock limit counted from the job's start (status running); past it every "
        "rank is stopped and the job fails with TimeoutError. Unset: no limit.",
        json_schema_extra=allowed(f">= 1 and <= {MAX_RUNTIME_S} (30 days), or null for no limit"),
    )
    max_restarts: int = Field(
        default=DEFAULT_MAX_RESTARTS,
        ge=0,
        le=MAX_RESTARTS,
        description="How many times a retryable failure (SPEC §8) puts the job back to queued to "
        "resume from its latest checkpoint. Preemptions are not counted.",
        json_schema_extra=allowed(f">= 0 and <= {MAX_RESTARTS}"),
    )
    hang_timeout_s: int | None = Field(
        default=DEFAULT_HANG_TIMEOUT_S,
        ge=MIN_HANG_TIMEOUT_S,
        le=MAX_HANG_TIMEOUT_S,
        description="No training step finished by any rank for this long: every rank's stacks are "
        "dumped into its log and the attempt ends with HangError. Null: no watchdog.",
        json_schema_extra=allowed(
            f">= {MIN_HANG_TIMEOUT_S} and <= {MAX_HANG_TIMEOUT_S} (7 days), or null for no watchdog"
        ),
    )

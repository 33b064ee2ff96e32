"""Model registry and scoring schemas (docs/models.md)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from service.schemas.common import StrictModel

MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


class ModelRegister(StrictModel):
    """Register a succeeded training job's model directory, or the model directory in a
    folder of a succeeded script job's outputs, under a name."""

    name: str = Field(
        pattern=MODEL_NAME_PATTERN,
        description="Letters, digits, '.', '_' and '-', starting with a letter or digit; 100 at most.",
    )
    job_id: str = Field(
        min_length=1, max_length=64, description="A succeeded training or script job (id or name)."
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        max_length=1000,
        description="Script jobs only (and required for them): the folder of the job's outputs that "
        "holds a model directory, relative to the outputs' root (e.g. 'model'; 'node-0/model' with "
        '"outputs": "all").',
    )


class ModelVersionPublic(BaseModel):
    name: str
    version: int
    job_id: str
    path: str | None = Field(
        default=None,
        description="The outputs folder of a script job the version came from; null for a training job.",
    )
    architecture: str
    classes: list[str]
    image_size: int
    sha256: str = Field(description="sha256 of the model directory archive.")
    onnx: bool = Field(description="Whether the version has an ONNX export (needed for scoring).")
    created_at: datetime
    top1: float | None = Field(
        default=None,
        description="The best validation top-1 (0-1) of the job it came from; null where that job "
        "reported none (or was deleted).",
    )


class ModelPublic(BaseModel):
    name: str
    latest_version: int
    versions: list[ModelVersionPublic]


class ModelList(BaseModel):
    items: list[ModelPublic]


class LabelProbability(BaseModel):
    label: str
    probability: float


class FilePrediction(BaseModel):
    file: str
    top: list[LabelProbability]


class PredictResponse(BaseModel):
    name: str
    version: int
    predictions: list[FilePrediction]

"""The job description the agent writes as ``job.json`` (parsed and validated)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from torchyard.contract.errors import RankFailedError
from torchyard.contract.jobspec import JobParameters, ModelFields

log = logging.getLogger(__name__)


class _Section(BaseModel):
    # Unknown keys are tolerated (and logged) so a newer agent does not break an older trainer.
    model_config = ConfigDict(extra="allow", frozen=True)


class ModelSpec(ModelFields, _Section):
    pass


class Parameters(JobParameters, _Section):
    """Training parameters, with the ranges and defaults of SPEC §2 (torchyard.contract.jobspec)."""


class DatasetRef(_Section):
    id: str
    sha256: str | None = None


class Datasets(_Section):
    train: DatasetRef
    validation: DatasetRef


class JobConfig(_Section):
    job_id: str
    attempt_id: str = ""
    model: ModelSpec
    init_from_dir: str | None = None
    parameters: Parameters = Field(default_factory=lambda: Parameters.model_validate({}))
    train_dir: str
    val_dir: str
    classes: list[str] = Field(min_length=1)
    datasets: Datasets | None = None
    output_dir: str
    loader_workers: int | None = Field(None, ge=0)
    # "evaluate": score the model in init_from_dir on val_dir instead of training (SPEC §10).
    task: Literal["train", "evaluate"] = "train"

    @model_validator(mode="after")
    def _classes_unique(self) -> JobConfig:
        if len(set(self.classes)) != len(self.classes):
            raise ValueError("classes contains duplicates")
        return self

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def unknown_fields(self) -> list[str]:
        """Dotted names of keys this trainer does not know (they are ignored)."""
        found = [f"{key}" for key in (self.model_extra or {})]
        for name in ("model", "parameters", "datasets"):
            section = getattr(self, name)
            if section is not None:
                found += [f"{name}.{key}" for key in (section.model_extra or {})]
        return found

    def summary(self) -> dict[str, Any]:
        """What rank 0 logs at start: everything but the bulky class list."""
        data = self.model_dump(exclude={"classes"})
        data["num_classes"] = self.num_classes
        return data


def load_job(path: str | Path) -> JobConfig:
    """Read and validate ``job.json``; a malformed file is a ``RankFailedError``."""
    file = Path(path)
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
        job = JobConfig.model_validate(raw)
    except (OSError, ValueError, ValidationError) as exc:
        raise RankFailedError(f"invalid job configuration {file.name}: {exc}") from exc
    unknown = job.unknown_fields()
    if unknown:
        log.warning("ignoring unknown job.json fields: %s", ", ".join(unknown))
    return job

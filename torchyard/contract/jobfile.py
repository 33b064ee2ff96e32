"""``job.json``: what the agent writes into a trainer run's folder and the trainer reads.

The agent writes it from :class:`JobConfig` and the trainer reads it back into the same
model; unknown keys are tolerated (and logged by the trainer), so a newer agent does not
break an older trainer.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from torchyard.contract.jobspec import JobParameters, ModelFields

JOB_FILE = "job.json"
# The trainer's events (progress, metrics, the result), one JSON object a line, that the agent tails.
EVENTS_FILE = "events.jsonl"
# A node setting the agent passes on to the ranks: the trainer's hooks modules (files or
# importable names, comma-separated; worker/trainer/hooks.py). The agent shows their files to
# the ranks' sandbox, read-only.
TRAINER_HOOKS_VARIABLE = "TORCHYARD_TRAINER_HOOKS"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(getattr(value, "value", value))


class TrainerTask(StrEnum):
    """What the trainer program does with a run: train a model, or score one (docs/models.md)."""

    TRAIN = "train"
    EVALUATE = "evaluate"


class _Section(BaseModel):
    # Unknown keys are tolerated (and logged) so a newer agent does not break an older trainer.
    model_config = ConfigDict(extra="allow", frozen=True)


class ModelSpec(ModelFields, _Section):
    weights_file: str | None = Field(
        default=None,
        description="With pretrained: the node's verified copy of the stored weights (a state dict).",
    )


class Parameters(JobParameters, _Section):
    """Training parameters, with the ranges and defaults of docs/datasets.md (torchyard.contract.jobspec)."""


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
    # "evaluate": score the model in init_from_dir on val_dir instead of training (docs/models.md).
    task: TrainerTask = TrainerTask.TRAIN

    @model_validator(mode="after")
    def _classes_unique(self) -> JobConfig:
        if len(set(self.classes)) != len(self.classes):
            raise ValueError("classes contains duplicates")
        return self

    @property
    def evaluates(self) -> bool:
        """The run scores a model instead of training one."""
        return self.task is TrainerTask.EVALUATE

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

    def summary(self) -> str:
        """What rank 0 logs at start, for a person: the task, the model, the classes, the
        datasets and every parameter, without the node's paths."""
        what = "evaluate" if self.evaluates else "train"
        model = self.model.architecture + (" (pretrained)" if self.model.pretrained else "")
        if self.init_from_dir is not None:
            model += ", starting from a trained model's weights"
        shown = ", ".join(self.classes[:5]) + (
            f", … ({self.num_classes} in all)" if self.num_classes > 5 else ""
        )
        lines = [f"{what} a {model} on {self.num_classes} classes ({shown})"]
        if self.datasets is not None:
            lines.append(
                f"datasets: training {self.datasets.train.id}, validation {self.datasets.validation.id}"
            )
        parameters = self.parameters.model_dump()
        lines.append("parameters: " + ", ".join(f"{k} {_shown(v)}" for k, v in parameters.items()))
        return "\n".join(lines)

    def to_json(self) -> str:
        """The file's text."""
        return self.model_dump_json(indent=2)

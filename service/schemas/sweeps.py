"""Sweep request and response schemas (docs/sweeps.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from service.schemas.common import StrictModel
from torchyard.contract.jobspec import allowed

MAX_TRIALS = 1000
MAX_CHOICES = 100
MAX_KEYS = 20

Choice = str | int | float | bool


class FloatRange(StrictModel):
    type: Literal["float"]
    low: float = Field(allow_inf_nan=False)
    high: float = Field(allow_inf_nan=False)
    log: bool = Field(default=False, description="Sample uniformly in the logarithm (low must be > 0).")
    step: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Only multiples of step above low (not with log).",
    )


class IntRange(StrictModel):
    type: Literal["int"]
    low: int
    high: int
    log: bool = Field(default=False, description="Sample uniformly in the logarithm (low must be >= 1).")
    step: int = Field(default=1, ge=1, description="Only low, low + step, ... (1 unless log).")


class Categorical(StrictModel):
    type: Literal["categorical"]
    choices: list[Choice] = Field(max_length=MAX_CHOICES, json_schema_extra=allowed("1..100 values"))


SearchRange = Annotated[FloatRange | IntRange | Categorical, Field(discriminator="type")]


class Objective(StrictModel):
    metric: str = Field(
        default="val.top1",
        min_length=1,
        max_length=64,
        description="Any metric the trial reports per epoch; a trial's value is its best over epochs.",
    )
    goal: Literal["maximize", "minimize"] = Field(
        default="maximize", json_schema_extra=allowed("maximize or minimize")
    )


class AshaRule(StrictModel):
    """Asynchronous successive halving: at epochs min_epochs × reduction_factor^k, a trial not
    in the top 1/reduction_factor of the trials that reached that epoch is stopped."""

    type: Literal["asha"]
    min_epochs: int = Field(default=1, ge=1, le=10_000)
    reduction_factor: int = Field(default=3, ge=2, le=100)


class MedianRule(StrictModel):
    """A trial whose best value so far is worse than the median of the other trials at the
    same epoch is stopped (from ``min_epochs`` on, once ``min_trials`` trials reported it)."""

    type: Literal["median"]
    min_epochs: int = Field(default=1, ge=1, le=10_000)
    min_trials: int = Field(default=2, ge=1, le=MAX_TRIALS)


EarlyStopping = Annotated[AshaRule | MedianRule, Field(discriminator="type")]


class SweepCreate(StrictModel):
    name: str | None = Field(default=None, min_length=1, max_length=200)
    job: dict[str, Any] = Field(description="A train or script job spec, as for POST /v1/jobs.")
    search_space: dict[str, SearchRange] = Field(
        description="Dotted paths into the job spec (parameters.*, model.*, resources.*, "
        "command_args.NAME for script jobs) and the values each may take.",
        json_schema_extra=allowed(f"1..{MAX_KEYS} keys"),
    )
    objective: Objective = Field(default_factory=Objective)
    algorithm: Literal["random", "grid", "tpe"] = Field(
        default="tpe", json_schema_extra=allowed("random, grid or tpe")
    )
    early_stopping: EarlyStopping | None = None
    max_trials: int = Field(default=10, ge=1, le=MAX_TRIALS, json_schema_extra=allowed(f"1..{MAX_TRIALS}"))
    max_concurrent_trials: int = Field(
        default=2, ge=1, le=MAX_TRIALS, json_schema_extra=allowed("1..max_trials")
    )
    seed: int = Field(default=1, ge=0, le=2**31 - 1, json_schema_extra=allowed("0..2147483647"))


class TrialPublic(BaseModel):
    number: int
    job_id: str
    params: dict[str, Any]
    state: str = Field(description="queued, running, completed, pruned, failed or cancelled.")
    job_status: str
    value: float | None = Field(
        default=None, description="The objective: the trial's best value over epochs."
    )
    epochs: int = Field(description="Epochs that reported the objective.")
    intermediate: dict[str, float] = Field(description="The objective by epoch.")
    reason: str | None = Field(default=None, description="Why a trial was pruned, failed or cancelled.")
    created_at: datetime
    finished_at: datetime | None = None


class SweepPublic(BaseModel):
    id: str
    name: str
    owner: str
    status: str = Field(description="running, succeeded, failed or cancelled.")
    type: str = Field(description="The trials' job type: train or script.")
    job: dict[str, Any]
    search_space: dict[str, Any]
    objective: dict[str, Any]
    algorithm: str
    early_stopping: dict[str, Any] | None
    max_trials: int
    max_concurrent_trials: int
    seed: int
    message: str | None = None
    trial_counts: dict[str, int] = Field(description="Trials by state.")
    best_trial: TrialPublic | None = None
    trials: list[TrialPublic] | None = Field(default=None, description="Every trial (not in lists).")
    epochs_run: int = Field(description="Epochs every trial reported, together: the compute spent.")
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None


class SweepList(BaseModel):
    items: list[SweepPublic]
    next_cursor: str | None = None


class SweepImportance(BaseModel):
    sweep_id: str
    objective: dict[str, Any]
    completed: int = Field(
        description="Completed trials with a value: what the importances are computed from."
    )
    importances: dict[str, float] | None = Field(
        default=None,
        description="Each search-space key's importance for the objective (0-1, together 1, largest "
        "first), by Optuna's get_param_importances (PED-ANOVA) over the completed trials; null "
        "until they are enough to tell the keys apart.",
    )
    message: str | None = Field(default=None, description="Why importances is null.")

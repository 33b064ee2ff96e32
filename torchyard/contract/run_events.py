"""``events.jsonl``: what the trainer tells the worker agent through the run folder.

Global rank 0 appends one JSON object per line, flushed as it is written: a ``metric``
point, the ``progress`` of the run, and once at the end its ``result``. The trainer writes
each line from a model here; the agent reads each with :data:`RUN_EVENT` and turns it into
the report batch of :mod:`torchyard.contract.reports`.

Reading is lenient where the trainer's summary may hold more than a report may: a missing
or unreadable ``time`` is read as None (the agent stamps the point when it reads it), and
``best`` and ``final`` keep only the known metric names with finite values. A line of
another ``type`` is not an event of this file.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, TypeAdapter

from torchyard.contract.metrics import METRIC_NAMES, MetricName


def _finite_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _time_or_none(value: Any) -> Any:
    return value if _finite_number(value) else None


def _known_metrics(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    return {
        name: float(number)
        for name, number in value.items()
        if isinstance(name, str) and name in METRIC_NAMES and _finite_number(number)
    }


def _known_metrics_or_none(value: Any) -> dict[str, float] | None:
    return None if value is None else _known_metrics(value)


# JSON numbers as they are: no bools, no strings, no floats where a count is meant.
EventCount = Annotated[int, Field(ge=0, strict=True)]
EventValue = Annotated[float, Field(allow_inf_nan=False, strict=True)]
EventTime = Annotated[
    float | None,
    BeforeValidator(_time_or_none),
    Field(description="When it happened, in seconds since the epoch (None: when the agent read it)."),
]
MetricValues = Annotated[dict[MetricName, float], BeforeValidator(_known_metrics)]


class MetricEvent(BaseModel):
    """One metric point of rank 0 (the trainer's names, docs/models.md)."""

    type: Literal["metric"] = "metric"
    name: MetricName
    value: EventValue
    epoch: EventCount
    step: EventCount = Field(description="Optimizer steps of the whole job so far.")
    rank: EventCount = 0
    time: EventTime = None


class ProgressEvent(BaseModel):
    """Where the run is: epoch ``epoch`` of ``epochs`` (1-based), step ``step`` of ``total_steps``."""

    type: Literal["progress"] = "progress"
    epoch: EventCount
    epochs: Annotated[int, Field(ge=1, strict=True)]
    step: EventCount
    total_steps: EventCount
    time: EventTime = None


class ResultEvent(BaseModel):
    """The run's summary, written just before its model directory appears; an evaluation's
    figures (``evaluation``) in an evaluation job."""

    type: Literal["result"] = "result"
    best_epoch: EventCount
    best: MetricValues = Field(default_factory=dict)
    final: Annotated[dict[MetricName, float] | None, BeforeValidator(_known_metrics_or_none)] = None
    stopped_early: Annotated[bool, BeforeValidator(bool)] = False
    epochs_run: EventCount
    evaluation: Annotated[
        dict[str, Any] | None, BeforeValidator(lambda value: value if isinstance(value, dict) else None)
    ] = Field(default=None, description="An evaluation's figures; the API checks their shape.")
    time: EventTime = None


RunEvent = Annotated[MetricEvent | ProgressEvent | ResultEvent, Field(discriminator="type")]
RUN_EVENT: TypeAdapter[MetricEvent | ProgressEvent | ResultEvent] = TypeAdapter(RunEvent)
#: The ``type`` of each event this file holds.
RUN_EVENT_TYPES: frozenset[str] = frozenset({"metric", "progress", "result"})

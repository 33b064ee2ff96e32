"""Report batches: what a worker agent sends about a running attempt (metric points,
log chunks, progress, the result) and the API's answer. The API validates them
strictly; the agent keeps its batches within the limits here."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AwareDatetime, BaseModel, Field, field_validator, model_validator

from torchyard.contract.base import StrictModel
from torchyard.contract.metrics import METRIC_NAME_PATTERN, MetricName

INT32_MAX = 2**31 - 1
MAX_RANK = 1_000_000
MAX_METRICS_PER_BATCH = 5000
MAX_LOG_CHUNKS_PER_BATCH = 1000
# The largest log chunk in UTF-8 bytes. Readers rely on it to find the chunk holding an offset.
MAX_LOG_CHUNK_BYTES = 256 * 1024
MAX_REPORT_BODY_BYTES = 16 * 1024 * 1024
# A file a script job wrote under its node's ``./logs`` (``TORCHYARD_LOG_DIR``) is the stream
# ``file-<node rank>/<path in that folder>``: path segments of letters, digits and ``._-``,
# none starting with a dot, at most 190 characters in all.
_SEGMENT = r"[A-Za-z0-9_-][A-Za-z0-9._-]*"
LOG_FILE_PATH_PATTERN = rf"{_SEGMENT}(/{_SEGMENT})*"
MAX_LOG_FILE_PATH = 190
STREAM_PATTERN = (
    r"^(rank-(0|[1-9][0-9]{0,6})|agent-[A-Za-z0-9][A-Za-z0-9._-]{0,199}"
    rf"|file-(0|[1-9][0-9]{{0,5}})/{LOG_FILE_PATH_PATTERN})$"
)
_STREAM = re.compile(STREAM_PATTERN)
_LOG_FILE_PATH = re.compile(rf"^{LOG_FILE_PATH_PATTERN}$")
FILE_STREAM_PREFIX = "file-"


def is_stream_name(name: str) -> bool:
    return len(name) <= 210 and _STREAM.match(name) is not None


def log_file_stream(node_rank: int, path: str) -> str | None:
    """The stream name of the file ``path`` (relative, ``/``-separated) of node ``node_rank``'s
    ``./logs`` folder; None when the path cannot be a stream name."""
    if len(path) > MAX_LOG_FILE_PATH or _LOG_FILE_PATH.match(path) is None:
        return None
    return f"{FILE_STREAM_PREFIX}{node_rank}/{path}"


def file_stream_node_rank(name: str) -> int | None:
    """The node rank of a ``file-<node rank>/<path>`` stream; None for other streams."""
    if not name.startswith(FILE_STREAM_PREFIX) or "/" not in name:
        return None
    head = name[len(FILE_STREAM_PREFIX) :].split("/", 1)[0]
    return int(head) if head.isascii() and head.isdigit() else None


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]


class MetricIn(StrictModel):
    name: str = Field(
        pattern=METRIC_NAME_PATTERN,
        description="A metric name: the trainer's (docs/models.md) or any a script logs.",
    )
    value: FiniteFloat
    epoch: Count
    step: Count
    rank: int = Field(ge=0, le=MAX_RANK)
    time: AwareDatetime = Field(
        strict=False, description="When the point was measured (ISO 8601 with a time zone)."
    )
    occurrence: Count = Field(
        default=0,
        description="Which value this is at its name, rank, epoch and step: 0 for the first, 1 for "
        "the next... (MLflow keeps several values at one step). Part of the point's key.",
    )


class LogChunkIn(StrictModel):
    stream: str = Field(
        pattern=STREAM_PATTERN,
        max_length=210,
        description="``rank-<global rank>``, ``agent-<node name>`` or ``file-<node rank>/<path>``.",
    )
    offset: int = Field(ge=0, le=2**62, description="Byte offset of ``data`` (UTF-8) in the stream.")
    data: str = Field(min_length=1, max_length=MAX_LOG_CHUNK_BYTES)

    @field_validator("data")
    @classmethod
    def _check_data(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("log data may not contain NUL characters")
        if len(value.encode("utf-8", "surrogatepass")) > MAX_LOG_CHUNK_BYTES:
            raise ValueError(f"a log chunk holds at most {MAX_LOG_CHUNK_BYTES} bytes")
        return value


class ProgressIn(StrictModel):
    epoch: Count
    epochs: int = Field(ge=1, le=INT32_MAX)
    step: Count
    total_steps: Count
    time: AwareDatetime | None = Field(default=None, strict=False)


#: The most classes an evaluation reports a confusion matrix for (its size grows as the square).
MAX_EVALUATION_CLASSES = 1000


class ClassScores(StrictModel):
    label: str = Field(max_length=200)
    precision: FiniteFloat
    recall: FiniteFloat
    f1: FiniteFloat
    support: Count


class EvaluationIn(StrictModel):
    """An evaluation job's figures over the whole dataset (docs/models.md)."""

    num_images: Count
    loss: FiniteFloat
    top1: FiniteFloat
    top5: FiniteFloat | None = None
    classes: list[str] = Field(max_length=MAX_EVALUATION_CLASSES)
    per_class: list[ClassScores] = Field(max_length=MAX_EVALUATION_CLASSES)
    confusion_matrix: list[list[Count]] = Field(
        max_length=MAX_EVALUATION_CLASSES,
        description="Rows: true labels, columns: predicted labels, both in ``classes`` order.",
    )


class ResultIn(StrictModel):
    best_epoch: Count
    best: dict[MetricName, FiniteFloat]
    final: dict[MetricName, FiniteFloat] | None = None
    stopped_early: bool
    epochs_run: Count
    evaluation: EvaluationIn | None = None


# What a job's MLflow runs may hold (docs/script-jobs.md): runs per node, params and tags in all, the
# longest value. The node's endpoint refuses more with MLflow's error, so a batch never does.
MAX_TRACKING_RUNS = 100
MAX_TRACKING_ITEMS = 2000
MAX_TRACKING_VALUE = 8000
MAX_TRACKING_KEY = 250


# MLflow params or tags: key → value, each within MLflow's own limits.
TrackingPairs = dict[
    Annotated[str, Field(max_length=MAX_TRACKING_KEY)],
    Annotated[str, Field(max_length=MAX_TRACKING_VALUE)],
]


class TrackingRunIn(StrictModel):
    """One MLflow run of a script job as its node's endpoint knows it."""

    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    name: str = Field(max_length=MAX_TRACKING_KEY)
    experiment: str = Field(max_length=500)
    status: str = Field(pattern=r"^(RUNNING|SCHEDULED|FINISHED|FAILED|KILLED)$")
    rank: int = Field(ge=0, le=MAX_RANK)
    params: TrackingPairs
    tags: TrackingPairs


class TrackingModelIn(StrictModel):
    """One MLflow logged model (MLflow 3's ``log_model``) of a script job as its node's endpoint
    knows it; its files are in the node's outputs, at ``artifacts``."""

    id: str = Field(pattern=r"^m-[0-9a-f]{32}$")
    name: str = Field(max_length=MAX_TRACKING_KEY)
    experiment: str = Field(max_length=500)
    status: str = Field(pattern=r"^(PENDING|READY|FAILED)$")
    rank: int = Field(ge=0, le=MAX_RANK)
    run: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$", description="The run that logged it.")
    type: str | None = Field(default=None, max_length=MAX_TRACKING_KEY)
    artifacts: str = Field(
        pattern=r"^mlflow/models/m-[0-9a-f]{32}/artifacts$", description="Its folder in the node's outputs."
    )
    params: TrackingPairs
    tags: TrackingPairs


class TrackingIn(StrictModel):
    """The MLflow runs and logged models of one node (all of them each time: sending it again
    changes nothing)."""

    runs: list[TrackingRunIn] = Field(max_length=MAX_TRACKING_RUNS)
    models: list[TrackingModelIn] = Field(default_factory=list, max_length=MAX_TRACKING_RUNS)

    @model_validator(mode="after")
    def _check_size(self) -> TrackingIn:
        items = sum(len(r.params) + len(r.tags) for r in self.runs)
        items += sum(len(m.params) + len(m.tags) for m in self.models)
        if items > MAX_TRACKING_ITEMS:
            raise ValueError(
                f"the runs and models hold at most {MAX_TRACKING_ITEMS} params and tags, not {items}"
            )
        return self


class ReportBatch(StrictModel):
    """One batch from a worker agent. Retrying a batch is harmless: points and chunks
    already stored are skipped (metrics by job/attempt/name/rank/epoch/step/occurrence, log
    chunks by attempt/stream/offset)."""

    metrics: list[MetricIn] = Field(default_factory=list, max_length=MAX_METRICS_PER_BATCH)
    logs: list[LogChunkIn] = Field(default_factory=list, max_length=MAX_LOG_CHUNKS_PER_BATCH)
    progress: ProgressIn | None = None
    result: ResultIn | None = None
    tracking: TrackingIn | None = Field(
        default=None,
        description="A script job's MLflow runs on this node (docs/script-jobs.md), when they changed.",
    )


class ReportAccepted(BaseModel):
    metrics: int = Field(description="Metric points stored by this request.")
    metrics_duplicate: int = Field(description="Points already stored by an earlier try, skipped.")
    metrics_dropped: int = Field(
        default=0, description="Points not stored: past the job's limits on metric points and names."
    )
    logs: int = Field(description="Log chunks stored by this request.")
    logs_duplicate: int = Field(description="Log chunks already stored, skipped.")
    progress: bool = False
    result: bool = False
    tracking: bool = False

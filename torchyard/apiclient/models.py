"""The response bodies of the API as typed models: those the service declares in the
contract (:mod:`torchyard.contract.responses`) under the client's names, and the client's own
readings of the rest (lenient: fields a newer service adds are kept, missing ones defaulted)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, field_validator

from torchyard.contract.failures import Failure
from torchyard.contract.responses import ClusterPublic as Cluster
from torchyard.contract.responses import CodePublic as CodePackage
from torchyard.contract.responses import (
    ComparedPoint,
    EndReason,
    MetricPage,
    MetricPoint,
    MetricSeries,
    NodeDrained,
    StatusChange,
)
from torchyard.contract.responses import DatasetPublic as Dataset
from torchyard.contract.responses import NodePublic as Node
from torchyard.contract.responses import TokenCreated as CreatedToken
from torchyard.contract.responses import TokenPublic as TokenInfo

# The contract's models under the client's names (the client's own models follow).
__all__ = [
    "Cluster",
    "CodePackage",
    "ComparedPoint",
    "CreatedToken",
    "Dataset",
    "EndReason",
    "Failure",
    "MetricPage",
    "MetricPoint",
    "MetricSeries",
    "Node",
    "NodeDrained",
    "StatusChange",
    "TokenInfo",
]

FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})


class ApiModel(BaseModel):
    """A response body; fields the service adds later are kept, not refused."""

    model_config = ConfigDict(extra="allow")


T = TypeVar("T", bound=BaseModel)


class Page(ApiModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


class Attempt(ApiModel):
    """One try at running a job: its nodes, times and why it ended."""

    number: int
    status: str
    nodes: list[str] = []
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    end_reason: EndReason | None = None


class Job(ApiModel):
    id: str
    name: str
    status: str
    type: str = "train"
    # Its team's name (docs/teams.md); None for a job older than teams.
    team: str | None = None
    # A training job's model spec; an evaluation's registered model ("name:version").
    model: dict[str, Any] | str = {}
    dataset: str | None = None
    train_dataset: str | None = None
    validation_dataset: str | None = None
    parameters: dict[str, Any] = {}
    resources: dict[str, Any] = {}
    priority: int = 0
    reason: str | None = None
    failure: Failure | None = None
    progress: dict[str, Any] | None = None
    best: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    model_sha256: str | None = None
    model_size: int | None = None
    code: str | None = None
    command: list[str] | None = None
    outputs_sha256: str | None = None
    outputs_size: int | None = None
    nodes: list[str] = []
    restarts: int = 0
    attempts: list[Attempt] | None = None
    history: list[StatusChange] | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    tags: list[str] = []
    note: str | None = None
    # A script job's MLflow runs: {"params", "tags", "runs": [{"id", "name", "experiment",
    # "status", "rank", "node_rank", "attempt", "params", "tags"}]} (docs/script-jobs.md).
    tracking: dict[str, Any] | None = None

    @field_validator("model", "parameters", mode="before")
    @classmethod
    def _absent_is_empty(cls, value: Any) -> Any:
        # Fields of another job type are null: read them as empty.
        return {} if value is None else value

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES


class ComparedMetric(ApiModel):
    best: ComparedPoint | None = None
    final: ComparedPoint | None = None
    series: MetricSeries = MetricSeries(x=[], y=[], count=0)


class ComparedJob(ApiModel):
    id: str
    name: str
    type: str = "train"
    status: str
    parameters: dict[str, Any] = {}
    duration_s: float | None = None
    images_per_sec: float | None = None
    # "epoch" or "step": how the job counts its metrics (None from a service that does not say).
    axis: str | None = None
    # What its MLflow runs logged, as compare rows ("mlflow: lr", "mlflow tag: team").
    logged: dict[str, str] = {}
    metrics: dict[str, ComparedMetric] = {}

    @property
    def counted_by(self) -> str:
        """``epoch`` or ``step``: the service's word, else epochs where a point is past epoch 0."""
        if self.axis in ("epoch", "step"):
            return self.axis
        points = [p for m in self.metrics.values() for p in (m.best, m.final) if p is not None]
        return "epoch" if self.type == "train" or any(p.epoch > 0 for p in points) else "step"


class JobComparison(ApiModel):
    """``GET /v1/jobs/compare``: the jobs in the order asked, the metrics compared, which way
    each is better, and the parameter keys that differ."""

    jobs: list[ComparedJob]
    metrics: list[str] = []
    goals: dict[str, str] = {}
    differing: list[str] = []
    logged_differing: list[str] = []
    points: int = 0


@dataclass(frozen=True)
class Event:
    """One server-sent event of ``GET /v1/jobs/{id}/events``.

    ``kind`` is ``status``, ``metric`` or ``log`` (or ``end``, sent instead of a final
    status to a client that resumed after it); ``id`` is the resume position
    (send it back as ``Last-Event-ID``); ``data`` is the decoded JSON payload.
    """

    id: str | None
    kind: str
    data: dict[str, Any]

    @property
    def is_final(self) -> bool:
        return self.kind == "end" or (self.kind == "status" and self.data.get("status") in FINAL_STATUSES)

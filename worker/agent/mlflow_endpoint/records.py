"""What the endpoint keeps of a placement's MLflow calls: its runs, logged models and processes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class TrackedRun:
    run_id: str
    experiment_id: str
    run_name: str
    user_id: str
    start_time: int
    artifact_uri: str
    rank: int
    status: str = "RUNNING"
    end_time: int | None = None
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    latest: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    outputs: list[dict[str, Any]] = field(default_factory=list)  # logged models: model_id, step

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "run_id": self.run_id,
            "run_uuid": self.run_id,
            "run_name": self.run_name,
            "experiment_id": self.experiment_id,
            "user_id": self.user_id,
            "status": self.status,
            "start_time": self.start_time,
            "artifact_uri": self.artifact_uri,
            "lifecycle_stage": "active",
        }
        if self.end_time is not None:
            info["end_time"] = self.end_time
        return info

    def data(self) -> dict[str, Any]:
        return {
            "metrics": list(self.latest.values()),
            "params": [{"key": k, "value": v} for k, v in self.params.items()],
            "tags": [{"key": k, "value": v} for k, v in self.tags.items()],
        }


# A logged model's status: MLflow's REST name → the short name the job's tracking shows.
MODEL_STATUS = {"LOGGED_MODEL_PENDING": "PENDING", "LOGGED_MODEL_READY": "READY",
                 "LOGGED_MODEL_UPLOAD_FAILED": "FAILED"}  # fmt: skip


@dataclass
class LoggedModel:
    """An MLflow 3 logged model (``mlflow.<flavor>.log_model``, ``mlflow.initialize_logged_model``)."""

    model_id: str
    experiment_id: str
    name: str
    source_run_id: str
    model_type: str
    rank: int
    created: int
    artifact_uri: str
    artifact_path: str  # in the node's outputs
    status: str = "LOGGED_MODEL_PENDING"
    updated: int = 0
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # the latest of each name

    def proto(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "model_id": self.model_id,
            "experiment_id": self.experiment_id,
            "name": self.name,
            "creation_timestamp_ms": self.created,
            "last_updated_timestamp_ms": self.updated or self.created,
            "artifact_uri": self.artifact_uri,
            "status": self.status,
            "tags": [{"key": k, "value": v} for k, v in self.tags.items()],
        }
        if self.source_run_id:
            info["source_run_id"] = self.source_run_id
        if self.model_type:
            info["model_type"] = self.model_type
        return {
            "info": info,
            "data": {
                "params": [{"key": k, "value": v} for k, v in self.params.items()],
                "metrics": list(self.metrics.values()),
            },
        }


@dataclass
class TrackedProcess:
    rank: int
    name: str  # "rank-<rank>" or "node-<node rank>"
    metrics_path: Path
    # Per metric: the values shipped at each step so far (the next one's occurrence), and
    # the highest step (where a call without a step goes next).
    step_values: dict[str, dict[int, int]] = field(default_factory=dict)
    top_step: dict[str, int] = field(default_factory=dict)
    # per_node: the node's command starts its ranks; each caller's rank is its RANK.
    ranks_from_caller: bool = False
    by_rank: dict[int, TrackedProcess] = field(default_factory=dict)

    def as_rank(self, rank: int | None) -> TrackedProcess:
        """The process as one rank of a node's command sees it (its own steps per metric)."""
        if not self.ranks_from_caller or rank is None or rank == self.rank:
            return self
        found = self.by_rank.get(rank)
        if found is None:
            found = self.by_rank[rank] = TrackedProcess(rank, self.name, self.metrics_path)
        return found

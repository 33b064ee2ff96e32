"""An MLflow tracking endpoint for one script placement (docs/script-jobs.md).

Each placement of a script job on a node gets its own endpoint: a small HTTP server on the
loopback interface, on a port of its own, speaking the subset of MLflow's REST tracking
API (``/api/2.0/mlflow/...``) that the MLflow client, Lightning's ``MLFlowLogger`` and
Hugging Face's MLflow callback use. Every process of the placement gets
``MLFLOW_TRACKING_URI`` (the endpoint) and ``MLFLOW_TRACKING_TOKEN`` (a random token of
its own, which tells the endpoint the process's rank); a request without a token of this
placement is 401, so a script reaches its own job's runs and nothing else.

In the ``per_node`` launch mode the node's one command starts its ranks itself (``torchrun``
…), and they all inherit the node's token. Their points carry the rank of the process that
calls: the endpoint finds the process holding the other end of the connection (its socket
in ``/proc/net/tcp``, then the process with that socket open) and reads ``RANK`` from its
environment (the variable ``torchrun`` gives each rank), once per connection; where that
cannot be read, the node's first rank.

What it is told goes where the rest of a script's reports go, through files the
placement's reporter already ships exactly once:

* a metric point is one JSON line appended to ``metrics/mlflow-<process>.jsonl`` (in the
  agent's own folder of the placement, out of the script's reach) before
  the answer is sent (the reporter ships those lines like ``torchyard.run.log_metric``'s,
  keyed by name, rank, step and ``occurrence``, so an API outage or a retried batch loses
  or doubles nothing). A point keeps its step; several values at one step of a name and
  rank (MLflow's history keeps them all) are told apart by their ``occurrence`` there, 0,
  1..., counted here in the order they were logged. Only a metric sent without a step
  takes the next step above the highest one so far. Non-finite values are kept in the
  run's history here but not shipped (the metrics API holds finite numbers);
* params, tags, the runs and MLflow 3's logged models are the file ``tracking.json``
  (rewritten whole on each change; the reporter sends it when it changed), shown as the
  job's ``tracking``;
* a run's ``artifact_uri`` is a folder under the node's outputs
  (``outputs/mlflow/<run id>/artifacts``), so ``mlflow.log_artifact(s)`` copies files there
  itself and they are part of the job's outputs archive; so is a logged model's
  (``outputs/mlflow/models/<model id>/artifacts``).

``GET /`` (where MLflow's "View run" links lead: their ``#/...`` stays in the browser) is a
page saying that there is no web UI here and where the job's data are; the processes also
get ``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT`` so that the client prints no such link.

Errors are MLflow's: ``{"error_code": "INVALID_PARAMETER_VALUE", "message": ...}`` with a
4xx status for bad input, ``RESOURCE_DOES_NOT_EXIST`` (404) for an unknown run or
experiment, ``ENDPOINT_NOT_FOUND`` (404) for a call it does not serve.

Connections cost the node's agent a thread each, so an endpoint holds at most
:data:`MAX_CONNECTIONS` at once: a further one waits (it and those behind it in the listen
backlog) until one ends, and the connection idle the longest (waiting for its first or next
request) is closed at once to make room; MLflow's client opens a new one for its next call.
A connection that sends nothing for :data:`CONNECTION_TIMEOUT_S`, between requests or within
one, is closed without an answer.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

from torchyard.contract.metrics import is_metric_name
from torchyard.contract.reports import MAX_TRACKING_ITEMS, MAX_TRACKING_RUNS, MAX_TRACKING_VALUE
from worker.agent import peers, sandbox

log = logging.getLogger(__name__)

TRACKING_FILE = "tracking.json"
MAX_BODY_BYTES = 4 << 20
# Connections served at once by one endpoint (a thread each). A job's processes on a node
# (at most a few dozen, each with a keep-alive connection or a few) fit; more wait.
MAX_CONNECTIONS = 32
# A connection silent this long (no request, or a request stalled halfway) is closed.
CONNECTION_TIMEOUT_S = 30.0
LISTEN_BACKLOG = 128
# How long stop() lets calls in progress finish before it cuts their connections.
STOP_WAIT_S = 5.0
# MLflow's own limits on one log-batch call.
MAX_BATCH_METRICS = 1000
MAX_BATCH_PARAMS = 100
MAX_BATCH_TAGS = 100
MAX_KEY = 250
MAX_HISTORY_POINTS = 1_000_000  # per process: older points of get-history are forgotten past it
API_PREFIXES = ("/api/2.0/mlflow/", "/ajax-api/2.0/mlflow/", "/api/2.0/preview/mlflow/")
_SPACES = re.compile(r"\s")
DEFAULT_EXPERIMENT = "0"


class MlflowError(Exception):
    def __init__(self, message: str, code: str = "INVALID_PARAMETER_VALUE", status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class _Run:
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
_MODEL_STATUS = {"LOGGED_MODEL_PENDING": "PENDING", "LOGGED_MODEL_READY": "READY",
                 "LOGGED_MODEL_UPLOAD_FAILED": "FAILED"}  # fmt: skip


@dataclass
class _Model:
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
class _Process:
    rank: int
    name: str  # "rank-<rank>" or "node-<node rank>"
    metrics_path: Path
    # Per metric: the values shipped at each step so far (the next one's occurrence), and
    # the highest step (where a call without a step goes next).
    step_values: dict[str, dict[int, int]] = field(default_factory=dict)
    top_step: dict[str, int] = field(default_factory=dict)
    # per_node: the node's command starts its ranks; each caller's rank is its RANK.
    ranks_from_caller: bool = False
    by_rank: dict[int, _Process] = field(default_factory=dict)

    def as_rank(self, rank: int | None) -> _Process:
        """The process as one rank of a node's command sees it (its own steps per metric)."""
        if not self.ranks_from_caller or rank is None or rank == self.rank:
            return self
        found = self.by_rank.get(rank)
        if found is None:
            found = self.by_rank[rank] = _Process(rank, self.name, self.metrics_path)
        return found


class TrackingStore:
    """The runs of one placement, and the files their reports travel through."""

    def __init__(self, state_dir: Path, outputs_dir: Path, node_rank: int) -> None:
        # The agent's folder of the placement (never the run's tree): its files are written
        # by the agent, which a script could otherwise point at any file through a link.
        self.state_dir = state_dir
        self.outputs_dir = outputs_dir
        self.node_rank = node_rank
        self.lock = threading.Lock()
        self.experiments: dict[str, dict[str, Any]] = {
            DEFAULT_EXPERIMENT: self._experiment(DEFAULT_EXPERIMENT, "Default", {})
        }
        self.runs: dict[str, _Run] = {}
        self.models: dict[str, _Model] = {}
        self.processes: dict[str, _Process] = {}
        self._history_points = 0
        # Connections relayed from a run without network (worker.agent.net_bridge): the
        # bridge's own address of each → the rank its relay found for the caller.
        self._bridged: dict[tuple[str, int], tuple[int | None]] = {}

    def bridge(self, address: tuple[str, int], rank: int | None) -> None:
        """Say which rank a connection relayed from ``address`` comes from (None: unknown)."""
        with self.lock:
            self._bridged[address] = (rank,)

    def unbridge(self, address: tuple[str, int]) -> None:
        with self.lock:
            self._bridged.pop(address, None)

    def bridged_rank(self, address: Any) -> tuple[int | None] | None:
        """The rank a bridge gave for a connection, in a 1-tuple; None for a direct one."""
        with self.lock:
            return self._bridged.get(tuple(address[:2])) if isinstance(address, tuple) else None

    # --- who is asking -------------------------------------------------------------------

    def add_process(self, rank: int, name: str, *, ranks_from_caller: bool = False) -> str:
        """A token for one process (its rank is the rank of the points it logs), or with
        ``ranks_from_caller`` for a node's command whose ranks share it (each caller's
        ``RANK``, ``rank`` where the caller's cannot be read)."""
        token = secrets.token_urlsafe(24)
        path = self.state_dir / "metrics" / f"mlflow-{name}.jsonl"
        self.processes[token] = _Process(rank, name, path, ranks_from_caller=ranks_from_caller)
        return token

    def process(self, token: str | None) -> _Process | None:
        if not token:
            return None
        for known, proc in self.processes.items():
            if secrets.compare_digest(known, token):
                return proc
        return None

    # --- experiments ---------------------------------------------------------------------

    def _experiment(self, experiment_id: str, name: str, tags: dict[str, str]) -> dict[str, Any]:
        now = _now_ms()
        return {
            "experiment_id": experiment_id,
            "name": name,
            "artifact_location": (self.outputs_dir / "mlflow").as_uri(),
            "lifecycle_stage": "active",
            "creation_time": now,
            "last_update_time": now,
            "tags": [{"key": k, "value": v} for k, v in tags.items()],
        }

    def experiment_by_name(self, name: str) -> dict[str, Any]:
        with self.lock:
            for experiment in self.experiments.values():
                if experiment["name"] == name:
                    return experiment
        raise MlflowError(f"Could not find experiment with name '{name}'", "RESOURCE_DOES_NOT_EXIST", 404)

    def experiment(self, experiment_id: str) -> dict[str, Any]:
        with self.lock:
            found = self.experiments.get(experiment_id)
        if found is None:
            raise MlflowError(f"No Experiment with id={experiment_id} exists", "RESOURCE_DOES_NOT_EXIST", 404)
        return found

    def create_experiment(self, name: str, tags: dict[str, str]) -> str:
        """A name the job already has gives that experiment (where MLflow's server answers
        RESOURCE_ALREADY_EXISTS): the ranks of a job call ``mlflow.set_experiment(name)`` at
        the same moment, and MLflow's client, losing that race, leaves the loser's runs in
        the Default experiment. Experiments here are the job's own, so one name is one."""
        with self.lock:
            for experiment in self.experiments.values():
                if experiment["name"] == name:
                    return str(experiment["experiment_id"])
            if len(self.experiments) >= MAX_TRACKING_RUNS:
                raise MlflowError(f"a job holds at most {MAX_TRACKING_RUNS} experiments")
            experiment_id = str(len(self.experiments))
            self.experiments[experiment_id] = self._experiment(experiment_id, name, tags)
            return experiment_id

    # --- runs ----------------------------------------------------------------------------

    def create_run(self, proc: _Process, experiment_id: str, run_name: str | None, user_id: str,
                   start_time: int | None, tags: dict[str, str]) -> _Run:  # fmt: skip
        self.experiment(experiment_id)
        run_id = uuid.uuid4().hex
        name = run_name or tags.get("mlflow.runName") or f"run-{run_id[:8]}"
        with self.lock:
            if len(self.runs) >= MAX_TRACKING_RUNS:
                raise MlflowError(f"a job holds at most {MAX_TRACKING_RUNS} runs")
            run = _Run(
                run_id=run_id,
                experiment_id=experiment_id,
                run_name=name,
                user_id=user_id,
                start_time=start_time or _now_ms(),
                artifact_uri=(self.outputs_dir / "mlflow" / run_id / "artifacts").as_uri(),
                rank=proc.rank,
            )
            self._check_total(len(set(tags) | {"mlflow.runName"}))
            run.tags.update(tags)
            run.tags["mlflow.runName"] = name
            self.runs[run_id] = run
            self._write_tracking()
        return run

    def run(self, run_id: str) -> _Run:
        with self.lock:
            found = self.runs.get(run_id)
        if found is None:
            raise MlflowError(f"Run '{run_id}' not found", "RESOURCE_DOES_NOT_EXIST", 404)
        return found

    def update_run(self, run_id: str, status: str | None, end_time: int | None, run_name: str | None) -> _Run:
        run = self.run(run_id)
        with self.lock:
            if status is not None:
                run.status = status
            if end_time is not None:
                run.end_time = end_time
            if run_name:
                run.run_name = run_name
                run.tags["mlflow.runName"] = run_name
            self._write_tracking()
        return run

    def log(self, proc: _Process, run_id: str, metrics: list[dict[str, Any]], params: dict[str, str],
            tags: dict[str, str], delete_tags: tuple[str, ...] = ()) -> None:  # fmt: skip
        """Record one call's metrics, params and tags: all of it or (an error) none of it."""
        run = self.run(run_id)
        with self.lock:
            for key, value in params.items():
                old = run.params.get(key)
                if old is not None and old != value:
                    raise MlflowError(
                        f"Changing param values is not allowed. Param with key='{key}' was already "
                        f"logged with value='{old}' for run ID='{run_id}'. Attempted logging new value "
                        f"'{value}'."
                    )
            self._check_total(len(set(params) - set(run.params)) + len(set(tags) - set(run.tags)))
            for m in metrics:
                if m["step"] is None:  # no step in the call: the next one above the highest
                    step = proc.top_step.get(m["key"], -1) + 1
                    m["step"] = proc.top_step[m["key"]] = step
            metrics = self._model_metrics(run, metrics)
            lines = [self._point(proc, m) for m in metrics]
            shipped = [line for line in lines if line is not None]
            if shipped:
                data = "".join(json.dumps(p, separators=(",", ":")) + "\n" for p in shipped).encode()
                # One write with O_APPEND: a line is on disk whole before the call is answered.
                fd = os.open(proc.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
            for m in metrics:
                point = {
                    "key": m["key"],
                    "value": _json_number(m["value"]),
                    "timestamp": m["timestamp"],
                    "step": m["step"],
                }
                run.latest[m["key"]] = point
                if self._history_points < MAX_HISTORY_POINTS:
                    run.history.setdefault(m["key"], []).append(point)
                    self._history_points += 1
            run.params.update(params)
            run.tags.update(tags)
            for key in delete_tags:
                run.tags.pop(key, None)
            if params or tags or delete_tags:
                self._write_tracking()

    def _point(self, proc: _Process, metric: dict[str, Any]) -> dict[str, Any] | None:
        value = metric["value"]
        if not math.isfinite(value):
            return None
        name = metric["key"]
        step = metric["step"]
        values = proc.step_values.setdefault(name, {})
        occurrence = values.get(step, 0)
        values[step] = occurrence + 1
        proc.top_step[name] = max(step, proc.top_step.get(name, -1))
        point = {
            "name": name,
            "value": value,
            "step": step,
            "epoch": 0,
            "rank": proc.rank,
            "time": metric["timestamp"] / 1000.0,
        }
        if occurrence:
            point["occurrence"] = occurrence
        return point

    def _model_metrics(self, run: _Run, metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Give the metrics that name a logged model to it; the call's metrics less those the run
        has already (``log_model`` logs the run's metrics at its step again, for the model:
        MLflow's store keeps one point of the same name, value, time and step)."""
        fresh = []
        for m in metrics:
            model_id = m.get("model_id")
            if not model_id:
                fresh.append(m)
                continue
            model = self.models.get(model_id)
            point = {"key": m["key"], "value": _json_number(m["value"]), "timestamp": m["timestamp"],
                     "step": m["step"]}  # fmt: skip
            if model is not None:
                model.metrics[m["key"]] = {**point, "model_id": model_id, "run_id": run.run_id}
            if point not in run.history.get(m["key"], ()):
                fresh.append(m)
        return fresh

    def _check_total(self, adding: int) -> None:
        """Params and tags of the runs and logged models together, with ``adding`` more."""
        total = sum(len(r.params) + len(r.tags) for r in self.runs.values()) + adding
        total += sum(len(m.params) + len(m.tags) for m in self.models.values())
        if total > MAX_TRACKING_ITEMS:
            raise MlflowError(f"a job holds at most {MAX_TRACKING_ITEMS} params and tags")

    def _write_tracking(self) -> None:
        """``tracking.json``: the runs with their params and tags (lock held)."""
        runs = [
            {
                "id": r.run_id,
                "name": r.run_name,
                "experiment": self.experiments[r.experiment_id]["name"],
                "status": r.status,
                "rank": r.rank,
                "params": dict(r.params),
                "tags": dict(r.tags),
            }
            for r in self.runs.values()
        ]
        tracking: dict[str, Any] = {"runs": runs}
        if self.models:  # only then: an API that knows no logged models takes the runs as before
            tracking["models"] = [
                {
                    "id": m.model_id,
                    "name": m.name,
                    "experiment": self.experiments[m.experiment_id]["name"],
                    "status": _MODEL_STATUS[m.status],
                    "rank": m.rank,
                    "run": m.source_run_id or None,
                    "type": m.model_type or None,
                    "artifacts": m.artifact_path,
                    "params": dict(m.params),
                    "tags": dict(m.tags),
                }
                for m in self.models.values()
            ]
        path = self.state_dir / TRACKING_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(tracking, sort_keys=True))
        os.replace(tmp, path)

    def history(self, run_id: str, key: str) -> list[dict[str, Any]]:
        run = self.run(run_id)
        with self.lock:
            return list(run.history.get(key, []))

    def log_outputs(self, run_id: str, outputs: list[dict[str, Any]]) -> None:
        """A run's outputs: the logged models it made (``log_model`` within a run)."""
        run = self.run(run_id)
        with self.lock:
            for output in outputs:
                if output not in run.outputs and len(run.outputs) < MAX_TRACKING_RUNS:
                    run.outputs.append(output)

    # --- logged models (MLflow 3) --------------------------------------------------------

    def create_model(self, proc: _Process, experiment_id: str, name: str | None, source_run_id: str | None,
                     model_type: str | None, params: dict[str, str], tags: dict[str, str]) -> _Model:  # fmt: skip
        """A logged model, PENDING, its artifacts a folder of the node's outputs
        (``mlflow/models/<model id>/artifacts``, where MLflow's server puts them under the
        experiment's artifact location): the client copies its files there itself."""
        self.experiment(experiment_id)
        if source_run_id:
            self.run(source_run_id)
        model_id = f"m-{uuid.uuid4().hex}"
        path = f"mlflow/models/{model_id}/artifacts"
        now = _now_ms()
        with self.lock:
            if len(self.models) >= MAX_TRACKING_RUNS:
                raise MlflowError(f"a job holds at most {MAX_TRACKING_RUNS} logged models per node")
            self._check_total(len(params) + len(tags))
            model = _Model(
                model_id=model_id,
                experiment_id=experiment_id,
                name=name or f"model-{model_id[2:10]}",
                source_run_id=source_run_id or "",
                model_type=model_type or "",
                rank=proc.rank,
                created=now,
                artifact_uri=(self.outputs_dir / path).as_uri(),
                artifact_path=path,
                params=dict(params),
                tags=dict(tags),
            )
            self.models[model_id] = model
            self._write_tracking()
        return model

    def model(self, model_id: str) -> _Model:
        with self.lock:
            found = self.models.get(model_id)
        if found is None:
            raise MlflowError(f"Logged model with ID '{model_id}' not found.", "RESOURCE_DOES_NOT_EXIST", 404)
        return found

    def change_model(self, model_id: str, *, status: str | None = None, params: dict[str, str] | None = None,
                     tags: dict[str, str] | None = None, delete_tag: str | None = None) -> _Model:  # fmt: skip
        """Finalize a model, log params or set tags on it, or delete one of its tags."""
        model = self.model(model_id)
        with self.lock:
            params, tags = params or {}, tags or {}
            self._check_total(len(set(params) - set(model.params)) + len(set(tags) - set(model.tags)))
            if delete_tag is not None and delete_tag not in model.tags:
                raise MlflowError(
                    f"No tag with key {delete_tag!r} found for model with ID {model_id!r}.",
                    "RESOURCE_DOES_NOT_EXIST",
                    404,
                )
            if status is not None:
                model.status = status
            model.params.update(params)
            model.tags.update(tags)
            if delete_tag is not None:
                del model.tags[delete_tag]
            model.updated = _now_ms()
            self._write_tracking()
        return model

    def search_models(self, experiment_ids: list[str], where: Callable[[_Model], bool],
                      order: list[tuple[str, bool]]) -> list[_Model]:  # fmt: skip
        """The models of ``experiment_ids`` (all where none) that ``where`` keeps, in MLflow's
        order: by ``order``'s fields (those a model lacks last), then the newest first, then by id."""
        with self.lock:
            found = [
                m
                for m in self.models.values()
                if (not experiment_ids or m.experiment_id in experiment_ids) and where(m)
            ]
        found.sort(key=lambda m: m.model_id)
        if not any(_MODEL_FIELDS.get(name) == "created" for name, _ascending in order):
            found.sort(key=lambda m: m.created, reverse=True)
        for name, ascending in reversed(order):
            present = [m for m in found if _model_field(m, name) is not None]
            present.sort(key=lambda m: cast(Any, _model_field(m, name)), reverse=not ascending)
            found = present + [m for m in found if _model_field(m, name) is None]
        return found


# What a search of logged models may filter and order by: MLflow's names of a model's
# attributes (the numeric ones compare as numbers), and ``metrics.`` / ``params.`` / ``tags.``.
_MODEL_FIELDS = {
    "name": "name", "model_id": "model_id", "model_type": "model_type", "status": "status",
    "source_run_id": "source_run_id", "creation_time": "created", "creation_timestamp": "created",
    "creation_timestamp_ms": "created", "last_updated_time": "updated", "last_updated_timestamp": "updated",
    "last_updated_timestamp_ms": "updated",
}  # fmt: skip
_NUMERIC_MODEL_FIELDS = ("created", "updated")
_ENTITIES = {"metric": "metrics", "metrics": "metrics", "param": "params", "params": "params",
             "parameter": "params", "parameters": "params", "tag": "tags", "tags": "tags",
             "attribute": "", "attributes": "", "attr": ""}  # fmt: skip


def _check_model_field(name: str) -> str:
    """``name`` as a field of a logged model (``metrics.loss``, ``tags.team``, ``name``...)."""
    entity, dot, key = name.partition(".")
    key = key.strip('`"')
    if dot and entity.lower() in _ENTITIES:
        prefix = _ENTITIES[entity.lower()]
        name = f"{prefix}.{key}" if prefix else key
    if name.partition(".")[0] in ("metrics", "params", "tags") and name.partition(".")[2]:
        return name
    if name not in _MODEL_FIELDS:
        raise MlflowError(
            f"Invalid logged model search key '{name}': one of {', '.join(sorted(_MODEL_FIELDS))}, or "
            "metrics.<name>, params.<name>, tags.<name>."
        )
    return name


def _model_field(model: _Model, name: str) -> Any:
    """The value of a field :func:`_check_model_field` gave (None where the model has none)."""
    entity, _dot, key = name.partition(".")
    if entity == "metrics":
        metric = model.metrics.get(key)
        return None if metric is None else float(metric["value"])
    if entity == "params":
        return model.params.get(key)
    if entity == "tags":
        return model.tags.get(key)
    field_name = _MODEL_FIELDS[name]
    if field_name == "status":
        return _MODEL_STATUS[model.status]
    if field_name == "updated":
        return model.updated or model.created
    return getattr(model, field_name) or None


_CLAUSE = re.compile(
    r"""\s*(?P<key>[A-Za-z_][\w.\-/:]*(?:`[^`]*`|"[^"]*")?)\s*"""
    r"""(?P<op>!=|>=|<=|=|<|>|(?i:ilike|like)(?=[\s'"]))\s*"""
    r"""(?P<value>'[^']*'|"[^"]*"|-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)\s*(?P<more>(?i:and)\s|$)"""
)


def _like(pattern: str, flags: int = 0) -> re.Pattern[str]:
    """SQL's LIKE pattern (``%`` any text, ``_`` any character) as a regular expression."""
    parts = [".*" if c == "%" else "." if c == "_" else re.escape(c) for c in pattern]
    return re.compile("".join(parts), flags | re.DOTALL)


def _model_filter(text: str | None) -> Callable[[_Model], bool]:
    """MLflow's filter of a search of logged models: clauses ``<field> <op> <value>`` joined
    by ``AND``; metrics and the timestamps compare as numbers (``= != < <= > >=``), the rest
    as text (``= != LIKE ILIKE``)."""
    clauses: list[tuple[str, str, Any]] = []
    position = 0
    text = (text or "").strip()
    while position < len(text):
        found = _CLAUSE.match(text, position)
        if found is None:
            raise MlflowError(
                f"Invalid filter {text!r} at {text[position : position + 40]!r}: clauses "
                "<field> <comparator> <value> joined by AND (values quoted, numbers as they are)."
            )
        name = _check_model_field(found["key"])
        op, raw = found["op"].upper(), found["value"]
        numeric = name.startswith("metrics.") or _MODEL_FIELDS.get(name) in _NUMERIC_MODEL_FIELDS
        quoted = raw[0] in "'\""
        wrong = (quoted or "LIKE" in op) if numeric else (not quoted or op in ("<", "<=", ">", ">="))
        if wrong:
            kind = "a number" if numeric else "quoted text"
            raise MlflowError(
                f"Invalid filter clause {found.group(0).strip()!r}: {name} compares with {kind}."
            )
        value: Any = float(raw) if numeric else raw[1:-1]
        if "LIKE" in op:
            value = _like(value, re.IGNORECASE if op == "ILIKE" else 0)
        clauses.append((name, op, value))
        position = found.end()

    def keep(model: _Model) -> bool:
        for name, op, value in clauses:
            have = _model_field(model, name)
            if have is None:
                return False
            if op in ("LIKE", "ILIKE"):
                ok = value.fullmatch(have) is not None
            else:
                ok = {"=": have == value, "!=": have != value, "<": have < value, "<=": have <= value,
                      ">": have > value, ">=": have >= value}[op]  # fmt: skip
            if not ok:
                return False
        return True

    return keep


def _json_number(value: float) -> float | str:
    """A value as MLflow's JSON holds it: NaN and the infinities quoted."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


# --- the request's fields -------------------------------------------------------------------


def _text(body: dict[str, Any], name: str, *, required: bool = True, limit: int = MAX_KEY) -> str | None:
    value = body.get(name)
    if value is None or value == "":
        if required:
            raise MlflowError(f"Missing value for required parameter '{name}'.")
        return None
    if not isinstance(value, str):
        raise MlflowError(f"Invalid value {value!r} for parameter '{name}': a string is expected.")
    if len(value) > limit:
        raise MlflowError(f"Parameter '{name}' holds at most {limit} characters, not {len(value)}.")
    return value


def _integer(value: Any, name: str, default: int | None) -> int | None:
    if value is None:
        return default
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,19}", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        raise MlflowError(f"Invalid value {value!r} for parameter '{name}': an integer is expected.")
    return value


def _metric(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise MlflowError("A metric must be an object with 'key', 'value', 'timestamp' and 'step'.")
    key = _text(item, "key")
    assert key is not None
    name = _SPACES.sub("_", key)
    if not is_metric_name(name):
        raise MlflowError(
            f"Invalid metric name '{key}': letters, digits and _ . : / - (spaces become _), "
            "at most 64 characters, not starting with . : / -."
        )
    raw = item.get("value")
    if isinstance(raw, str) and raw in ("NaN", "Infinity", "-Infinity"):
        value = float(raw.replace("Infinity", "inf"))
    elif isinstance(raw, bool) or not isinstance(raw, int | float):
        raise MlflowError(f"Invalid value {raw!r} for metric '{key}': a number is expected.")
    else:
        value = float(raw)
    step = _integer(item.get("step"), "step", None)  # None: none given (MLflow's client always sends one)
    if step is not None and not 0 <= step < 2**31:
        raise MlflowError(f"Invalid step {step} for metric '{key}': 0 to 2147483647.")
    timestamp = _integer(item.get("timestamp"), "timestamp", _now_ms())
    model_id = _text(item, "model_id", required=False)  # a logged model's metric (MLflow 3)
    return {"key": name, "value": value, "step": step, "timestamp": timestamp, "model_id": model_id}


def _pairs(items: Any, what: str, limit: int, value_limit: int) -> dict[str, str]:
    if items is None:
        return {}
    if not isinstance(items, list):
        raise MlflowError(f"'{what}' must be a list of {{key, value}} objects.")
    if len(items) > limit:
        raise MlflowError(f"A batch holds at most {limit} {what}, not {len(items)}.")
    pairs: dict[str, str] = {}
    for item in items:
        if not isinstance(item, dict):
            raise MlflowError(f"'{what}' must be a list of {{key, value}} objects.")
        key = _text(item, "key")
        value = item.get("value")
        if value is None:
            value = ""
        if not isinstance(value, str):
            value = json.dumps(value)
        if len(value) > value_limit:
            raise MlflowError(
                f"The value of '{key}' holds at most {value_limit} characters, not {len(value)}."
            )
        assert key is not None
        pairs[key] = value
    return pairs


# --- the calls ------------------------------------------------------------------------------


_RUN_STATUS = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")
_Call = Callable[[TrackingStore, _Process, dict[str, Any]], Any]


def _run_id(body: dict[str, Any]) -> str:
    run_id = _text(body, "run_id", required=False) or _text(body, "run_uuid", required=False)
    if run_id is None:
        raise MlflowError("Missing value for required parameter 'run_id'.")
    return run_id


def _required(body: dict[str, Any], name: str, limit: int = MAX_KEY) -> str:
    value = _text(body, name, limit=limit)
    assert value is not None
    return value


def _get_by_name(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    return {"experiment": store.experiment_by_name(_required(body, "experiment_name", 500))}


def _get_experiment(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    return {"experiment": store.experiment(_required(body, "experiment_id"))}


def _create_experiment(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    tags = _pairs(body.get("tags"), "tags", MAX_BATCH_TAGS, MAX_TRACKING_VALUE)
    return {"experiment_id": store.create_experiment(_required(body, "name", 500), tags)}


def _search_experiments(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    with store.lock:
        return {"experiments": list(store.experiments.values())}


def _create_run(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    run = store.create_run(
        proc,
        _text(body, "experiment_id", required=False) or DEFAULT_EXPERIMENT,
        _text(body, "run_name", required=False),
        _text(body, "user_id", required=False) or "",
        _integer(body.get("start_time"), "start_time", None),
        _pairs(body.get("tags"), "tags", MAX_BATCH_TAGS, MAX_TRACKING_VALUE),
    )
    return {"run": {"info": run.info(), "data": run.data()}}


def _get_run(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    run = store.run(_run_id(body))
    with store.lock:
        found = {"info": run.info(), "data": run.data(), "inputs": {}}
        if run.outputs:
            found["outputs"] = {"model_outputs": list(run.outputs)}
    return {"run": found}


def _get_history(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    key = _SPACES.sub("_", _required(body, "metric_key"))
    return {"metrics": store.history(_run_id(body), key)}


def _update_run(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    status = _text(body, "status", required=False)
    if status is not None and status not in _RUN_STATUS:
        raise MlflowError(
            f"Invalid value {status!r} for parameter 'status': one of {', '.join(_RUN_STATUS)}."
        )
    end_time = _integer(body.get("end_time"), "end_time", None)
    run = store.update_run(_run_id(body), status, end_time, _text(body, "run_name", required=False))
    return {"run_info": run.info()}


def _log_metric(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    store.log(proc, _run_id(body), [_metric(body)], {}, {})
    return {}


def _log_batch(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    metrics = body.get("metrics") or []
    if not isinstance(metrics, list):
        raise MlflowError("'metrics' must be a list of metric objects.")
    if len(metrics) > MAX_BATCH_METRICS:
        raise MlflowError(f"A batch holds at most {MAX_BATCH_METRICS} metrics, not {len(metrics)}.")
    store.log(
        proc,
        _run_id(body),
        [_metric(m) for m in metrics],
        _pairs(body.get("params"), "params", MAX_BATCH_PARAMS, MAX_TRACKING_VALUE),
        _pairs(body.get("tags"), "tags", MAX_BATCH_TAGS, MAX_TRACKING_VALUE),
    )
    return {}


def _log_param(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    store.log(proc, _run_id(body), [], _pairs([body], "params", 1, MAX_TRACKING_VALUE), {})
    return {}


def _set_tag(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    store.log(proc, _run_id(body), [], {}, _pairs([body], "tags", 1, MAX_TRACKING_VALUE))
    return {}


def _delete_tag(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    store.log(proc, _run_id(body), [], {}, {}, delete_tags=(_required(body, "key"),))
    return {}


def _accept(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    store.run(_run_id(body))  # inputs (datasets, models), MLflow 2's model metadata: nothing kept
    return {}


def _log_outputs(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    models = body.get("models") or []
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise MlflowError("'models' must be a list of {model_id, step} objects.")
    outputs = []
    for m in models:
        step = _integer(m.get("step"), "step", 0)
        outputs.append({"model_id": _required(m, "model_id"), "step": step})
    store.log_outputs(_run_id(body), outputs)
    return {}


# --- logged models (MLflow 3: /logged-models/...) -------------------------------------------


def _create_model(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    model = store.create_model(
        proc,
        _required(body, "experiment_id"),
        _text(body, "name", required=False),
        _text(body, "source_run_id", required=False),
        _text(body, "model_type", required=False),
        _pairs(body.get("params"), "params", MAX_BATCH_PARAMS, MAX_TRACKING_VALUE),
        _pairs(body.get("tags"), "tags", MAX_BATCH_TAGS, MAX_TRACKING_VALUE),
    )
    return {"model": model.proto()}


def _get_model(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    return {"model": store.model(body["model_id"]).proto()}


_FINAL_STATUS = {"LOGGED_MODEL_PENDING": 1, "LOGGED_MODEL_READY": 2, "LOGGED_MODEL_UPLOAD_FAILED": 3}


def _finalize_model(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    status = body.get("status")
    by_number = {number: name for name, number in _FINAL_STATUS.items()}
    status = by_number.get(status, status) if isinstance(status, int) else status
    if status not in _FINAL_STATUS:
        raise MlflowError(
            f"Invalid value {status!r} for parameter 'status': one of {', '.join(_FINAL_STATUS)}."
        )
    return {"model": store.change_model(body["model_id"], status=status).proto()}


def _set_model_tags(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    store.change_model(
        body["model_id"], tags=_pairs(body.get("tags"), "tags", MAX_BATCH_TAGS, MAX_TRACKING_VALUE)
    )
    return {}


def _delete_model_tag(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    store.change_model(body["model_id"], delete_tag=body["tag_key"])
    return {}


def _log_model_params(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    params = _pairs(body.get("params"), "params", MAX_BATCH_PARAMS, MAX_TRACKING_VALUE)
    store.change_model(body["model_id"], params=params)
    return {}


MAX_SEARCH_RESULTS = 1000


def _search_models(store: TrackingStore, proc: _Process, body: dict[str, Any]) -> Any:
    experiment_ids = body.get("experiment_ids") or []
    if not isinstance(experiment_ids, list) or not all(isinstance(e, str) for e in experiment_ids):
        raise MlflowError("'experiment_ids' must be a list of experiment ids.")
    where = _model_filter(_text(body, "filter", required=False, limit=MAX_TRACKING_VALUE))
    order = []
    for item in body.get("order_by") or []:
        if not isinstance(item, dict):
            raise MlflowError("'order_by' must be a list of {field_name, ascending} objects.")
        ascending = item.get("ascending", True)
        order.append((_check_model_field(_required(item, "field_name")), ascending is not False))
    limit = _integer(body.get("max_results"), "max_results", 100)
    assert limit is not None
    if not 1 <= limit <= MAX_SEARCH_RESULTS:
        raise MlflowError(f"Invalid value {limit} for parameter 'max_results': 1 to {MAX_SEARCH_RESULTS}.")
    token = _text(body, "page_token", required=False) or "0"
    if not token.isdigit():
        raise MlflowError(f"Invalid page token {token!r}.")
    start = int(token)
    found = store.search_models(experiment_ids, where, order)
    with store.lock:
        page = [m.proto() for m in found[start : start + limit]]
    answer: dict[str, Any] = {"models": page}
    if start + limit < len(found):
        answer["next_page_token"] = str(start + limit)
    return answer


def _model_call(method: str, call: str, body: dict[str, Any]) -> _Call | None:
    """The call on one logged model (``logged-models/<id>[/tags[/<key>]|/params]``): its
    handler, with the id (and a tag's key) put in ``body``; None for a call not served."""
    parts = call.split("/", 3)
    if len(parts) < 2 or parts[0] != "logged-models":
        return None
    body["model_id"] = unquote(parts[1])
    handler: _Call | None = {
        ("GET", 2, ""): _get_model,
        ("PATCH", 2, ""): _finalize_model,
        ("PATCH", 3, "tags"): _set_model_tags,
        ("DELETE", 4, "tags"): _delete_model_tag,
        ("POST", 3, "params"): _log_model_params,
    }.get((method, len(parts), parts[2] if len(parts) > 2 else ""))
    if len(parts) == 4:
        body["tag_key"] = unquote(parts[3])
    return handler


_CALLS: dict[tuple[str, str], _Call] = {
    ("GET", "experiments/get-by-name"): _get_by_name,
    ("GET", "experiments/get"): _get_experiment,
    ("POST", "experiments/create"): _create_experiment,
    ("GET", "experiments/search"): _search_experiments,
    ("POST", "experiments/search"): _search_experiments,
    ("POST", "runs/create"): _create_run,
    ("GET", "runs/get"): _get_run,
    ("GET", "metrics/get-history"): _get_history,
    ("POST", "runs/update"): _update_run,
    ("POST", "runs/log-metric"): _log_metric,
    ("POST", "runs/log-batch"): _log_batch,
    ("POST", "runs/log-parameter"): _log_param,
    ("POST", "runs/set-tag"): _set_tag,
    ("POST", "runs/delete-tag"): _delete_tag,
    ("POST", "runs/log-inputs"): _accept,
    ("POST", "runs/log-model"): _accept,  # MLflow 2's log_model: its files are the run's artifacts
    ("POST", "runs/outputs"): _log_outputs,
    ("POST", "logged-models"): _create_model,
    ("POST", "logged-models/search"): _search_models,
}


def _dispatch(store: TrackingStore, proc: _Process, method: str, call: str, body: dict[str, Any]) -> Any:
    handler = _CALLS.get((method, call)) or _model_call(method, call, body)
    if handler is None:
        raise MlflowError(f"{method} /{call} is not served here", "ENDPOINT_NOT_FOUND", 404)
    return handler(store, proc, body)


NO_UI_PAGE = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>torchyard: MLflow tracking endpoint</title></head>
<body><h1>MLflow tracking endpoint of a torchyard job</h1>
<p>This address is the MLflow tracking endpoint that the worker node runs for one script job.
It serves MLflow's REST calls from the job's processes and has no web UI.</p>
<p>The job's metrics, params, tags, runs and logged models are on the job's page in
torchyard's web UI, in <code>torchyard metrics JOB</code> and in <code>GET /v1/jobs/JOB</code>
(<code>tracking</code>) on the API; the files MLflow logged are in the job's outputs under
<code>mlflow/</code>.</p>
</body></html>
"""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def setup(self) -> None:
        super().setup()
        # Each read and write of the connection waits at most this long.
        self.connection.settimeout(self.server.connection_timeout_s)
        # Small answers at once: no waiting for the client's delayed acknowledgement.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle_one_request(self) -> None:
        if not self.server.await_request(self):
            self.close_connection = True
            return
        super().handle_one_request()

    def _answer(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = [
            f"{self.protocol_version} {status} {HTTPStatus(status).phrase}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(data)}",
        ]
        if self.close_connection:
            head.append("Connection: close")
        # Headers and body in one write.
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)

    def _serve(self, method: str) -> None:
        try:
            body = self._read(method)
            if method == "GET" and urlsplit(self.path).path == "/":
                # The page of MLflow's "View run" link (its #/experiments/... part stays in the browser).
                self._answer(200, NO_UI_PAGE, "text/html; charset=utf-8")
                return
            auth = self.headers.get("Authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else None
            proc = self.server.store.process(token)
            if proc is None:
                raise MlflowError(
                    "a token of this job is needed (MLFLOW_TRACKING_TOKEN)", "UNAUTHENTICATED", 401
                )
            if proc.ranks_from_caller:
                rank = self._caller_rank()
                with self.server.store.lock:
                    proc = proc.as_rank(rank)
            path = urlsplit(self.path).path
            prefix = next((p for p in API_PREFIXES if path.startswith(p)), None)
            if prefix is None:
                raise MlflowError(f"{method} {path} is not served here", "ENDPOINT_NOT_FOUND", 404)
            answer = _dispatch(self.server.store, proc, method, path[len(prefix) :].strip("/"), body)
            self._answer(200, answer)
        except (TimeoutError, ConnectionError):
            self.close_connection = True  # too slow, or gone: no answer
        except MlflowError as exc:
            self._answer(exc.status, {"error_code": exc.code, "message": exc.message})
        except Exception:
            log.exception("MLflow endpoint: %s %s failed", method, self.path)
            self._answer(500, {"error_code": "INTERNAL_ERROR", "message": "the call failed on the node"})

    def _caller_rank(self) -> int | None:
        """The ``RANK`` of the process at the other end of this connection (looked up once)."""
        if not hasattr(self, "_rank"):
            bridged = self.server.store.bridged_rank(self.client_address)
            if bridged is not None:  # relayed from a run without network: its relay said
                self._rank = bridged[0]
            else:
                self._rank = caller_rank(self.client_address, self.server.server_address)
        return self._rank

    def _read(self, method: str) -> dict[str, Any]:
        if method == "GET":
            query = parse_qs(urlsplit(self.path).query, keep_blank_values=True)
            return {k: v[-1] for k, v in query.items()}
        declared = self.headers.get("Content-Length", "0")
        if not declared.isdigit():
            self.close_connection = True
            raise MlflowError("a request needs a Content-Length")
        size = int(declared)
        if size > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read: the connection cannot go on
            raise MlflowError(f"a request body holds at most {MAX_BODY_BYTES} bytes, not {size}", status=413)
        raw = self.rfile.read(size) if size else b"{}"
        if len(raw) < size:
            raise ConnectionAbortedError("the connection ended within the request's body")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise MlflowError(f"the request body is not JSON: {exc}", "MALFORMED_REQUEST") from None
        if not isinstance(body, dict):
            raise MlflowError("the request body must be a JSON object", "MALFORMED_REQUEST")
        return body


class _Server(ThreadingHTTPServer):
    """At most ``max_connections`` connections served at once, each silent at most
    ``connection_timeout_s``; under pressure the one idle the longest is closed."""

    daemon_threads = True
    block_on_close = False  # server_close() waits for the calls in progress itself, boundedly
    request_queue_size = LISTEN_BACKLOG
    store: TrackingStore

    def __init__(self, address: tuple[str, int], max_connections: int, connection_timeout_s: float) -> None:
        super().__init__(address, _Handler)
        self.connection_timeout_s = connection_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._guard = threading.Lock()
        # Each connection served: since when it waits for a request (None: in one).
        self._open: dict[socket.socket, float | None] = {}
        self._closing = False

    def process_request(self, request: Any, client_address: Any) -> None:
        """In the serving thread: wait for a free slot (further connections wait in the
        listen backlog), closing the connection idle the longest to free one."""
        acquired = self._slots.acquire(blocking=False)
        while not acquired:
            if self._closing:
                self.shutdown_request(request)
                return
            self._close_idle(every=False)
            acquired = self._slots.acquire(timeout=0.1)
        with self._guard:
            self._open[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: Any) -> None:
        with self._guard:
            self._open.pop(request, None)
        self._slots.release()

    def await_request(self, handler: _Handler) -> bool:
        """Wait, counted idle, for the connection's next request (its first, or the next on
        a kept-alive connection): False when it ends, stays silent, or is closed for room."""
        connection = handler.connection
        with self._guard:
            if self._closing or connection not in self._open:
                return False
            self._open[connection] = time.monotonic()
        try:
            ready = cast(io.BufferedReader, handler.rfile).peek(1) != b""
        except OSError:  # silent past the timeout, or reset
            ready = False
        with self._guard:
            if connection not in self._open:
                return False  # closed to make room
            self._open[connection] = None
        return ready

    def _close_idle(self, every: bool) -> None:
        """Close the connection idle the longest (``every``: all idle ones); its thread ends."""
        with self._guard:
            idle = sorted(
                (since, n, c) for n, (c, since) in enumerate(self._open.items()) if since is not None
            )
            for _since, _n, connection in idle if every else idle[:1]:
                del self._open[connection]
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    def shutdown(self) -> None:
        self._closing = True
        self._close_idle(every=True)
        super().shutdown()

    def server_close(self) -> None:
        """Close the listening socket, let the calls in progress finish (STOP_WAIT_S at
        most), then cut what is left."""
        super().server_close()
        deadline = time.monotonic() + STOP_WAIT_S
        while self._open and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._guard:
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("MLflow endpoint: a connection from %s failed", client_address, exc_info=True)


class TrackingEndpoint:
    """The endpoint of one placement: ``start()``, ``env_for(rank, name)`` per process, ``stop()``."""

    def __init__(
        self,
        state_dir: Path,
        outputs_dir: Path,
        node_rank: int,
        host: str = "127.0.0.1",
        *,
        max_connections: int = MAX_CONNECTIONS,
        connection_timeout_s: float = CONNECTION_TIMEOUT_S,
    ) -> None:
        self.store = TrackingStore(state_dir, outputs_dir, node_rank)
        self.host = host
        self.max_connections = max_connections
        self.connection_timeout_s = connection_timeout_s
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where the endpoint listens (host, port)."""
        assert self._server is not None, "the endpoint is not started"
        return self.host, int(self._server.server_address[1])

    @property
    def uri(self) -> str:
        assert self._server is not None, "the endpoint is not started"
        return f"http://{self.host}:{self._server.server_address[1]}"

    def start(self) -> None:
        (self.store.state_dir / "metrics").mkdir(parents=True, exist_ok=True)
        server = _Server((self.host, 0), self.max_connections, self.connection_timeout_s)
        server.store = self.store
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="mlflow-endpoint", daemon=True)
        self._thread.start()

    def env_for(self, rank: int, name: str, *, ranks_from_caller: bool = False) -> dict[str, str]:
        """The variables that point one process's MLflow client here (``ranks_from_caller``:
        a node's command whose ranks, started by it, share them)."""
        token = self.store.add_process(rank, name, ranks_from_caller=ranks_from_caller)
        return {
            "MLFLOW_TRACKING_URI": self.uri,
            "MLFLOW_TRACKING_TOKEN": token,
            # The client's "View run ... at" links would name this node's loopback, no UI.
            "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
        }

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)


# --- who is calling ------------------------------------------------------------------------


def caller_rank(client: tuple[Any, ...], server: tuple[Any, ...]) -> int | None:
    """``RANK`` of the process at the client end of a loopback connection: a process of the
    agent's user or of the user the sandbox runs jobs as (None where there is none)."""
    uids: set[int] = set()
    with contextlib.suppress(ValueError):
        job_user = sandbox.run_user()
        if job_user is not None:
            uids.add(job_user[0])
    return peers.caller_rank(client, server, uids)


def tracking_snapshot(state_dir: Path) -> Callable[[], bytes | None]:
    """A reader of ``tracking.json`` in the agent's folder of a placement (None while there is none)."""

    def read() -> bytes | None:
        with contextlib.suppress(FileNotFoundError):
            return (state_dir / TRACKING_FILE).read_bytes()
        return None

    return read

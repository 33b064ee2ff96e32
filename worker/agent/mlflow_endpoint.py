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
  keyed by name, rank and step, so an API outage or a retried batch loses or doubles
  nothing). A step already used by that name and rank (MLflow's default step is 0 for
  every call) takes the next step above the highest one so far; non-finite values are
  kept in the run's history here but not shipped (the metrics API holds finite numbers);
* params, tags and the runs are the file ``tracking.json`` (rewritten whole on each
  change; the reporter sends it when it changed), shown as the job's ``tracking``;
* a run's ``artifact_uri`` is a folder under the node's outputs
  (``outputs/mlflow/<run id>/artifacts``), so ``mlflow.log_artifact(s)`` copies files there
  itself and they are part of the job's outputs archive.

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
from urllib.parse import parse_qs, urlsplit

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


@dataclass
class _Process:
    rank: int
    name: str  # "rank-<rank>" or "node-<node rank>"
    metrics_path: Path
    used_steps: dict[str, set[int]] = field(default_factory=dict)
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
            self._check_total(len(tags), "tags")
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
            self._check_total(len(set(params) - set(run.params)), "params")
            self._check_total(len(set(tags) - set(run.tags)), "tags")
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
        used = proc.used_steps.setdefault(name, set())
        step = metric["step"]
        if step in used:
            step = proc.top_step.get(name, -1) + 1
        used.add(step)
        proc.top_step[name] = max(step, proc.top_step.get(name, -1))
        return {
            "name": name,
            "value": value,
            "step": step,
            "epoch": 0,
            "rank": proc.rank,
            "time": metric["timestamp"] / 1000.0,
        }

    def _check_total(self, adding: int, what: str) -> None:
        total = sum(len(getattr(r, what)) for r in self.runs.values()) + adding
        if total > MAX_TRACKING_ITEMS:
            raise MlflowError(f"a job holds at most {MAX_TRACKING_ITEMS} {what}")

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
        path = self.state_dir / TRACKING_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"runs": runs}, sort_keys=True))
        os.replace(tmp, path)

    def history(self, run_id: str, key: str) -> list[dict[str, Any]]:
        run = self.run(run_id)
        with self.lock:
            return list(run.history.get(key, []))


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
    step = _integer(item.get("step"), "step", 0)
    assert step is not None
    if step < 0 or step >= 2**31:
        raise MlflowError(f"Invalid step {step} for metric '{key}': 0 to 2147483647.")
    timestamp = _integer(item.get("timestamp"), "timestamp", _now_ms())
    return {"key": name, "value": value, "step": step, "timestamp": timestamp}


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
    return {"run": {"info": run.info(), "data": run.data(), "inputs": {}}}


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
    store.run(_run_id(body))  # datasets and models are not tracked: accepted, nothing kept
    return {}


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
    ("POST", "runs/log-outputs"): _accept,
}


def _dispatch(store: TrackingStore, proc: _Process, method: str, call: str, body: dict[str, Any]) -> Any:
    handler = _CALLS.get((method, call))
    if handler is None:
        raise MlflowError(f"{method} /{call} is not served here", "ENDPOINT_NOT_FOUND", 404)
    return handler(store, proc, body)


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

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        head = [
            f"{self.protocol_version} {status} {HTTPStatus(status).phrase}",
            "Content-Type: application/json",
            f"Content-Length: {len(data)}",
        ]
        if self.close_connection:
            head.append("Connection: close")
        # Headers and body in one write.
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)

    def _serve(self, method: str) -> None:
        try:
            body = self._read(method)
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
        return {"MLFLOW_TRACKING_URI": self.uri, "MLFLOW_TRACKING_TOKEN": token}

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

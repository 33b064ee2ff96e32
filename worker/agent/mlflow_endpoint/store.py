"""The runs of one placement and the files their reports travel through (see the package's
docstring): metric points appended to ``metrics/mlflow-<process>.jsonl``, params, tags, runs
and logged models rewritten whole in ``tracking.json``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from torchyard.contract.reports import MAX_TRACKING_ITEMS, MAX_TRACKING_RUNS
from worker.agent.mlflow_endpoint.errors import MlflowError
from worker.agent.mlflow_endpoint.model_search import MODEL_FIELDS, model_field
from worker.agent.mlflow_endpoint.records import MODEL_STATUS, LoggedModel, TrackedProcess, TrackedRun, now_ms

TRACKING_FILE = "tracking.json"
MAX_HISTORY_POINTS = 1_000_000  # per process: older points of get-history are forgotten past it
DEFAULT_EXPERIMENT = "0"


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
        self.runs: dict[str, TrackedRun] = {}
        self.models: dict[str, LoggedModel] = {}
        self.processes: dict[str, TrackedProcess] = {}
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
        self.processes[token] = TrackedProcess(rank, name, path, ranks_from_caller=ranks_from_caller)
        return token

    def process(self, token: str | None) -> TrackedProcess | None:
        if not token:
            return None
        for known, proc in self.processes.items():
            if secrets.compare_digest(known, token):
                return proc
        return None

    # --- experiments ---------------------------------------------------------------------

    def _experiment(self, experiment_id: str, name: str, tags: dict[str, str]) -> dict[str, Any]:
        now = now_ms()
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

    def create_run(self, proc: TrackedProcess, experiment_id: str, run_name: str | None, user_id: str,
                   start_time: int | None, tags: dict[str, str]) -> TrackedRun:  # fmt: skip
        self.experiment(experiment_id)
        run_id = uuid.uuid4().hex
        name = run_name or tags.get("mlflow.runName") or f"run-{run_id[:8]}"
        with self.lock:
            if len(self.runs) >= MAX_TRACKING_RUNS:
                raise MlflowError(f"a job holds at most {MAX_TRACKING_RUNS} runs")
            run = TrackedRun(
                run_id=run_id,
                experiment_id=experiment_id,
                run_name=name,
                user_id=user_id,
                start_time=start_time or now_ms(),
                artifact_uri=(self.outputs_dir / "mlflow" / run_id / "artifacts").as_uri(),
                rank=proc.rank,
            )
            self._check_total(len(set(tags) | {"mlflow.runName"}))
            run.tags.update(tags)
            run.tags["mlflow.runName"] = name
            self.runs[run_id] = run
            self._write_tracking()
        return run

    def run(self, run_id: str) -> TrackedRun:
        with self.lock:
            found = self.runs.get(run_id)
        if found is None:
            raise MlflowError(f"Run '{run_id}' not found", "RESOURCE_DOES_NOT_EXIST", 404)
        return found

    def update_run(
        self, run_id: str, status: str | None, end_time: int | None, run_name: str | None
    ) -> TrackedRun:
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

    def log(self, proc: TrackedProcess, run_id: str, metrics: list[dict[str, Any]], params: dict[str, str],
            tags: dict[str, str], delete_tags: tuple[str, ...] = ()) -> None:  # fmt: skip
        """Record one call's metrics, params and tags: all of it or (an error) none of it."""
        run = self.run(run_id)
        with self.lock:
            _check_params_unchanged(run, params)
            self._check_total(len(set(params) - set(run.params)) + len(set(tags) - set(run.tags)))
            for m in metrics:
                if m["step"] is None:  # no step in the call: the next one above the highest
                    step = proc.top_step.get(m["key"], -1) + 1
                    m["step"] = proc.top_step[m["key"]] = step
            metrics = self._model_metrics(run, metrics)
            self._ship(proc, metrics)
            self._remember(run, metrics)
            run.params.update(params)
            run.tags.update(tags)
            for key in delete_tags:
                run.tags.pop(key, None)
            if params or tags or delete_tags:
                self._write_tracking()

    def _ship(self, proc: TrackedProcess, metrics: list[dict[str, Any]]) -> None:
        """Append the finite points to the process's metric file for the reporter (lock held)."""
        lines = [self._point(proc, m) for m in metrics]
        shipped = [line for line in lines if line is not None]
        if not shipped:
            return
        data = "".join(json.dumps(p, separators=(",", ":")) + "\n" for p in shipped).encode()
        # One write with O_APPEND: a line is on disk whole before the call is answered.
        fd = os.open(proc.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _remember(self, run: TrackedRun, metrics: list[dict[str, Any]]) -> None:
        """The run's latest point of each metric and its history (lock held)."""
        for m in metrics:
            point = {
                "key": m["key"],
                "value": json_number(m["value"]),
                "timestamp": m["timestamp"],
                "step": m["step"],
            }
            run.latest[m["key"]] = point
            if self._history_points < MAX_HISTORY_POINTS:
                run.history.setdefault(m["key"], []).append(point)
                self._history_points += 1

    def _point(self, proc: TrackedProcess, metric: dict[str, Any]) -> dict[str, Any] | None:
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

    def _model_metrics(self, run: TrackedRun, metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
            point = {"key": m["key"], "value": json_number(m["value"]), "timestamp": m["timestamp"],
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
                    "status": MODEL_STATUS[m.status],
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

    def create_model(self, proc: TrackedProcess, experiment_id: str, name: str | None, source_run_id: str | None,
                     model_type: str | None, params: dict[str, str], tags: dict[str, str]) -> LoggedModel:  # fmt: skip
        """A logged model, PENDING, its artifacts a folder of the node's outputs
        (``mlflow/models/<model id>/artifacts``, where MLflow's server puts them under the
        experiment's artifact location): the client copies its files there itself."""
        self.experiment(experiment_id)
        if source_run_id:
            self.run(source_run_id)
        model_id = f"m-{uuid.uuid4().hex}"
        path = f"mlflow/models/{model_id}/artifacts"
        now = now_ms()
        with self.lock:
            if len(self.models) >= MAX_TRACKING_RUNS:
                raise MlflowError(f"a job holds at most {MAX_TRACKING_RUNS} logged models per node")
            self._check_total(len(params) + len(tags))
            model = LoggedModel(
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

    def model(self, model_id: str) -> LoggedModel:
        with self.lock:
            found = self.models.get(model_id)
        if found is None:
            raise MlflowError(f"Logged model with ID '{model_id}' not found.", "RESOURCE_DOES_NOT_EXIST", 404)
        return found

    def change_model(self, model_id: str, *, status: str | None = None, params: dict[str, str] | None = None,
                     tags: dict[str, str] | None = None, delete_tag: str | None = None) -> LoggedModel:  # fmt: skip
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
            model.updated = now_ms()
            self._write_tracking()
        return model

    def search_models(self, experiment_ids: list[str], where: Callable[[LoggedModel], bool],
                      order: list[tuple[str, bool]]) -> list[LoggedModel]:  # fmt: skip
        """The models of ``experiment_ids`` (all where none) that ``where`` keeps, in MLflow's
        order: by ``order``'s fields (those a model lacks last), then the newest first, then by id."""
        with self.lock:
            found = [
                m
                for m in self.models.values()
                if (not experiment_ids or m.experiment_id in experiment_ids) and where(m)
            ]
        return _in_order(found, order)


def _in_order(models: list[LoggedModel], order: list[tuple[str, bool]]) -> list[LoggedModel]:
    """``models`` in MLflow's order: by ``order``'s fields (those a model lacks last), then the
    newest first, then by id."""
    found = sorted(models, key=lambda m: m.model_id)
    if not any(MODEL_FIELDS.get(name) == "created" for name, _ascending in order):
        found.sort(key=lambda m: m.created, reverse=True)
    for name, ascending in reversed(order):
        present = [m for m in found if model_field(m, name) is not None]
        present.sort(key=lambda m: cast(Any, model_field(m, name)), reverse=not ascending)
        found = present + [m for m in found if model_field(m, name) is None]
    return found


def _check_params_unchanged(run: TrackedRun, params: dict[str, str]) -> None:
    """MLflow's rule: a param logged once keeps its value (the same value again is fine)."""
    for key, value in params.items():
        old = run.params.get(key)
        if old is not None and old != value:
            raise MlflowError(
                f"Changing param values is not allowed. Param with key='{key}' was already "
                f"logged with value='{old}' for run ID='{run.run_id}'. Attempted logging new value "
                f"'{value}'."
            )


def json_number(value: float) -> float | str:
    """A value as MLflow's JSON holds it: NaN and the infinities quoted."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def tracking_snapshot(state_dir: Path) -> Callable[[], bytes | None]:
    """A reader of ``tracking.json`` in the agent's folder of a placement (None while there is none)."""

    def read() -> bytes | None:
        with contextlib.suppress(FileNotFoundError):
            return (state_dir / TRACKING_FILE).read_bytes()
        return None

    return read

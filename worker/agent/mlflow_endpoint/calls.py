"""MLflow's REST calls this endpoint serves (``/api/2.0/mlflow/<call>``), each on the placement's
:class:`~worker.agent.mlflow_endpoint.store.TrackingStore` for the process that calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from torchyard.contract.reports import MAX_TRACKING_VALUE
from worker.agent.mlflow_endpoint import fields
from worker.agent.mlflow_endpoint.errors import MlflowError
from worker.agent.mlflow_endpoint.model_search import check_model_field, model_filter
from worker.agent.mlflow_endpoint.records import TrackedProcess
from worker.agent.mlflow_endpoint.store import DEFAULT_EXPERIMENT, TrackingStore

# MLflow's own limits on one log-batch call.
MAX_BATCH_METRICS = 1000
MAX_BATCH_PARAMS = 100
MAX_BATCH_TAGS = 100


_RUN_STATUS = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")
_Call = Callable[[TrackingStore, TrackedProcess, dict[str, Any]], Any]


def _get_by_name(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    return {"experiment": store.experiment_by_name(fields.required_text(body, "experiment_name", 500))}


def _get_experiment(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    return {"experiment": store.experiment(fields.required_text(body, "experiment_id"))}


def _create_experiment(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    tags = fields.pairs(body.get("tags"), "tags", MAX_BATCH_TAGS, MAX_TRACKING_VALUE)
    return {"experiment_id": store.create_experiment(fields.required_text(body, "name", 500), tags)}


def _search_experiments(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    with store.lock:
        return {"experiments": list(store.experiments.values())}


def _create_run(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    run = store.create_run(
        proc,
        fields.text(body, "experiment_id", required=False) or DEFAULT_EXPERIMENT,
        fields.text(body, "run_name", required=False),
        fields.text(body, "user_id", required=False) or "",
        fields.integer(body.get("start_time"), "start_time", None),
        fields.pairs(body.get("tags"), "tags", MAX_BATCH_TAGS, MAX_TRACKING_VALUE),
    )
    return {"run": {"info": run.info(), "data": run.data()}}


def _get_run(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    run = store.run(fields.run_id(body))
    with store.lock:
        found = {"info": run.info(), "data": run.data(), "inputs": {}}
        if run.outputs:
            found["outputs"] = {"model_outputs": list(run.outputs)}
    return {"run": found}


def _get_history(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    key = fields.SPACES.sub("_", fields.required_text(body, "metric_key"))
    return {"metrics": store.history(fields.run_id(body), key)}


def _update_run(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    status = fields.text(body, "status", required=False)
    if status is not None and status not in _RUN_STATUS:
        raise MlflowError(
            f"Invalid value {status!r} for parameter 'status': one of {', '.join(_RUN_STATUS)}."
        )
    end_time = fields.integer(body.get("end_time"), "end_time", None)
    run = store.update_run(
        fields.run_id(body), status, end_time, fields.text(body, "run_name", required=False)
    )
    return {"run_info": run.info()}


def _log_metric(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    store.log(proc, fields.run_id(body), [fields.metric(body)], {}, {})
    return {}


def _log_batch(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    metrics = body.get("metrics") or []
    if not isinstance(metrics, list):
        raise MlflowError("'metrics' must be a list of metric objects.")
    if len(metrics) > MAX_BATCH_METRICS:
        raise MlflowError(f"A batch holds at most {MAX_BATCH_METRICS} metrics, not {len(metrics)}.")
    store.log(
        proc,
        fields.run_id(body),
        [fields.metric(m) for m in metrics],
        fields.pairs(body.get("params"), "params", MAX_BATCH_PARAMS, MAX_TRACKING_VALUE),
        fields.pairs(body.get("tags"), "tags", MAX_BATCH_TAGS, MAX_TRACKING_VALUE),
    )
    return {}


def _log_param(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    store.log(proc, fields.run_id(body), [], fields.pairs([body], "params", 1, MAX_TRACKING_VALUE), {})
    return {}


def _set_tag(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    store.log(proc, fields.run_id(body), [], {}, fields.pairs([body], "tags", 1, MAX_TRACKING_VALUE))
    return {}


def _delete_tag(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    store.log(proc, fields.run_id(body), [], {}, {}, delete_tags=(fields.required_text(body, "key"),))
    return {}


def _accept(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    store.run(fields.run_id(body))  # inputs (datasets, models), MLflow 2's model metadata: nothing kept
    return {}


def _log_outputs(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    models = body.get("models") or []
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise MlflowError("'models' must be a list of {model_id, step} objects.")
    outputs = []
    for m in models:
        step = fields.integer(m.get("step"), "step", 0)
        outputs.append({"model_id": fields.required_text(m, "model_id"), "step": step})
    store.log_outputs(fields.run_id(body), outputs)
    return {}


# --- logged models (MLflow 3: /logged-models/...) -------------------------------------------


def _create_model(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    model = store.create_model(
        proc,
        fields.required_text(body, "experiment_id"),
        fields.text(body, "name", required=False),
        fields.text(body, "source_run_id", required=False),
        fields.text(body, "model_type", required=False),
        fields.pairs(body.get("params"), "params", MAX_BATCH_PARAMS, MAX_TRACKING_VALUE),
        fields.pairs(body.get("tags"), "tags", MAX_BATCH_TAGS, MAX_TRACKING_VALUE),
    )
    return {"model": model.proto()}


def _get_model(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    return {"model": store.model(body["model_id"]).proto()}


_FINAL_STATUS = {"LOGGED_MODEL_PENDING": 1, "LOGGED_MODEL_READY": 2, "LOGGED_MODEL_UPLOAD_FAILED": 3}


def _finalize_model(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    status = body.get("status")
    by_number = {number: name for name, number in _FINAL_STATUS.items()}
    status = by_number.get(status, status) if isinstance(status, int) else status
    if status not in _FINAL_STATUS:
        raise MlflowError(
            f"Invalid value {status!r} for parameter 'status': one of {', '.join(_FINAL_STATUS)}."
        )
    return {"model": store.change_model(body["model_id"], status=status).proto()}


def _set_model_tags(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    store.change_model(
        body["model_id"], tags=fields.pairs(body.get("tags"), "tags", MAX_BATCH_TAGS, MAX_TRACKING_VALUE)
    )
    return {}


def _delete_model_tag(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    store.change_model(body["model_id"], delete_tag=body["tag_key"])
    return {}


def _log_model_params(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    params = fields.pairs(body.get("params"), "params", MAX_BATCH_PARAMS, MAX_TRACKING_VALUE)
    store.change_model(body["model_id"], params=params)
    return {}


MAX_SEARCH_RESULTS = 1000


def _search_models(store: TrackingStore, proc: TrackedProcess, body: dict[str, Any]) -> Any:
    experiment_ids = body.get("experiment_ids") or []
    if not isinstance(experiment_ids, list) or not all(isinstance(e, str) for e in experiment_ids):
        raise MlflowError("'experiment_ids' must be a list of experiment ids.")
    where = model_filter(fields.text(body, "filter", required=False, limit=MAX_TRACKING_VALUE))
    order = _search_order(body)
    start, limit = _search_page(body)
    found = store.search_models(experiment_ids, where, order)
    with store.lock:
        page = [m.proto() for m in found[start : start + limit]]
    answer: dict[str, Any] = {"models": page}
    if start + limit < len(found):
        answer["next_page_token"] = str(start + limit)
    return answer


def _search_order(body: dict[str, Any]) -> list[tuple[str, bool]]:
    """A search's ``order_by``: (field, ascending) pairs."""
    order = []
    for item in body.get("order_by") or []:
        if not isinstance(item, dict):
            raise MlflowError("'order_by' must be a list of {field_name, ascending} objects.")
        ascending = item.get("ascending", True)
        order.append((check_model_field(fields.required_text(item, "field_name")), ascending is not False))
    return order


def _search_page(body: dict[str, Any]) -> tuple[int, int]:
    """A search's page: where it starts (its ``page_token``) and how many results (``max_results``)."""
    limit = fields.integer(body.get("max_results"), "max_results", 100)
    assert limit is not None
    if not 1 <= limit <= MAX_SEARCH_RESULTS:
        raise MlflowError(f"Invalid value {limit} for parameter 'max_results': 1 to {MAX_SEARCH_RESULTS}.")
    token = fields.text(body, "page_token", required=False) or "0"
    if not token.isdigit():
        raise MlflowError(f"Invalid page token {token!r}.")
    return int(token), limit


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


def dispatch(store: TrackingStore, proc: TrackedProcess, method: str, call: str, body: dict[str, Any]) -> Any:
    handler = _CALLS.get((method, call)) or _model_call(method, call, body)
    if handler is None:
        raise MlflowError(f"{method} /{call} is not served here", "ENDPOINT_NOT_FOUND", 404)
    return handler(store, proc, body)

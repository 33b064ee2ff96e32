"""The fields of MLflow's REST requests: each checked (type, length, range) as MLflow's server
checks it, a bad one an :class:`MlflowError` (400, ``INVALID_PARAMETER_VALUE``)."""

from __future__ import annotations

import json
import re
from typing import Any

from torchyard.contract.metrics import is_metric_name
from worker.agent.mlflow_endpoint.errors import MlflowError
from worker.agent.mlflow_endpoint.records import now_ms

MAX_KEY = 250
SPACES = re.compile(r"\s")


def text(body: dict[str, Any], name: str, *, required: bool = True, limit: int = MAX_KEY) -> str | None:
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


def integer(value: Any, name: str, default: int | None) -> int | None:
    if value is None:
        return default
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,19}", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        raise MlflowError(f"Invalid value {value!r} for parameter '{name}': an integer is expected.")
    return value


def metric(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise MlflowError("A metric must be an object with 'key', 'value', 'timestamp' and 'step'.")
    key = text(item, "key")
    assert key is not None
    name = SPACES.sub("_", key)
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
    step = integer(item.get("step"), "step", None)  # None: none given (MLflow's client always sends one)
    if step is not None and not 0 <= step < 2**31:
        raise MlflowError(f"Invalid step {step} for metric '{key}': 0 to 2147483647.")
    timestamp = integer(item.get("timestamp"), "timestamp", now_ms())
    model_id = text(item, "model_id", required=False)  # a logged model's metric (MLflow 3)
    return {"key": name, "value": value, "step": step, "timestamp": timestamp, "model_id": model_id}


def pairs(items: Any, what: str, limit: int, value_limit: int) -> dict[str, str]:
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
        key = text(item, "key")
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


def run_id(body: dict[str, Any]) -> str:
    run_id = text(body, "run_id", required=False) or text(body, "run_uuid", required=False)
    if run_id is None:
        raise MlflowError("Missing value for required parameter 'run_id'.")
    return run_id


def required_text(body: dict[str, Any], name: str, limit: int = MAX_KEY) -> str:
    value = text(body, name, limit=limit)
    assert value is not None
    return value

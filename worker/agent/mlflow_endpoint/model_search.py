"""A search of logged models (``logged-models/search``): MLflow's filter and order fields."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from worker.agent.mlflow_endpoint.errors import MlflowError
from worker.agent.mlflow_endpoint.records import MODEL_STATUS, LoggedModel

# What a search of logged models may filter and order by: MLflow's names of a model's
# attributes (the numeric ones compare as numbers), and ``metrics.`` / ``params.`` / ``tags.``.
MODEL_FIELDS = {
    "name": "name", "model_id": "model_id", "model_type": "model_type", "status": "status",
    "source_run_id": "source_run_id", "creation_time": "created", "creation_timestamp": "created",
    "creation_timestamp_ms": "created", "last_updated_time": "updated", "last_updated_timestamp": "updated",
    "last_updated_timestamp_ms": "updated",
}  # fmt: skip
_NUMERIC_MODEL_FIELDS = ("created", "updated")
_ENTITIES = {"metric": "metrics", "metrics": "metrics", "param": "params", "params": "params",
             "parameter": "params", "parameters": "params", "tag": "tags", "tags": "tags",
             "attribute": "", "attributes": "", "attr": ""}  # fmt: skip


def check_model_field(name: str) -> str:
    """``name`` as a field of a logged model (``metrics.loss``, ``tags.team``, ``name``...)."""
    entity, dot, key = name.partition(".")
    key = key.strip('`"')
    if dot and entity.lower() in _ENTITIES:
        prefix = _ENTITIES[entity.lower()]
        name = f"{prefix}.{key}" if prefix else key
    if name.partition(".")[0] in ("metrics", "params", "tags") and name.partition(".")[2]:
        return name
    if name not in MODEL_FIELDS:
        raise MlflowError(
            f"Invalid logged model search key '{name}': one of {', '.join(sorted(MODEL_FIELDS))}, or "
            "metrics.<name>, params.<name>, tags.<name>."
        )
    return name


def model_field(model: LoggedModel, name: str) -> Any:
    """The value of a field :func:`check_model_field` gave (None where the model has none)."""
    entity, _dot, key = name.partition(".")
    if entity == "metrics":
        metric = model.metrics.get(key)
        return None if metric is None else float(metric["value"])
    if entity == "params":
        return model.params.get(key)
    if entity == "tags":
        return model.tags.get(key)
    field_name = MODEL_FIELDS[name]
    if field_name == "status":
        return MODEL_STATUS[model.status]
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


def model_filter(text: str | None) -> Callable[[LoggedModel], bool]:
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
        clauses.append(_clause(found))
        position = found.end()

    def keep(model: LoggedModel) -> bool:
        return all(_holds(model_field(model, name), op, value) for name, op, value in clauses)

    return keep


def _clause(found: re.Match[str]) -> tuple[str, str, Any]:
    """One clause of a filter: its field, its comparator and the value compared with."""
    name = check_model_field(found["key"])
    op, raw = found["op"].upper(), found["value"]
    numeric = name.startswith("metrics.") or MODEL_FIELDS.get(name) in _NUMERIC_MODEL_FIELDS
    quoted = raw[0] in "'\""
    wrong = (quoted or "LIKE" in op) if numeric else (not quoted or op in ("<", "<=", ">", ">="))
    if wrong:
        kind = "a number" if numeric else "quoted text"
        raise MlflowError(f"Invalid filter clause {found.group(0).strip()!r}: {name} compares with {kind}.")
    value: Any = float(raw) if numeric else raw[1:-1]
    if "LIKE" in op:
        value = _like(value, re.IGNORECASE if op == "ILIKE" else 0)
    return name, op, value


def _holds(have: Any, op: str, value: Any) -> bool:
    """Whether a model's field (None where it has none: never) compares as a clause asks."""
    if have is None:
        return False
    if op in ("LIKE", "ILIKE"):
        return bool(value.fullmatch(have) is not None)
    return bool({"=": have == value, "!=": have != value, "<": have < value, "<=": have <= value,
                 ">": have > value, ">=": have >= value}[op])  # fmt: skip

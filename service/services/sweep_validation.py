"""A sweep checked at submission (docs/sweeps.md): its base job parsed as ``POST /v1/jobs``
would, and each search-space key and every value its range can produce checked against the
job spec's own fields and ranges; a 422 naming the field otherwise.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from pydantic import ValidationError

from service.schemas.common import closest_name, field_names_at, suggested_field
from service.schemas.jobs import JOB_CREATE, JOB_CREATE_MODELS, ScriptJobCreate, TrainJobCreate
from service.schemas.sweeps import MAX_KEYS, FloatRange, IntRange, SweepCreate
from service.services.sweep_space import Range, grid, invalid, produced_values, set_path
from torchyard.architectures import CLASSIFICATION_ARCHITECTURES
from torchyard.contract.jobspec import DEFAULT_JOB_TYPE, JOB_TYPES, JobKind

BaseJob = TrainJobCreate | ScriptJobCreate

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SPEC_SECTIONS: dict[str, tuple[str, ...]] = {
    JobKind.TRAIN: ("parameters", "model", "resources"),
    JobKind.SCRIPT: ("resources",),
}
# Model fields a search may vary (the weights to start from are not a hyperparameter).
_MODEL_KEYS = {"architecture", "pretrained", "memory_efficient"}


def validate(body: SweepCreate) -> tuple[BaseJob, dict[str, Any]]:
    """The base job and the normalized sweep spec; a 422 naming the field otherwise."""
    if not body.search_space:
        raise invalid("search_space", "no keys: give at least one parameter to search", f"1..{MAX_KEYS} keys")
    if len(body.search_space) > MAX_KEYS:
        raise invalid("search_space", f"{len(body.search_space)} keys", f"1..{MAX_KEYS} keys")
    if body.max_concurrent_trials > body.max_trials:
        raise invalid(
            "max_concurrent_trials",
            f"{body.max_concurrent_trials} is above max_trials {body.max_trials}",
            "1..max_trials",
        )
    spec = _parse_job(body.job)
    for key, rng in body.search_space.items():
        _check_key(spec, body.job, key, rng)
    if body.algorithm == "grid":
        grid(body.search_space)
    normalized = body.model_dump(mode="json")
    normalized["job"] = spec.model_dump(mode="json")
    return spec, normalized


# --- the base job ----------------------------------------------------------------------------


def _parse_job(raw: dict[str, Any]) -> BaseJob:
    try:
        spec = JOB_CREATE.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"] if str(p) not in JOB_TYPES]
        where = ".".join(["job", *loc])
        unknown = first["type"] == "extra_forbidden"
        message = f"unknown field {where!r}" if unknown else str(first["msg"])
        suggestion = _suggested_job_field(raw, first["loc"]) if unknown else None
        raise invalid(where, message, _allowed_at(raw, loc), suggestion) from exc
    if not isinstance(spec, TrainJobCreate | ScriptJobCreate):
        raise invalid("job.type", "a sweep runs train or script jobs", "train or script")
    return spec


def _raw_type(raw: Any) -> Any:
    return raw.get("type", DEFAULT_JOB_TYPE) if isinstance(raw, dict) else DEFAULT_JOB_TYPE


def _suggested_job_field(raw: Any, loc: tuple[Any, ...]) -> str | None:
    """``job.<the field an unknown job field most likely means>``, or None."""
    job_type = str(loc[0]) if loc and loc[0] in JOB_CREATE_MODELS else None
    if job_type is None:
        job_type = _raw_type(raw)
        if job_type not in JOB_CREATE_MODELS:
            return None
    path = list(loc[1:]) if loc and loc[0] == job_type else list(loc)
    found = suggested_field(JOB_CREATE_MODELS[job_type], path)
    return None if found is None else f"job.{found}"


def _field_info(job_type: str, path: list[str]) -> Any:
    """The pydantic field a dotted path of a job spec names, or None."""
    current: Any = JOB_CREATE_MODELS[job_type]
    info = None
    for part in path:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return None
        info = fields[part]
        current = info.annotation
    return info


def _allowed_at(raw: dict[str, Any], path: list[str]) -> str | None:
    job_type = _raw_type(raw)
    info = _field_info(job_type if job_type in _SPEC_SECTIONS else DEFAULT_JOB_TYPE, path)
    extra = getattr(info, "json_schema_extra", None)
    return str(extra["allowed"]) if isinstance(extra, dict) and "allowed" in extra else None


# --- the search-space keys -------------------------------------------------------------------


def _search_keys(spec: BaseJob) -> list[str]:
    """The search-space keys a sweep of this job may vary (``section.field``), and for a
    script job ``command_args.NAME`` for each ``$NAME`` its command uses."""
    keys = []
    for section in _SPEC_SECTIONS[spec.type]:
        for name in field_names_at(JOB_CREATE_MODELS[spec.type], [section]) or []:
            if section != "model" or name in _MODEL_KEYS:
                keys.append(f"{section}.{name}")
    if isinstance(spec, ScriptJobCreate):
        used = {m for arg in spec.command for m in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", arg)}
        keys += [f"command_args.{name}" for name in sorted(used)]
    return keys


def _suggested_key(spec: BaseJob, key: str) -> str | None:
    """The search-space key an unknown ``key`` most likely means: a field of the same
    section when the section is right (``parameters.epoch``: ``parameters.epochs``), else
    the closest key of all."""
    keys = _search_keys(spec)
    section, _, name = key.partition(".")
    fields = [k.partition(".")[2] for k in keys if k.partition(".")[0] == section]
    if fields and name:
        found = closest_name(name, fields)
        return None if found is None else f"{section}.{found}"
    return closest_name(key, keys)


def _check_key(spec: BaseJob, raw_job: dict[str, Any], key: str, rng: Range) -> None:
    """The key names a field of the job spec a search may set, and every value the range can
    produce passes that field's own validation (a 422 naming the key and the range)."""
    path = key.split(".")
    values = produced_values(key, rng)
    if isinstance(spec, ScriptJobCreate) and path[0] == "command_args":
        _check_command_arg(spec, key, path)
        return
    _check_known(spec, key, path)
    _check_type(spec.type, key, rng)
    _check_values(spec, raw_job, key, values)


def _check_command_arg(spec: ScriptJobCreate, key: str, path: list[str]) -> None:
    where = f"search_space.{key}"
    name = ".".join(path[1:])
    if len(path) != 2 or not _NAME.match(name):
        raise invalid(where, "command_args.NAME needs a variable name (letters, digits, _)")
    used = any(f"${name}" in arg or f"${{{name}}}" in arg for arg in spec.command)
    if not used:
        raise invalid(where, f"the command never uses ${name} (or ${{{name}}})")


def _check_known(spec: BaseJob, key: str, path: list[str]) -> None:
    sections = _SPEC_SECTIONS[spec.type]
    known = (
        len(path) == 2
        and path[0] in sections
        and _field_info(spec.type, path) is not None
        and (path[0] != "model" or path[1] in _MODEL_KEYS)
    )
    if known:
        return
    hint = ", ".join(f"{s}.<field>" for s in sections)
    if isinstance(spec, ScriptJobCreate):
        hint += ", command_args.<NAME>"
    raise invalid(
        f"search_space.{key}",
        f"unknown key {key!r}: not a field of a {spec.type} job a search may set",
        hint,
        _suggested_key(spec, key),
    )


def _check_type(job_type: str, key: str, rng: Range) -> None:
    where = f"search_space.{key}"
    annotation = getattr(_field_info(job_type, key.split(".")), "annotation", None)
    if isinstance(rng, FloatRange) and annotation is int:
        raise invalid(f"{where}.type", f"{key} is an integer: use type int or categorical")
    if isinstance(rng, FloatRange | IntRange) and annotation not in (int, float):
        raise invalid(f"{where}.type", f"{key} is not a number: use type categorical")


def _check_values(spec: BaseJob, raw_job: dict[str, Any], key: str, values: list[Any]) -> None:
    """Each value set in the job spec passes the job's own validation."""
    where = f"search_space.{key}"
    path = key.split(".")
    allowed = _allowed_at(raw_job, path)
    base = spec.model_dump(mode="json", exclude_none=True)
    for value in values:
        trial = copy.deepcopy(base)
        set_path(trial, path, value)
        try:
            JOB_CREATE.validate_python(trial)
        except ValidationError as exc:
            reason = str(exc.errors()[0]["msg"])
            raise invalid(where, f"value {value!r} is outside {key}'s range: {reason}", allowed) from exc
        if path == ["model", "architecture"] and value not in CLASSIFICATION_ARCHITECTURES:
            raise invalid(
                where,
                f"value {value!r} is not a torchvision classification architecture",
                "a torchvision classification model name",
            )

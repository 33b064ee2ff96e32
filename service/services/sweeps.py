"""Sweeps (docs/sweeps.md): hyperparameter search over ordinary jobs, decided by Optuna.

The search library keeps no state of its own. Every decision rebuilds an in-memory Optuna
study from torchyard's tables (``sweeps``, ``sweep_trials``: each trial's parameters, state,
per-epoch objective values and the attributes the sampler and the pruner keep on it), asks
or prunes, and writes what changed back in the same transaction, under the sweep's row
lock. So an API restart, a second replica or a database outage loses no decision, and a
trial number is given once: the trial's row and its job are committed together, or not at
all.

Decisions are taken by :func:`drive`, which every API replica's reaper runs on each pass,
and at submission for the first trials.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job, Metric, Sweep, SweepTrial, Token, utcnow
from service.schemas.common import closest_name, field_names_at, suggested_field
from service.schemas.jobs import JOB_CREATE, JOB_CREATE_MODELS, ScriptJobCreate, TrainJobCreate
from service.schemas.sweeps import (
    MAX_KEYS,
    Categorical,
    FloatRange,
    IntRange,
    SearchRange,
    SweepCreate,
    SweepPublic,
    TrialPublic,
)
from service.services import refs
from service.services.jobs import request_cancel, submit_job
from service.services.reports import not_superseded
from service.services.tokens import Principal
from service.states import FINAL_STATUSES, JobStatus, Role, SweepStatus, TrialState
from torchyard.architectures import CLASSIFICATION_ARCHITECTURES
from torchyard.contract.errors import NotFoundError, RequestValidationError, TorchyardError
from torchyard.contract.jobspec import DEFAULT_JOB_TYPE, JOB_TYPES, JobKind

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)

# The largest grid a grid sweep may enumerate.
MAX_GRID = 10_000
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SPEC_SECTIONS: dict[str, tuple[str, ...]] = {
    JobKind.TRAIN: ("parameters", "model", "resources"),
    JobKind.SCRIPT: ("resources",),
}
# Model fields a search may vary (the weights to start from are not a hyperparameter).
_MODEL_KEYS = {"architecture", "pretrained", "memory_efficient"}
_FINAL_TRIALS = {TrialState.COMPLETED, TrialState.PRUNED, TrialState.FAILED, TrialState.CANCELLED}
# Trials whose parameters a later trial may be given again: they said nothing about them.
_RETRIED = {TrialState.FAILED.value, TrialState.CANCELLED.value}
# Proposals asked for one trial before one that no trial has had yet is taken (a search
# space smaller than the sweep's trials runs out of new points).
MAX_REDRAWS = 50


def _invalid(
    field_name: str, message: str, allowed: str | None = None, suggestion: str | None = None
) -> RequestValidationError:
    item: dict[str, Any] = {"field": field_name, "message": message}
    if allowed is not None:
        item["allowed"] = allowed
    if suggestion is not None:
        item["message"] = message = f"{message}: did you mean {suggestion!r}?"
        item["suggestion"] = suggestion
    text = f"{field_name}: {message}" + (f" (allowed: {allowed})" if allowed else "")
    return RequestValidationError(f"invalid request: {text}", details={**item, "errors": [item]})


# --- validation -------------------------------------------------------------------------


def _parse_job(raw: dict[str, Any]) -> TrainJobCreate | ScriptJobCreate:
    try:
        spec = JOB_CREATE.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"] if str(p) not in JOB_TYPES]
        where = ".".join(["job", *loc])
        unknown = first["type"] == "extra_forbidden"
        message = f"unknown field {where!r}" if unknown else str(first["msg"])
        suggestion = _suggested_job_field(raw, first["loc"]) if unknown else None
        raise _invalid(where, message, _allowed_at(raw, loc), suggestion) from exc
    if not isinstance(spec, TrainJobCreate | ScriptJobCreate):
        raise _invalid("job.type", "a sweep runs train or script jobs", "train or script")
    return spec


def _suggested_job_field(raw: Any, loc: tuple[Any, ...]) -> str | None:
    """``job.<the field an unknown job field most likely means>``, or None."""
    job_type = str(loc[0]) if loc and loc[0] in JOB_CREATE_MODELS else None
    if job_type is None:
        job_type = raw.get("type", DEFAULT_JOB_TYPE) if isinstance(raw, dict) else DEFAULT_JOB_TYPE
        if job_type not in JOB_CREATE_MODELS:
            return None
    path = list(loc[1:]) if loc and loc[0] == job_type else list(loc)
    found = suggested_field(JOB_CREATE_MODELS[job_type], path)
    return None if found is None else f"job.{found}"


def _search_keys(spec: TrainJobCreate | ScriptJobCreate) -> list[str]:
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


def _suggested_key(spec: TrainJobCreate | ScriptJobCreate, key: str) -> str | None:
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
    job_type = raw.get("type", DEFAULT_JOB_TYPE) if isinstance(raw, dict) else DEFAULT_JOB_TYPE
    info = _field_info(job_type if job_type in _SPEC_SECTIONS else DEFAULT_JOB_TYPE, path)
    extra = getattr(info, "json_schema_extra", None)
    return str(extra["allowed"]) if isinstance(extra, dict) and "allowed" in extra else None


def _produced_values(key: str, rng: FloatRange | IntRange | Categorical) -> list[Any]:
    """Every value the range can produce that bounds what it can produce: its ends, or each choice."""
    where = f"search_space.{key}"
    if isinstance(rng, Categorical):
        if not rng.choices:
            raise _invalid(f"{where}.choices", "no choices: give at least one value", "1..100 values")
        if len({repr(c) for c in rng.choices}) != len(rng.choices):
            raise _invalid(f"{where}.choices", "a choice is given twice")
        return list(rng.choices)
    if rng.low > rng.high:
        raise _invalid(f"{where}.low", f"low {rng.low} is above high {rng.high}", "low <= high")
    if rng.log and rng.low <= 0:
        raise _invalid(f"{where}.low", f"a log range needs low > 0, not {rng.low}", "> 0 with log")
    if rng.log and isinstance(rng, FloatRange) and rng.step is not None:
        raise _invalid(f"{where}.step", "step cannot be used with log")
    if rng.log and isinstance(rng, IntRange) and rng.step != 1:
        raise _invalid(f"{where}.step", "step cannot be used with log")
    return [rng.low, rng.high]


def _set_path(spec: dict[str, Any], path: list[str], value: Any) -> None:
    node = spec
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


def _check_key(spec: TrainJobCreate | ScriptJobCreate, raw_job: dict[str, Any], key: str, rng: Any) -> None:
    """The key names a field of the job spec a search may set, and every value the range can
    produce passes that field's own validation (a 422 naming the key and the range)."""
    where = f"search_space.{key}"
    path = key.split(".")
    values = _produced_values(key, rng)
    if isinstance(spec, ScriptJobCreate) and path[0] == "command_args":
        name = ".".join(path[1:])
        if len(path) != 2 or not _NAME.match(name):
            raise _invalid(where, "command_args.NAME needs a variable name (letters, digits, _)")
        used = any(f"${name}" in arg or f"${{{name}}}" in arg for arg in spec.command)
        if not used:
            raise _invalid(where, f"the command never uses ${name} (or ${{{name}}})")
        return
    sections = _SPEC_SECTIONS[spec.type]
    known = (
        len(path) == 2
        and path[0] in sections
        and _field_info(spec.type, path) is not None
        and (path[0] != "model" or path[1] in _MODEL_KEYS)
    )
    if not known:
        hint = ", ".join(f"{s}.<field>" for s in sections)
        if isinstance(spec, ScriptJobCreate):
            hint += ", command_args.<NAME>"
        raise _invalid(
            where,
            f"unknown key {key!r}: not a field of a {spec.type} job a search may set",
            hint,
            _suggested_key(spec, key),
        )
    _check_type(spec.type, key, rng)
    allowed = _allowed_at(raw_job, path)
    base = spec.model_dump(mode="json", exclude_none=True)
    for value in values:
        trial = copy.deepcopy(base)
        _set_path(trial, path, value)
        try:
            JOB_CREATE.validate_python(trial)
        except ValidationError as exc:
            reason = str(exc.errors()[0]["msg"])
            raise _invalid(where, f"value {value!r} is outside {key}'s range: {reason}", allowed) from exc
        if path == ["model", "architecture"] and value not in CLASSIFICATION_ARCHITECTURES:
            raise _invalid(
                where,
                f"value {value!r} is not a torchvision classification architecture",
                "a torchvision classification model name",
            )


def _check_type(job_type: str, key: str, rng: Any) -> None:
    where = f"search_space.{key}"
    annotation = getattr(_field_info(job_type, key.split(".")), "annotation", None)
    if isinstance(rng, FloatRange) and annotation is int:
        raise _invalid(f"{where}.type", f"{key} is an integer: use type int or categorical")
    if isinstance(rng, FloatRange | IntRange) and annotation not in (int, float):
        raise _invalid(f"{where}.type", f"{key} is not a number: use type categorical")


def _axis_count(key: str, rng: FloatRange | IntRange | Categorical) -> int:
    """How many values a grid takes from one range, counted without listing them (a 422
    naming the range when it is more than a grid may hold)."""
    where = f"search_space.{key}"
    if isinstance(rng, Categorical):
        return len(rng.choices)
    if isinstance(rng, IntRange):
        if rng.log:
            raise _invalid(f"{where}.log", "a grid enumerates values: use a step, or categorical choices")
        count = max(0, (rng.high - rng.low) // rng.step + 1)
        field_name = where
    else:
        if rng.step is None:
            raise _invalid(f"{where}.step", "a grid of floats needs a step (or categorical choices)")
        steps = (rng.high - rng.low) / rng.step + 1e-9
        if not math.isfinite(steps):
            raise _invalid(f"{where}.step", "too many values: more than a grid may hold", f"<= {MAX_GRID}")
        count = max(0, math.floor(steps) + 1)
        field_name = f"{where}.step"
    if count > MAX_GRID:
        raise _invalid(field_name, f"{count} values: more than a grid may hold", f"<= {MAX_GRID}")
    return count


def _grid(search_space: dict[str, Any]) -> dict[str, list[Any]]:
    # Every axis and their product are counted before a single value is listed.
    counts = {key: _axis_count(key, rng) for key, rng in search_space.items()}
    size = math.prod(counts.values())
    if size > MAX_GRID:
        raise _invalid("search_space", f"the grid has {size} points", f"<= {MAX_GRID}")
    grid: dict[str, list[Any]] = {}
    for key, rng in search_space.items():
        if isinstance(rng, Categorical):
            grid[key] = list(rng.choices)
        elif isinstance(rng, IntRange):
            grid[key] = list(range(rng.low, rng.high + 1, rng.step))
        else:
            assert rng.step is not None
            grid[key] = [round(rng.low + i * rng.step, 12) for i in range(counts[key])]
    return grid


def validate(body: SweepCreate) -> tuple[TrainJobCreate | ScriptJobCreate, dict[str, Any]]:
    """The base job and the normalized sweep spec; a 422 naming the field otherwise."""
    if not body.search_space:
        raise _invalid(
            "search_space", "no keys: give at least one parameter to search", f"1..{MAX_KEYS} keys"
        )
    if len(body.search_space) > MAX_KEYS:
        raise _invalid("search_space", f"{len(body.search_space)} keys", f"1..{MAX_KEYS} keys")
    if body.max_concurrent_trials > body.max_trials:
        raise _invalid(
            "max_concurrent_trials",
            f"{body.max_concurrent_trials} is above max_trials {body.max_trials}",
            "1..max_trials",
        )
    spec = _parse_job(body.job)
    for key, rng in body.search_space.items():
        _check_key(spec, body.job, key, rng)
    if body.algorithm == "grid":
        _grid(body.search_space)
    normalized = body.model_dump(mode="json")
    normalized["job"] = spec.model_dump(mode="json")
    return spec, normalized


# --- the search library, rebuilt from the tables ------------------------------------------


def _ranges(spec: dict[str, Any]) -> dict[str, FloatRange | IntRange | Categorical]:
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(SearchRange)
    return {k: adapter.validate_python(v) for k, v in spec["search_space"].items()}


def _study(sweep: Sweep, trials: list[SweepTrial], number: int) -> tuple[optuna.Study, dict[str, int]]:
    """An in-memory study holding every trial as the tables say (Optuna, imported only here:
    an API without running sweeps never loads it)."""
    from service.services.sweep_search import study

    spec = sweep.spec
    grid = _grid(_ranges(spec)) if spec["algorithm"] == "grid" else None
    return study(spec, _ranges(spec), grid, trials, number)


# --- decisions ------------------------------------------------------------------------------


@dataclass
class DriveResult:
    created: list[str] = field(default_factory=list)  # job ids queued
    pruned: list[str] = field(default_factory=list)
    finished: bool = False


def _objective_points(session: Session, job_id: str, metric: str) -> dict[int, float]:
    """The job's objective by epoch (the lowest rank's latest point, superseded ones left out)."""
    rows = session.execute(
        select(Metric.epoch, Metric.step, Metric.rank, Metric.value)
        .where(Metric.job_id == job_id, Metric.name == metric, not_superseded())
        .order_by(Metric.seq)
    ).all()
    if not rows:
        return {}
    low_rank = min(r.rank for r in rows)
    # A script that reports no epochs counts its steps (from 1) instead.
    use_epochs = any(r.epoch > 0 for r in rows)
    out: dict[int, float] = {}
    for epoch, step, rank, value in rows:
        if rank != low_rank or not math.isfinite(value):
            continue
        key = epoch if use_epochs else step + 1
        if key > 0:
            out[key] = float(value)
    return out


def _best(values: dict[int, float], goal: str) -> float | None:
    if not values:
        return None
    return max(values.values()) if goal == "maximize" else min(values.values())


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _prune_reason(sweep: Sweep, trials: list[SweepTrial], trial: SweepTrial, epoch: int, value: float) -> str:
    spec = sweep.spec
    rule = spec["early_stopping"]
    metric = spec["objective"]["metric"]
    if rule["type"] == "asha":
        factor = rule["reduction_factor"]
        share = {2: "half", 3: "third", 4: "quarter"}.get(factor, f"1/{factor}")
        side = "below" if spec["objective"]["goal"] == "maximize" else "above"
        return f"pruned by ASHA at epoch {epoch}: {metric} {_fmt(value)} {side} the rung's top {share}"
    others = [t.steps()[epoch] for t in trials if t.id != trial.id and epoch in t.steps()]
    median = statistics.median(others) if others else float("nan")
    side = "below" if spec["objective"]["goal"] == "maximize" else "above"
    return (
        f"pruned by the median rule at epoch {epoch}: {metric} {_fmt(value)} {side} the median "
        f"{_fmt(median)} of the other trials at that epoch"
    )


def _trial_state(job: Job) -> TrialState:
    status = JobStatus(job.status)
    if status in (JobStatus.QUEUED, JobStatus.SCHEDULED):
        return TrialState.QUEUED
    if status in (JobStatus.RUNNING, JobStatus.CANCELLING):
        return TrialState.RUNNING
    if status is JobStatus.SUCCEEDED:
        return TrialState.COMPLETED
    if status is JobStatus.FAILED:
        return TrialState.FAILED
    return TrialState.CANCELLED


def _lock_sweep(session: Session, sweep_id: str) -> Sweep | None:
    return session.scalars(select(Sweep).where(Sweep.id == sweep_id).with_for_update()).first()


def _update_trials(session: Session, sweep: Sweep, trials: list[SweepTrial], result: DriveResult) -> None:
    """Each live trial's new objective values (pruning it if the rule says so) and final state."""
    spec = sweep.spec
    metric, goal = spec["objective"]["metric"], spec["objective"]["goal"]
    live = [t for t in trials if TrialState(t.state) not in _FINAL_TRIALS]
    if not live:
        return
    jobs = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_([t.job_id for t in live])))}
    pending = []
    for trial in live:
        job = jobs[trial.job_id]
        points = _objective_points(session, job.id, metric)
        known = trial.steps()
        new_epochs = [e for e in sorted(points) if e not in known or known[e] != points[e]]
        pending.append((trial, job, points, new_epochs, _trial_state(job)))
    pruned_at: dict[str, int] = {}
    if spec.get("early_stopping"):
        # The epochs reported since the last round arrived together as far as the sweep can
        # tell: they are judged epoch by epoch and, within an epoch, best value first. So of k
        # trials reaching a rung at once only those in the rule's top share go on, as if
        # they had been judged side by side, not the first few by trial number (an
        # asynchronous rule promotes whoever reaches a rung first while it stands alone).
        sign = -1.0 if goal == "maximize" else 1.0
        arrivals = sorted(
            (epoch, sign * points[epoch], trial.number, i)
            for i, (trial, _job, points, new_epochs, _state) in enumerate(pending)
            for epoch in new_epochs
        )
        judge = _Judge(sweep, trials)
        for epoch, _value, _number, i in arrivals:
            trial, _job, points, _new, state = pending[i]
            if trial.id in pruned_at:
                continue
            if judge.step(trial, epoch, points[epoch], act=state is TrialState.RUNNING):
                pruned_at[trial.id] = epoch
    for trial, job, points, _new, state in pending:
        at = pruned_at.get(trial.id)
        if at is not None:
            trial.intermediate = {str(e): v for e, v in points.items() if e <= at}
            reason = _prune_reason(sweep, trials, trial, at, points[at])
            _prune(session, trial, job, reason, goal)
            result.pruned.append(job.id)
            continue
        trial.intermediate = {str(e): v for e, v in sorted(points.items())}
        trial.epochs = len(points)
        trial.value = _best(points, goal)
        _finish(trial, job, state, metric)


class _Judge:
    """The early-stopping rule over a study rebuilt (once per round, when needed) from the tables."""

    def __init__(self, sweep: Sweep, trials: list[SweepTrial]) -> None:
        self.sweep, self.trials = sweep, trials
        self.study: optuna.Study | None = None
        self.ids: dict[str, int] = {}

    def step(self, trial: SweepTrial, epoch: int, value: float, *, act: bool) -> bool:
        """Feed one new epoch of the trial to the rule; whether it is pruned there, if ``act``
        (a live job). Every epoch goes through the rule, a finished trial's too: the rule
        records on each trial what it reached (ASHA's rungs), which later trials are judged by."""
        if self.study is None:
            self.study, self.ids = _study(self.sweep, self.trials, self.sweep.trials_created)
        study = self.study
        storage, tid = study._storage, self.ids[trial.id]
        storage.set_trial_intermediate_value(tid, epoch, value)
        pruned = bool(study.pruner.prune(study, storage.get_trial(tid))) and act
        trial.system_attrs = dict(storage.get_trial(tid).system_attrs)
        return pruned


def _finish(trial: SweepTrial, job: Job, state: TrialState, metric: str) -> None:
    if state is TrialState.COMPLETED and trial.value is None:
        state = TrialState.FAILED
        trial.reason = f"the job succeeded without reporting {metric}"
    elif state is TrialState.FAILED:
        trial.reason = f"{job.failure_code}: {job.failure_message}"
    elif state is TrialState.CANCELLED:
        trial.reason = job.cancel_reason or "cancelled"
    trial.state = state.value
    if state in _FINAL_TRIALS:
        trial.finished_at = job.finished_at or utcnow()


def _prune(session: Session, trial: SweepTrial, job: Job, reason: str, goal: str) -> None:
    trial.state = TrialState.PRUNED.value
    trial.reason = reason
    trial.epochs = len(trial.intermediate)
    trial.value = _best(trial.steps(), goal)
    trial.finished_at = utcnow()
    locked = session.scalars(select(Job).where(Job.id == job.id).with_for_update()).one()
    request_cancel(session, locked, reason)
    log.info("sweep trial %s (job %s): %s", trial.number, job.id, reason)


def _expand(command: list[str], values: dict[str, Any]) -> list[str]:
    out = []
    for arg in command:
        for name, value in values.items():
            text = _text(value)
            arg = arg.replace(f"${{{name}}}", text)
            arg = re.sub(rf"\${re.escape(name)}(?![A-Za-z0-9_])", text.replace("\\", "\\\\"), arg)
        out.append(arg)
    return out


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _trial_spec(sweep: Sweep, params: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(sweep.spec["job"])
    args = {}
    for key, value in params.items():
        path = key.split(".")
        if path[0] == "command_args":
            args[path[1]] = value
        else:
            _set_path(spec, path, value)
    if args:
        spec["command"] = _expand(spec["command"], args)
    spec["name"] = f"{sweep.name}-{sweep.trials_created}"
    return spec


def _owner(session: Session, sweep: Sweep) -> Principal:
    token = session.get(Token, sweep.owner_id)
    name = token.name if token is not None else sweep.owner_id
    role = Role(token.role) if token is not None else Role.USER
    return Principal(id=sweep.owner_id, name=name, role=role)


def _grid_size(sweep: Sweep) -> int | None:
    if sweep.algorithm != "grid":
        return None
    return math.prod(len(v) for v in _grid(_ranges(sweep.spec)).values())


def _target_trials(sweep: Sweep) -> int:
    size = _grid_size(sweep)
    return sweep.max_trials if size is None else min(size, sweep.max_trials)


def _space_size(sweep: Sweep) -> int | None:
    """How many points the search space holds (None: a float range without a step)."""
    size = 1
    for rng in _ranges(sweep.spec).values():
        if isinstance(rng, Categorical):
            size *= len(rng.choices)
        elif isinstance(rng, IntRange):
            size *= (rng.high - rng.low) // rng.step + 1
        elif rng.step is not None:
            size *= math.floor((rng.high - rng.low) / rng.step + 1e-9) + 1
        else:
            return None
    return size


def _params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


def _create_trials(
    session: Session, settings: Settings, sweep: Sweep, trials: list[SweepTrial], result: DriveResult
) -> None:
    """Ask for trials while the sweep has room for them; each one's job is queued with it."""
    target = _target_trials(sweep)
    running = sum(1 for t in trials if TrialState(t.state) not in _FINAL_TRIALS)
    owner = _owner(session, sweep)
    from service.services.sweep_search import distribution

    dists = {k: distribution(r) for k, r in _ranges(sweep.spec).items()}
    while sweep.trials_created < target and running < sweep.max_concurrent_trials:
        number = sweep.trials_created
        study, _ids = _study(sweep, trials, number)
        tried = {_params_key(t.params) for t in trials if t.state not in _RETRIED}
        size = _space_size(sweep)
        redraws = 1 if size is not None and len(tried) >= size else MAX_REDRAWS
        for _ in range(redraws):
            asked = study.ask(dists)
            params = {k: asked.params[k] for k in dists}
            if _params_key(params) not in tried:
                break
            # Parameters a trial already has would train the same curve again. The proposal
            # stays running in this in-memory study, where TPE's constant liar counts it as
            # a poor result and the random sampler draws on: the next proposal moves away.
        else:
            log.info("sweep %s: trial %s repeats parameters already tried (%s)", sweep.id, number, params)
        attrs = dict(study._storage.get_trial(asked._trial_id).system_attrs)
        raw = _trial_spec(sweep, params)
        spec = JOB_CREATE.validate_python(raw)
        job = submit_job(session, settings, owner, spec, commit=False)
        job.sweep_id = sweep.id
        job.trial_number = number
        trial = SweepTrial(
            sweep_id=sweep.id,
            number=number,
            job_id=job.id,
            params=params,
            state=TrialState.QUEUED.value,
            epochs=0,
            intermediate={},
            system_attrs=attrs,
            created_at=utcnow(),
        )
        session.add(trial)
        trials.append(trial)
        sweep.trials_created = number + 1
        running += 1
        result.created.append(job.id)
    session.flush()


def _settle(session: Session, sweep: Sweep, trials: list[SweepTrial], result: DriveResult) -> None:
    """The sweep ends after its last trial, once every trial's job has ended (a pruned
    trial's job may still be stopping its ranks)."""
    if sweep.trials_created < _target_trials(sweep):
        return
    if any(TrialState(t.state) not in _FINAL_TRIALS for t in trials):
        return
    stopping = session.scalar(
        select(func.count()).where(
            Job.sweep_id == sweep.id, Job.status.not_in([s.value for s in FINAL_STATUSES])
        )
    )
    if stopping:
        return
    completed = [t for t in trials if t.state == TrialState.COMPLETED.value]
    now = utcnow()
    sweep.status = (SweepStatus.SUCCEEDED if completed else SweepStatus.FAILED).value
    sweep.message = (
        f"{len(completed)} of {len(trials)} trials completed"
        if completed
        else f"no trial completed ({len(trials)} trials)"
    )
    sweep.finished_at = now
    sweep.updated_at = now
    result.finished = True


def drive_sweep(session: Session, settings: Settings, sweep_id: str) -> DriveResult:
    """One decision round for a running sweep, under its row lock; the caller commits."""
    result = DriveResult()
    sweep = _lock_sweep(session, sweep_id)
    if sweep is None or sweep.status != SweepStatus.RUNNING.value:
        return result
    trials = list(session.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep.id)))
    _update_trials(session, sweep, trials, result)
    _create_trials(session, settings, sweep, trials, result)
    _settle(session, sweep, trials, result)
    if result.created or result.pruned:
        sweep.updated_at = utcnow()
    return result


def drive(db: Database, settings: Settings) -> DriveResult:
    """A decision round for every running sweep (each in its own transaction; safe on
    several replicas at once: the second one to lock a sweep finds the decisions taken)."""
    total = DriveResult()
    with db.read_session() as session:
        running = list(session.scalars(select(Sweep.id).where(Sweep.status == SweepStatus.RUNNING.value)))
    for sweep_id in running:
        try:
            with db.transaction() as session:
                one = drive_sweep(session, settings, sweep_id)
        except TorchyardError as exc:
            # Its next trial cannot be queued (its dataset or code deleted, the cluster
            # shrunk below the job): the sweep fails, saying why, and its live trials stop.
            with db.transaction() as session:
                sweep = _lock_sweep(session, sweep_id)
                if sweep is not None and sweep.status == SweepStatus.RUNNING.value:
                    number = sweep.trials_created
                    _stop(
                        session,
                        sweep,
                        SweepStatus.FAILED,
                        f"trial {number} could not be queued: {exc.message}",
                    )
            log.warning("sweep %s failed: its next trial could not be queued: %s", sweep_id, exc.message)
            continue
        except Exception:
            # Anything else (the database unreachable) is retried on the next pass; one
            # sweep must not hold the others up.
            log.exception("sweep %s: decision round failed", sweep_id)
            continue
        total.created += one.created
        total.pruned += one.pruned
    return total


# --- requests -----------------------------------------------------------------------------


def create_sweep(session: Session, settings: Settings, principal: Principal, body: SweepCreate) -> Sweep:
    """Validate, store the sweep and queue its first trials, in one transaction."""
    spec, normalized = validate(body)
    name = (
        body.name
        or f"sweep-{spec.name or (spec.model.architecture if isinstance(spec, TrainJobCreate) else 'script')}"
    )
    normalized["name"] = name
    now = utcnow()
    sweep = Sweep(
        owner_id=principal.id,
        name=name,
        status=SweepStatus.RUNNING.value,
        spec=normalized,
        algorithm=body.algorithm,
        max_trials=body.max_trials,
        max_concurrent_trials=body.max_concurrent_trials,
        trials_created=0,
        created_at=now,
        updated_at=now,
    )
    session.add(sweep)
    session.flush()
    # The first trials are queued now: a job spec that cannot run (a missing dataset, a
    # resource the cluster lacks) fails the request, and nothing is stored.
    _create_trials(session, settings, sweep, [], DriveResult())
    session.commit()
    return sweep


def get_sweep(session: Session, principal: Principal, ref: str, *, for_update: bool = False) -> Sweep:
    def by_id(wanted: str) -> Sweep | None:
        stmt = select(Sweep).where(Sweep.id == wanted)
        return session.scalars(stmt.with_for_update() if for_update else stmt).first()

    sweep = by_id(ref) if refs.comparable(ref) else None
    if sweep is None or (not principal.is_admin and sweep.owner_id != principal.id):
        visible = [] if principal.is_admin else [Sweep.owner_id == principal.id]
        found = refs.resolve(session, Sweep, visible, ref, "sweep")
        sweep = None if found is None else by_id(found)
        if sweep is None:
            raise NotFoundError(
                f"sweep {ref!r} not found (no sweep you may see has this id, name or id prefix)"
            )
    return sweep


def list_sweeps(
    session: Session,
    principal: Principal,
    *,
    statuses: list[SweepStatus] | None,
    limit: int,
    cursor: str | None,
) -> tuple[list[Sweep], str | None]:
    stmt = select(Sweep)
    if not principal.is_admin:
        stmt = stmt.where(Sweep.owner_id == principal.id)
    if statuses:
        stmt = stmt.where(Sweep.status.in_([s.value for s in statuses]))
    return refs.page_newest_first(session, Sweep, stmt, limit=limit, cursor=cursor)


def cancel_sweep(session: Session, principal: Principal, ref: str) -> Sweep:
    """Idempotent: no new trial is asked for, and every live trial's job is cancelled."""
    sweep = get_sweep(session, principal, ref, for_update=True)
    if sweep.status != SweepStatus.RUNNING.value:
        return sweep
    _stop(session, sweep, SweepStatus.CANCELLED, f"sweep {sweep.name} cancelled by {principal.name}")
    session.commit()
    return sweep


def _stop(session: Session, sweep: Sweep, status: SweepStatus, reason: str) -> None:
    """End the sweep (its row held) with ``status``; every live trial's job is cancelled."""
    trials = list(session.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep.id)))
    now = utcnow()
    for trial in trials:
        if TrialState(trial.state) in _FINAL_TRIALS:
            continue
        job = session.scalars(select(Job).where(Job.id == trial.job_id).with_for_update()).one()
        request_cancel(session, job, reason)
        trial.state = TrialState.CANCELLED.value
        trial.reason = reason
        trial.finished_at = now
    sweep.status = status.value
    sweep.message = reason
    sweep.finished_at = now
    sweep.updated_at = now


def _trial_public(trial: SweepTrial, job_status: str) -> TrialPublic:
    return TrialPublic(
        number=trial.number,
        job_id=trial.job_id,
        params=trial.params,
        state=trial.state,
        job_status=job_status,
        value=trial.value,
        epochs=trial.epochs,
        intermediate=dict(trial.intermediate or {}),
        reason=trial.reason,
        created_at=trial.created_at,
        finished_at=trial.finished_at,
    )


def sweeps_public(session: Session, sweeps: list[Sweep], *, detail: bool) -> list[SweepPublic]:
    """The sweeps as users see them; ``detail`` lists every trial."""
    ids = [s.id for s in sweeps]
    by_sweep: dict[str, list[TrialPublic]] = {i: [] for i in ids}
    if ids:
        rows = session.execute(
            select(SweepTrial, Job.status)
            .join(Job, Job.id == SweepTrial.job_id)
            .where(SweepTrial.sweep_id.in_(ids))
            .order_by(SweepTrial.sweep_id, SweepTrial.number)
        ).all()
        for trial, job_status in rows:
            by_sweep[trial.sweep_id].append(_trial_public(trial, job_status))
    out = []
    for sweep in sweeps:
        spec = sweep.spec
        trials = by_sweep[sweep.id]
        scored = [t for t in trials if t.value is not None and t.state == TrialState.COMPLETED.value]
        best = None
        if scored:
            pick = max if spec["objective"]["goal"] == "maximize" else min
            best = pick(scored, key=lambda t: (t.value, -t.number))
        counts: dict[str, int] = {}
        for t in trials:
            counts[t.state] = counts.get(t.state, 0) + 1
        out.append(
            SweepPublic(
                id=sweep.id,
                name=sweep.name,
                owner=sweep.owner_id,
                status=sweep.status,
                type=spec["job"].get("type", "train"),
                job=spec["job"],
                search_space=spec["search_space"],
                objective=spec["objective"],
                algorithm=sweep.algorithm,
                early_stopping=spec.get("early_stopping"),
                max_trials=sweep.max_trials,
                max_concurrent_trials=sweep.max_concurrent_trials,
                seed=spec["seed"],
                message=sweep.message,
                trial_counts=counts,
                best_trial=best,
                trials=trials if detail else None,
                epochs_run=sum(t.epochs for t in trials),
                created_at=sweep.created_at,
                updated_at=sweep.updated_at,
                finished_at=sweep.finished_at,
            )
        )
    return out

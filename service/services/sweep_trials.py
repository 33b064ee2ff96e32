"""A sweep's new trials (docs/sweeps.md): the sampler's proposal for the next trial number,
turned into the base job with those parameters and queued with the trial's row, in the
caller's transaction (the trial's row and its job are committed together, or not at all).
"""

from __future__ import annotations

import copy
import json
import logging
import re
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Sweep, SweepTrial, Team, Token
from service.db.types import utcnow
from service.schemas.jobs import JOB_CREATE
from service.services.jobs import submit_job
from service.services.ownership import owner_tokens
from service.services.sweep_space import set_path, space_size, target_trials
from service.services.tokens import Principal
from service.states import Role, TrialState

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

log = logging.getLogger(__name__)

FINAL_TRIALS = {TrialState.COMPLETED, TrialState.PRUNED, TrialState.FAILED, TrialState.CANCELLED}
# Trials whose parameters a later trial may be given again: they said nothing about them.
_RETRIED = {TrialState.FAILED.value, TrialState.CANCELLED.value}
# Proposals asked for one trial before one that no trial has had yet is taken (a search
# space smaller than the sweep's trials runs out of new points).
MAX_REDRAWS = 50


def is_live(trial: SweepTrial) -> bool:
    """The trial has not ended (its job queued or running)."""
    return TrialState(trial.state) not in FINAL_TRIALS


def create_trials(session: Session, settings: Settings, sweep: Sweep, trials: list[SweepTrial]) -> list[str]:
    """Ask for trials while the sweep has room for them; each one's job is queued with it.
    The new trials join ``trials``; the ids of their jobs are returned."""
    created: list[str] = []
    target = target_trials(sweep)
    running = sum(1 for t in trials if is_live(t))
    owner = _owner(session, sweep)
    # Optuna is imported only when a sweep decides.
    from service.services.sweep_search import distributions

    dists = distributions(sweep)
    while sweep.trials_created < target and running < sweep.max_concurrent_trials:
        number = sweep.trials_created
        params, attrs = _suggest(sweep, trials, number, dists)
        trial = _queue(session, settings, owner, sweep, params, attrs)
        trials.append(trial)
        sweep.trials_created = number + 1
        running += 1
        created.append(trial.job_id)
    session.flush()
    return created


def _suggest(
    sweep: Sweep, trials: list[SweepTrial], number: int, dists: dict[str, BaseDistribution]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parameters of trial ``number`` and the attributes its sampler keeps on it: a point
    no trial has had yet, while the space has one."""
    from service.services.sweep_search import rebuild

    search = rebuild(sweep, trials, number)
    tried = {_params_key(t.params) for t in trials if t.state not in _RETRIED}
    size = space_size(sweep)
    redraws = 1 if size is not None and len(tried) >= size else MAX_REDRAWS
    for _ in range(redraws):
        params, attrs = search.ask(dists)
        if _params_key(params) not in tried:
            return params, attrs
        # Parameters a trial already has would train the same curve again. The proposal
        # stays running in this in-memory study, where TPE's constant liar counts it as
        # a poor result and the random sampler draws on: the next proposal moves away.
    log.info("sweep %s: trial %s repeats parameters already tried (%s)", sweep.id, number, params)
    return params, attrs


def _queue(
    session: Session,
    settings: Settings,
    owner: Principal,
    sweep: Sweep,
    params: dict[str, Any],
    attrs: dict[str, Any],
) -> SweepTrial:
    """Trial ``sweep.trials_created``'s job, submitted as its owner's, and its row."""
    number = sweep.trials_created
    spec = JOB_CREATE.validate_python(_trial_spec(sweep, params))
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
    return trial


def _params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


def _trial_spec(sweep: Sweep, params: dict[str, Any]) -> dict[str, Any]:
    """The base job with the trial's parameters set (``command_args`` expanded in a script
    job's command), named after the sweep and the trial number."""
    spec: dict[str, Any] = copy.deepcopy(sweep.spec["job"])
    args = {}
    for key, value in params.items():
        path = key.split(".")
        if path[0] == "command_args":
            args[path[1]] = value
        else:
            set_path(spec, path, value)
    if args:
        spec["command"] = _expand(spec["command"], args)
    spec["name"] = f"{sweep.name}-{sweep.trials_created}"
    return spec


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


def _owner(session: Session, sweep: Sweep) -> Principal:
    """Who the trials are submitted as: the sweep's owner, its user's datasets, code and
    models at hand, in the sweep's team (docs/teams.md), whichever teams the user is in now."""
    token = session.get(Token, sweep.owner_id)
    name = token.name if token is not None else sweep.owner_id
    role = Role(token.role) if token is not None else Role.USER
    team = session.get(Team, sweep.team_id) if sweep.team_id is not None else None
    return Principal(
        id=sweep.owner_id,
        name=name,
        role=role,
        user_id=token.user_id if token is not None else None,
        owner_ids=owner_tokens(session, sweep.owner_id),
        team_ids=(team.id,) if team is not None else (),
        team_names=(team.name,) if team is not None else (),
    )

"""The search library's side of a sweep: Optuna's samplers and pruners over a study rebuilt
in memory from torchyard's tables for each decision (:mod:`service.services.sweeps`).

Imported only when a sweep decides, so an API process without running sweeps never loads
Optuna (or NumPy, which it brings).
"""

from __future__ import annotations

import warnings
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState as OptunaState
from optuna.trial import create_trial

from service.db.models import SweepTrial
from service.schemas.sweeps import Categorical, FloatRange, IntRange
from service.states import TrialState

optuna.logging.set_verbosity(optuna.logging.WARNING)


def distribution(rng: FloatRange | IntRange | Categorical) -> BaseDistribution:
    if isinstance(rng, Categorical):
        return CategoricalDistribution(rng.choices)
    if isinstance(rng, IntRange):
        return IntDistribution(rng.low, rng.high, log=rng.log, step=rng.step)
    return FloatDistribution(rng.low, rng.high, log=rng.log, step=rng.step)


def _sampler(
    spec: dict[str, Any], grid: dict[str, list[Any]] | None, number: int
) -> optuna.samplers.BaseSampler:
    # Rebuilt for every decision: the seed moves on with the trial number, so a random
    # draw is not repeated, and the same history gives the same suggestion.
    seed = spec["seed"] + number
    algorithm = spec["algorithm"]
    if algorithm == "grid":
        assert grid is not None
        return optuna.samplers.GridSampler(grid, seed=spec["seed"])
    if algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    startup = max(2, min(10, spec["max_trials"] // 3))
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, constant_liar=True)


def _pruner(spec: dict[str, Any]) -> optuna.pruners.BasePruner:
    rule = spec.get("early_stopping")
    if rule is None:
        return optuna.pruners.NopPruner()
    if rule["type"] == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=rule["min_epochs"], reduction_factor=rule["reduction_factor"]
        )
    return optuna.pruners.MedianPruner(
        n_startup_trials=rule["min_trials"], n_warmup_steps=rule["min_epochs"] - 1, interval_steps=1
    )


def study(
    spec: dict[str, Any],
    ranges: dict[str, FloatRange | IntRange | Categorical],
    grid: dict[str, list[Any]] | None,
    trials: list[SweepTrial],
    number: int,
) -> tuple[optuna.Study, dict[str, int]]:
    """An in-memory study holding every trial as the tables say; Optuna's trial id by our trial id."""
    study = optuna.create_study(
        direction=spec["objective"]["goal"], sampler=_sampler(spec, grid, number), pruner=_pruner(spec)
    )
    dists = {k: distribution(r) for k, r in ranges.items()}
    ids: dict[str, int] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        state = TrialState(trial.state)
        steps = trial.steps()
        value = None
        if state is TrialState.COMPLETED:
            ostate = OptunaState.COMPLETE
            value = trial.value
        elif state is TrialState.PRUNED:
            ostate = OptunaState.PRUNED
        elif state in (TrialState.FAILED, TrialState.CANCELLED):
            ostate = OptunaState.FAIL
        else:
            ostate = OptunaState.RUNNING
        if ostate is OptunaState.COMPLETE and value is None:
            ostate = OptunaState.FAIL
        frozen = create_trial(
            state=ostate,
            value=value,
            params={k: v for k, v in trial.params.items() if k in dists},
            distributions={k: d for k, d in dists.items() if k in trial.params},
            intermediate_values=steps,
            system_attrs=dict(trial.system_attrs or {}),
        )
        study.add_trial(frozen)
        ids[trial.id] = study.trials[-1]._trial_id
    return study, ids


def importances(study: optuna.Study) -> tuple[dict[str, float] | None, str | None]:
    """Each parameter's importance for the objective over the study's completed trials
    (Optuna's default evaluator, PED-ANOVA), largest first; None and Optuna's reason where
    it would give every parameter the same share for want of trials."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = optuna.importance.get_param_importances(study)
    for warning in caught:
        if "will be equal" in str(warning.message):
            return None, str(warning.message).split(". ")[0]
    return {key: float(value) for key, value in values.items()}, None

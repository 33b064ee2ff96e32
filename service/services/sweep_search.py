"""The search library's side of a sweep: Optuna's samplers and pruners over a study rebuilt
in memory from torchyard's tables for each decision (docs/sweeps.md, "Where decisions are
taken").

Only Optuna's public API is used: the study lives in an in-memory storage made here and
kept beside it, the trials the tables hold are added as frozen trials (``create_trial``),
and a trial is found in that storage by its number.

Imported only when a sweep decides, so an API process without running sweeps never loads
Optuna (or NumPy, which it brings).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.storages import InMemoryStorage
from optuna.trial import FrozenTrial, create_trial
from optuna.trial import TrialState as OptunaState

from service.db.models import Sweep, SweepTrial
from service.schemas.sweeps import Categorical, IntRange
from service.services.sweep_space import Range, ranges, sweep_grid
from service.states import TrialState

optuna.logging.set_verbosity(optuna.logging.WARNING)

# A trial's state in the study, by its state in the tables (a completed trial without a
# value is added as failed).
_STATES = {
    TrialState.QUEUED: OptunaState.RUNNING,
    TrialState.RUNNING: OptunaState.RUNNING,
    TrialState.COMPLETED: OptunaState.COMPLETE,
    TrialState.PRUNED: OptunaState.PRUNED,
    TrialState.FAILED: OptunaState.FAIL,
    TrialState.CANCELLED: OptunaState.FAIL,
}


def distribution(rng: Range) -> BaseDistribution:
    if isinstance(rng, Categorical):
        return CategoricalDistribution(rng.choices)
    if isinstance(rng, IntRange):
        return IntDistribution(rng.low, rng.high, log=rng.log, step=rng.step)
    return FloatDistribution(rng.low, rng.high, log=rng.log, step=rng.step)


def distributions(sweep: Sweep) -> dict[str, BaseDistribution]:
    """Each search-space key's distribution, in the order of the search space."""
    return {key: distribution(rng) for key, rng in ranges(sweep.spec).items()}


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


def _frozen(trial: SweepTrial, dists: dict[str, BaseDistribution]) -> FrozenTrial:
    """The trial as the tables hold it, for the study."""
    state = _STATES[TrialState(trial.state)]
    value = trial.value if state is OptunaState.COMPLETE else None
    if state is OptunaState.COMPLETE and value is None:
        state = OptunaState.FAIL
    return create_trial(
        state=state,
        value=value,
        params={k: v for k, v in trial.params.items() if k in dists},
        distributions={k: d for k, d in dists.items() if k in trial.params},
        intermediate_values=trial.steps(),
        system_attrs=dict(trial.system_attrs or {}),
    )


@dataclass
class Search:
    """A sweep's study, rebuilt in memory from its trials, with the storage it lives in."""

    study: optuna.Study
    storage: InMemoryStorage
    study_id: int
    # The study's trial number of each of the sweep's trials, by the trial row's id.
    numbers: dict[str, int] = field(default_factory=dict)

    def _id_of(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def _stored(self, number: int) -> FrozenTrial:
        return self.storage.get_trial(self._id_of(number))

    def ask(self, dists: dict[str, BaseDistribution]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The sampler's next proposal: its parameters, and the attributes the sampler keeps
        on it. The proposal stays in the study as a running trial."""
        asked = self.study.ask(dists)
        params = {k: asked.params[k] for k in dists}
        return params, dict(self._stored(asked.number).system_attrs)

    def judge(self, trial: SweepTrial, epoch: int, value: float) -> tuple[bool, dict[str, Any]]:
        """Feed one epoch of the trial to the pruner: whether the pruner stops it there, and
        the attributes the pruner keeps on it (ASHA's rungs, which later trials are judged by)."""
        number = self.numbers[trial.id]
        self.storage.set_trial_intermediate_value(self._id_of(number), epoch, value)
        pruned = bool(self.study.pruner.prune(self.study, self._stored(number)))
        return pruned, dict(self._stored(number).system_attrs)


def rebuild(sweep: Sweep, trials: list[SweepTrial], number: int) -> Search:
    """An in-memory study holding every trial as the tables say, its sampler seeded for the
    trial ``number`` (the next one to ask for)."""
    spec = sweep.spec
    storage = InMemoryStorage()
    study = optuna.create_study(
        storage=storage,
        direction=spec["objective"]["goal"],
        sampler=_sampler(spec, sweep_grid(sweep), number),
        pruner=_pruner(spec),
    )
    search = Search(study, storage, storage.get_study_id_from_name(study.study_name))
    dists = distributions(sweep)
    for i, trial in enumerate(sorted(trials, key=lambda t: t.number)):
        study.add_trial(_frozen(trial, dists))
        search.numbers[trial.id] = i
    return search


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

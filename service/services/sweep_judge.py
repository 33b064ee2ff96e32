"""A sweep's early-stopping rule (``asha`` or ``median``, docs/sweeps.md) applied to the
epochs its live trials reported since the last decision round, and the reason a pruned
trial shows.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.db.models import Job, Sweep, SweepTrial
from service.states import TrialState

if TYPE_CHECKING:
    from service.services.sweep_search import Search


@dataclass
class Reported:
    """A live trial in a decision round: its job, the objective by epoch as the job reported
    it, the epochs new (or changed) since the last round, and the state its job says."""

    trial: SweepTrial
    job: Job
    points: dict[int, float]
    new_epochs: list[int]
    state: TrialState


class _Judge:
    """The rule over the sweep's study, rebuilt from the tables once per round when needed."""

    def __init__(self, sweep: Sweep, trials: list[SweepTrial]) -> None:
        self.sweep, self.trials = sweep, trials
        self.search: Search | None = None

    def step(self, trial: SweepTrial, epoch: int, value: float, *, act: bool) -> bool:
        """Feed one new epoch of the trial to the rule; whether it is pruned there, if ``act``
        (a live job). Every epoch goes through the rule, a finished trial's too: the rule
        records on each trial what it reached (ASHA's rungs), which later trials are judged by."""
        if self.search is None:
            # Optuna is imported only when a sweep decides.
            from service.services.sweep_search import rebuild

            self.search = rebuild(self.sweep, self.trials, self.sweep.trials_created)
        pruned, trial.system_attrs = self.search.judge(trial, epoch, value)
        return pruned and act


def pruned_epochs(sweep: Sweep, trials: list[SweepTrial], reported: list[Reported]) -> dict[str, int]:
    """The epoch at which the rule prunes each trial it prunes, by the trial's id.

    The epochs reported since the last round arrived together as far as the sweep can tell:
    they are judged epoch by epoch and, within an epoch, best value first. So of k trials
    reaching a rung at once only those in the rule's top share go on, as if they had been
    judged side by side, not the first few by trial number (an asynchronous rule promotes
    whoever reaches a rung first while it stands alone)."""
    sign = -1.0 if sweep.spec["objective"]["goal"] == "maximize" else 1.0
    arrivals = sorted(
        (epoch, sign * one.points[epoch], one.trial.number, i)
        for i, one in enumerate(reported)
        for epoch in one.new_epochs
    )
    judge = _Judge(sweep, trials)
    pruned_at: dict[str, int] = {}
    for epoch, _value, _number, i in arrivals:
        one = reported[i]
        if one.trial.id in pruned_at:
            continue
        if judge.step(one.trial, epoch, one.points[epoch], act=one.state is TrialState.RUNNING):
            pruned_at[one.trial.id] = epoch
    return pruned_at


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def prune_reason(sweep: Sweep, trials: list[SweepTrial], trial: SweepTrial, epoch: int, value: float) -> str:
    """What the rule says of the trial it pruned at ``epoch``, where its objective was ``value``."""
    spec = sweep.spec
    rule = spec["early_stopping"]
    metric = spec["objective"]["metric"]
    side = "below" if spec["objective"]["goal"] == "maximize" else "above"
    if rule["type"] == "asha":
        factor = rule["reduction_factor"]
        share = {2: "half", 3: "third", 4: "quarter"}.get(factor, f"1/{factor}")
        return f"pruned by ASHA at epoch {epoch}: {metric} {_fmt(value)} {side} the rung's top {share}"
    others = [t.steps()[epoch] for t in trials if t.id != trial.id and epoch in t.steps()]
    median = statistics.median(others) if others else float("nan")
    return (
        f"pruned by the median rule at epoch {epoch}: {metric} {_fmt(value)} {side} the median "
        f"{_fmt(median)} of the other trials at that epoch"
    )

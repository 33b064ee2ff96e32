"""Sweeps and their trials as users see them (``GET /v1/sweeps``, docs/sweeps.md): each
trial with its job's status, the counts by state, the best trial and the epochs run."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Job, Sweep, SweepTrial
from service.schemas.sweeps import SweepPublic, TrialPublic
from service.states import TrialState


def sweeps_public(session: Session, sweeps: list[Sweep], *, detail: bool) -> list[SweepPublic]:
    """The sweeps as users see them; ``detail`` lists every trial."""
    by_sweep = _trials(session, [s.id for s in sweeps])
    return [_sweep_public(sweep, by_sweep[sweep.id], detail=detail) for sweep in sweeps]


def _trials(session: Session, ids: list[str]) -> dict[str, list[TrialPublic]]:
    """The trials of each sweep, by trial number, with their jobs' status."""
    by_sweep: dict[str, list[TrialPublic]] = {i: [] for i in ids}
    if not ids:
        return by_sweep
    rows = session.execute(
        select(SweepTrial, Job.status)
        .join(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id.in_(ids))
        .order_by(SweepTrial.sweep_id, SweepTrial.number)
    ).all()
    for trial, job_status in rows:
        by_sweep[trial.sweep_id].append(_trial_public(trial, job_status))
    return by_sweep


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


def _best(trials: list[TrialPublic], goal: str) -> TrialPublic | None:
    """The completed trial with the best value (the earliest of equals)."""
    scored = [t for t in trials if t.value is not None and t.state == TrialState.COMPLETED.value]
    if not scored:
        return None
    pick = max if goal == "maximize" else min
    return pick(scored, key=lambda t: (t.value, -t.number))


def _counts(trials: list[TrialPublic]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state] = counts.get(t.state, 0) + 1
    return counts


def _sweep_public(sweep: Sweep, trials: list[TrialPublic], *, detail: bool) -> SweepPublic:
    spec = sweep.spec
    return SweepPublic(
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
        trial_counts=_counts(trials),
        best_trial=_best(trials, spec["objective"]["goal"]),
        trials=trials if detail else None,
        epochs_run=sum(t.epochs for t in trials),
        created_at=sweep.created_at,
        updated_at=sweep.updated_at,
        finished_at=sweep.finished_at,
    )

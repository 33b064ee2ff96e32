"""A sweep's decision rounds (docs/sweeps.md, "Where decisions are taken").

The search library keeps no state of its own. Every decision rebuilds an in-memory Optuna
study from torchyard's tables (``sweeps``, ``sweep_trials``: each trial's parameters, state,
per-epoch objective values and the attributes the sampler and the pruner keep on it), asks
or prunes, and writes what changed back in the same transaction, under the sweep's row
lock. So an API restart, a second replica or a database outage loses no decision, and a
trial number is given once: the trial's row and its job are committed together, or not at
all.

A round (:func:`drive_sweep`) records what each live trial's job reported (pruning it if
the early-stopping rule says so, :mod:`sweep_judge`), queues new trials while the sweep has
room for them (:mod:`sweep_trials`) and ends the sweep after its last trial. Every API
replica's reaper runs :func:`drive` on each pass; the submission queues the first trials.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job, Metric, Sweep, SweepTrial
from service.db.types import utcnow
from service.services.jobs import request_cancel
from service.services.metric_points import not_superseded
from service.services.sweep_judge import Reported, prune_reason, pruned_epochs
from service.services.sweep_space import target_trials
from service.services.sweep_trials import FINAL_TRIALS, create_trials, is_live
from service.services.sweep_views import sweeps_public
from service.services.webhooks import emit as emit_webhook
from service.states import FINAL_STATUSES, JobStatus, SweepStatus, TrialState
from torchyard.contract.errors import TorchyardError

log = logging.getLogger(__name__)

# A trial's state by its job's status.
_BY_JOB_STATUS = {
    JobStatus.QUEUED: TrialState.QUEUED,
    JobStatus.SCHEDULED: TrialState.QUEUED,
    JobStatus.RUNNING: TrialState.RUNNING,
    JobStatus.CANCELLING: TrialState.RUNNING,
    JobStatus.SUCCEEDED: TrialState.COMPLETED,
    JobStatus.FAILED: TrialState.FAILED,
}


@dataclass
class DriveResult:
    created: list[str] = field(default_factory=list)  # job ids queued
    pruned: list[str] = field(default_factory=list)
    finished: bool = False


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
            _fail(db, sweep_id, exc)
            continue
        except Exception:
            # Anything else (the database unreachable) is retried on the next pass; one
            # sweep must not hold the others up.
            log.exception("sweep %s: decision round failed", sweep_id)
            continue
        total.created += one.created
        total.pruned += one.pruned
    return total


def _fail(db: Database, sweep_id: str, exc: TorchyardError) -> None:
    with db.transaction() as session:
        sweep = lock_sweep(session, sweep_id)
        if sweep is not None and sweep.status == SweepStatus.RUNNING.value:
            number = sweep.trials_created
            stop(session, sweep, SweepStatus.FAILED, f"trial {number} could not be queued: {exc.message}")
    log.warning("sweep %s failed: its next trial could not be queued: %s", sweep_id, exc.message)


def drive_sweep(session: Session, settings: Settings, sweep_id: str) -> DriveResult:
    """One decision round for a running sweep, under its row lock; the caller commits."""
    result = DriveResult()
    sweep = lock_sweep(session, sweep_id)
    if sweep is None or sweep.status != SweepStatus.RUNNING.value:
        return result
    trials = list(session.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep.id)))
    best_before = _best_trial(sweep, trials)
    result.pruned = _update_trials(session, sweep, trials)
    best = _best_trial(sweep, trials)
    if best is not None and best != best_before:
        emit_sweep_event(session, sweep, "sweep.best_changed")
    result.created = create_trials(session, settings, sweep, trials)
    result.finished = _settle(session, sweep, trials)
    if result.created or result.pruned:
        sweep.updated_at = utcnow()
    return result


def lock_sweep(session: Session, sweep_id: str) -> Sweep | None:
    return session.scalars(select(Sweep).where(Sweep.id == sweep_id).with_for_update()).first()


def stop(session: Session, sweep: Sweep, status: SweepStatus, reason: str) -> None:
    """End the sweep (its row held) with ``status``; every live trial's job is cancelled."""
    trials = list(session.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep.id)))
    now = utcnow()
    for trial in trials:
        if not is_live(trial):
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
    emit_sweep_event(session, sweep, "sweep.ended")


def emit_sweep_event(session: Session, sweep: Sweep, event: str) -> None:
    """Record ``event`` of ``sweep`` for its owner's webhooks and its team's (docs/webhooks.md),
    in the caller's transaction."""
    emit_webhook(
        session,
        sweep.owner_id,
        event,
        "sweep",
        lambda: sweeps_public(session, [sweep], detail=False)[0].model_dump(mode="json"),
        team_id=sweep.team_id,
    )


def _best_trial(sweep: Sweep, trials: list[SweepTrial]) -> tuple[float, int] | None:
    """The best completed trial's value and number (as ``best_trial`` shows it), or None."""
    scored = [
        (t.value, t.number) for t in trials if t.value is not None and t.state == TrialState.COMPLETED.value
    ]
    if not scored:
        return None
    pick = max if sweep.spec["objective"]["goal"] == "maximize" else min
    return pick(scored, key=lambda s: (s[0], -s[1]))


# --- what the live trials reported -------------------------------------------------------------


def _update_trials(session: Session, sweep: Sweep, trials: list[SweepTrial]) -> list[str]:
    """Each live trial's new objective values (pruning it if the rule says so) and final
    state; the ids of the jobs pruned."""
    spec = sweep.spec
    metric, goal = spec["objective"]["metric"], spec["objective"]["goal"]
    live = [t for t in trials if is_live(t)]
    if not live:
        return []
    jobs = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_([t.job_id for t in live])))}
    reported = [_reported(session, trial, jobs[trial.job_id], metric) for trial in live]
    pruned_at = pruned_epochs(sweep, trials, reported) if spec.get("early_stopping") else {}
    pruned = []
    for one in reported:
        at = pruned_at.get(one.trial.id)
        if at is None:
            _record(one, metric, goal)
        else:
            _prune(session, sweep, trials, one, at)
            pruned.append(one.job.id)
    return pruned


def _reported(session: Session, trial: SweepTrial, job: Job, metric: str) -> Reported:
    points = _objective_points(session, job.id, metric)
    known = trial.steps()
    new_epochs = [e for e in sorted(points) if e not in known or known[e] != points[e]]
    return Reported(
        trial, job, points, new_epochs, _BY_JOB_STATUS.get(JobStatus(job.status), TrialState.CANCELLED)
    )


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


def _record(one: Reported, metric: str, goal: str) -> None:
    """The trial's objective values so far, and its state as its job's says."""
    trial, points = one.trial, one.points
    trial.intermediate = {str(e): v for e, v in sorted(points.items())}
    trial.epochs = len(points)
    trial.value = _best(points, goal)
    _finish(trial, one.job, one.state, metric)


def _prune(session: Session, sweep: Sweep, trials: list[SweepTrial], one: Reported, epoch: int) -> None:
    """The trial pruned at ``epoch`` (its values after that left out), and its job cancelled."""
    trial, points = one.trial, one.points
    trial.intermediate = {str(e): v for e, v in points.items() if e <= epoch}
    reason = prune_reason(sweep, trials, trial, epoch, points[epoch])
    trial.state = TrialState.PRUNED.value
    trial.reason = reason
    trial.epochs = len(trial.intermediate)
    trial.value = _best(trial.steps(), sweep.spec["objective"]["goal"])
    trial.finished_at = utcnow()
    locked = session.scalars(select(Job).where(Job.id == one.job.id).with_for_update()).one()
    request_cancel(session, locked, reason)
    log.info("sweep trial %s (job %s): %s", trial.number, one.job.id, reason)


def _finish(trial: SweepTrial, job: Job, state: TrialState, metric: str) -> None:
    if state is TrialState.COMPLETED and trial.value is None:
        state = TrialState.FAILED
        trial.reason = f"the job succeeded without reporting {metric}"
    elif state is TrialState.FAILED:
        trial.reason = f"{job.failure_code}: {job.failure_message}"
    elif state is TrialState.CANCELLED:
        trial.reason = job.cancel_reason or "cancelled"
    trial.state = state.value
    if state in FINAL_TRIALS:
        trial.finished_at = job.finished_at or utcnow()


def _settle(session: Session, sweep: Sweep, trials: list[SweepTrial]) -> bool:
    """The sweep ends after its last trial, once every trial's job has ended (a pruned
    trial's job may still be stopping its ranks); whether it ended."""
    if sweep.trials_created < target_trials(sweep) or any(is_live(t) for t in trials):
        return False
    stopping = session.scalar(
        select(func.count()).where(
            Job.sweep_id == sweep.id, Job.status.not_in([s.value for s in FINAL_STATUSES])
        )
    )
    if stopping:
        return False
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
    emit_sweep_event(session, sweep, "sweep.ended")
    return True

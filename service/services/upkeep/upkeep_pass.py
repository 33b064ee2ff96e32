"""One upkeep pass: every duty of :mod:`service.services.upkeep`, in order (synchronous;
safe to run on several replicas at once)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

from service.config import Settings
from service.db.engine import Database
from service.db.types import utcnow
from service.services import checkpoints, direct_uploads, job_delete, metrics, sweep_rounds, team_usage
from service.services.scheduler import has_queued_jobs, run_pass
from service.services.upkeep.cancellations import settle_cancellations
from service.services.upkeep.leases import expired_by_job, lose_expired_leases
from service.services.upkeep.listening import ListeningClock
from service.services.upkeep.nodes import lose_silent_nodes, silent_nodes
from service.services.upkeep.timeouts import time_out_overruns

# Object storage is listed at most this often (a LIST per pass would cost requests; files are cheap).
_OBJECT_SWEEP_S = 60.0
_last_object_sweep = 0.0


def _sweep_storage(db: Database, settings: Settings) -> None:
    """Remove ended jobs' checkpoints, and direct uploads left unfinished (docs/storage.md)."""
    global _last_object_sweep
    store = checkpoints.CheckpointStore.of(settings)
    if store.storage.direct:
        if time.monotonic() - _last_object_sweep < _OBJECT_SWEEP_S:
            return
        _last_object_sweep = time.monotonic()
        direct_uploads.drop_abandoned(db, settings)
    checkpoints.remove_ended_jobs_files(db, store)


# Teams' usage is sampled once a minute (docs/teams.md); a replica that finds another's
# sample of the minute writes none.
_TEAM_USAGE_S = 60.0
_last_team_usage = 0.0


def _sample_team_usage(db: Database) -> None:
    global _last_team_usage
    if _last_team_usage and time.monotonic() - _last_team_usage < _TEAM_USAGE_S:
        return
    _last_team_usage = time.monotonic()
    team_usage.sample(db)


@dataclass
class UpkeepResult:
    lost_placements: int = 0
    lost_nodes: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)
    scheduled: list[str] = field(default_factory=list)
    placed_nodes: list[str] = field(default_factory=list)
    trials_queued: list[str] = field(default_factory=list)
    trials_pruned: list[str] = field(default_factory=list)


def run_upkeep_pass(
    db: Database, settings: Settings, listening: ListeningClock | None = None, *, schedule: bool = True
) -> UpkeepResult:
    """One pass of the reaper.

    With ``listening``, leases and nodes are judged only once this replica has heard the
    nodes for a full lease period (:mod:`service.services.upkeep.listening`). ``schedule``:
    run the scheduling pass here (else the caller asks its scheduling loop for one)."""
    try:
        with metrics.UPKEEP_PASS.time():
            return _upkeep_pass(db, settings, listening, schedule)
    except Exception:
        metrics.UPKEEP_PASS_FAILURES.inc()
        raise


def _upkeep_pass(
    db: Database, settings: Settings, listening: ListeningClock | None, schedule: bool
) -> UpkeepResult:
    result = UpkeepResult()
    now = utcnow()
    if listening is None or listening.grace_left(settings.lease_timeout_s, now) <= 0:
        silent_cutoff = now - timedelta(seconds=settings.lease_timeout_s)
        with db.read_session() as session:
            expired = expired_by_job(session, settings, now)
            silent = silent_nodes(session, silent_cutoff)
        # Silent nodes first: a job requeued by a lost lease must not be placed on them again.
        # A placement whose lease had already run out is lost for that reason (a placement
        # never claimed says so), even when its node falls silent in the same pass.
        known = {pid: message for _, messages in expired.values() for pid, message in messages.items()}
        result.lost_nodes = lose_silent_nodes(db, settings, silent, silent_cutoff, known)
        result.lost_placements = lose_expired_leases(db, expired)
    result.cancelled = settle_cancellations(db)
    result.timed_out = time_out_overruns(db, now)
    _sweep_storage(db, settings)
    _sample_team_usage(db)
    job_delete.apply_retention(db, settings)
    decided = sweep_rounds.drive(db, settings)
    result.trials_queued = decided.created
    result.trials_pruned = decided.pruned
    if schedule and has_queued_jobs(db):
        placed = run_pass(db, settings)
        result.scheduled, result.placed_nodes = placed.scheduled, placed.placed_nodes
    return result

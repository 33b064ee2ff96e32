"""The replica's Prometheus instruments (docs/operations.md, "Prometheus and Grafana"): the
counters and histograms updated where their events happen, and the label helpers that keep
every label set bounded (never a job id, a node name or a raw path).

Events written inside a database transaction (an attempt ended, a job placed) are counted
only once that transaction commits: :func:`count_on_commit` keeps them in the session until
its commit, and a rollback drops them. The gauges read from the database at scrape time are
in :mod:`service.services.metrics_collector`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from prometheus_client import Counter, Histogram, disable_created_metrics
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session, object_session

from service.db.models import JobEvent
from service.states import EngineName, JobStatus
from torchyard.contract.errors import ERRORS_BY_CODE

log = logging.getLogger(__name__)

# No ``_created`` series beside each counter and histogram: they would double the series and
# say only when this process started, which process_start_time_seconds says once.
disable_created_metrics()

# The team label of every job until jobs have a team (see job_team_label).
DEFAULT_TEAM = "default"
# The pool of a node whose engine names none (the agents engine's only pool).
DEFAULT_POOL = "default"
# A label value longer than this is cut (an engine's partition or node group names).
MAX_LABEL_LENGTH = 64
# The route label of a request no route matched (scanners' paths stay out of the labels).
UNMATCHED_ROUTE = "unmatched"
# The failure-code label of an attempt that ended without a failure (succeeded, cancelled).
NO_FAILURE = "none"
# A failure code torchyard does not define (a report's free text never becomes a label).
OTHER_FAILURE = "other"

# Seconds: from a tenth of a second (a job placed on the next pass) to a day in the queue.
QUEUE_WAIT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 12 * 3600, 86400)
# Seconds: a pass takes milliseconds; a slow database makes it seconds.
PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Seconds: requests take milliseconds; uploads, downloads, parked claims and streams longer.
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

QUEUE_WAIT = Histogram(
    "torchyard_queue_wait_seconds",
    "Time a job waited in the queue before it was placed: from its submission, or from its "
    "last return to the queue (a restart, a preemption), to its placement.",
    buckets=QUEUE_WAIT_BUCKETS,
)
ATTEMPTS_ENDED = Counter(
    "torchyard_attempts_ended",
    "Attempts that ended, by how they ended and the failure code that ended them "
    "('none' without a failure, 'other' for a code torchyard does not define).",
    ["outcome", "failure_code"],
)
SCHEDULING_PASS = Histogram(
    "torchyard_scheduling_pass_seconds",
    "Duration of this replica's scheduling passes (the engine's reconciler included).",
    buckets=PASS_BUCKETS,
)
SCHEDULING_PASS_FAILURES = Counter(
    "torchyard_scheduling_pass_failures",
    "Scheduling passes of this replica that failed (the database unreachable, or a bug).",
)
UPKEEP_PASS = Histogram(
    "torchyard_upkeep_pass_seconds",
    "Duration of this replica's upkeep passes (the reaper: leases, lost nodes, cancellations, "
    "timeouts, retention, sweeps).",
    buckets=PASS_BUCKETS,
)
UPKEEP_PASS_FAILURES = Counter(
    "torchyard_upkeep_pass_failures",
    "Upkeep passes of this replica that failed (the database unreachable, or a bug).",
)
REQUEST_DURATION = Histogram(
    "torchyard_http_request_duration_seconds",
    "API requests this replica answered, by method, route template and status, until the "
    "response's last byte (streams and parked claims: their whole duration).",
    ["method", "route", "status"],
    buckets=REQUEST_BUCKETS,
)

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def bounded(value: str | None, default: str) -> str:
    """A label value: ``default`` when empty, cut to :data:`MAX_LABEL_LENGTH` characters."""
    if not value:
        return default
    return value[:MAX_LABEL_LENGTH]


def job_team_label(team: str | None = None) -> str:
    """The ``team`` label of a job's series: its team's name (docs/teams.md); a job older than
    teams counts under "default". Team names are few and chosen by admins: a bounded set."""
    return bounded(team, DEFAULT_TEAM)


def node_pool(engine: str, info: Mapping[str, Any] | None) -> str:
    """The pool a node's units count in: what its engine says (a Slurm node's partitions,
    comma-joined; ``info["pool"]`` where an engine names one, such as a Kubernetes node
    group), else "default" (the agents engine has one pool)."""
    info = info or {}
    pool = info.get("pool")
    if isinstance(pool, str) and pool:
        return bounded(pool, DEFAULT_POOL)
    if engine == EngineName.SLURM:
        partitions = info.get("partitions")
        if isinstance(partitions, list) and partitions:
            return bounded(",".join(sorted(str(p) for p in partitions)), DEFAULT_POOL)
    return DEFAULT_POOL


def failure_code_label(code: str | None) -> str:
    """The ``failure_code`` label: a code torchyard defines, "none", or "other"."""
    if not code:
        return NO_FAILURE
    return code if code in ERRORS_BY_CODE else OTHER_FAILURE


def method_label(method: str) -> str:
    return method if method in _METHODS else "other"


# --- counted on commit ------------------------------------------------------------------------

# Session.info keys: what to count once the transaction commits.
_PENDING = "torchyard.metrics.pending"
_READY = "torchyard.metrics.ready"
_PLACED = "torchyard.metrics.placed"

Prepare = Callable[[Session], Callable[[], None] | None]


def count_on_commit(session: Session, prepare: Prepare) -> None:
    """Count something when ``session``'s transaction commits. ``prepare`` runs just before
    the commit (it may read the session's rows) and returns what to do once it committed."""
    session.info.setdefault(_PENDING, []).append(prepare)


def attempt_ended(attempt: Any, outcome: str) -> None:
    """An attempt moved to the final status ``outcome`` (counted when its write commits, with
    the failure code it ended with)."""
    session = object_session(attempt)

    def prepare(_session: Session | None = None) -> Callable[[], None]:
        labels = (outcome, failure_code_label(attempt.failure_code))
        return lambda: ATTEMPTS_ENDED.labels(*labels).inc()

    if session is None:
        prepare()()
    else:
        count_on_commit(session, prepare)


def job_placed(session: Session, job_id: str, at: datetime) -> None:
    """A queued job was placed at ``at``: its queue wait is observed when the write commits,
    from its latest return to the queue (the jobs placed in one transaction read in one
    query)."""
    placed: dict[str, datetime] | None = session.info.get(_PLACED)
    if placed is None:
        placed = session.info[_PLACED] = {}
        count_on_commit(session, _queue_waits)
    placed[job_id] = at


def _queue_waits(session: Session) -> Callable[[], None] | None:
    placed: dict[str, datetime] = session.info.pop(_PLACED, {})
    if not placed:
        return None
    rows = session.execute(
        select(JobEvent.job_id, func.max(JobEvent.at))
        .where(JobEvent.job_id.in_(list(placed)), JobEvent.status == JobStatus.QUEUED)
        .group_by(JobEvent.job_id)
    )
    waits = [max((placed[job_id] - queued_at).total_seconds(), 0.0) for job_id, queued_at in rows]

    def observe() -> None:
        for wait in waits:
            QUEUE_WAIT.observe(wait)

    return observe


@event.listens_for(Session, "before_commit")
def _prepare(session: Session) -> None:
    if session.in_nested_transaction():
        return  # a savepoint: counted with the transaction around it
    pending: list[Prepare] = session.info.pop(_PENDING, [])
    if not pending:
        return
    ready = session.info.setdefault(_READY, [])
    for prepare in pending:
        try:
            action = prepare(session)
        except Exception:  # a metric never fails a commit
            log.exception("a metric could not be prepared")
            continue
        if action is not None:
            ready.append(action)


@event.listens_for(Session, "after_commit")
def _apply(session: Session) -> None:
    for action in session.info.pop(_READY, []):
        action()


@event.listens_for(Session, "after_rollback")
def _drop(session: Session) -> None:
    for key in (_PENDING, _READY, _PLACED):
        session.info.pop(key, None)

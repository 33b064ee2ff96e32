"""The reaper: what happens when nobody reports.

Run by every API replica, every ``reaper_interval_s``:

1. placements whose lease expired are done; their live attempt fails with
   ``WorkerLostError`` naming the node ("node X stopped heartbeating"), and the job
   is restarted (back to ``queued``) or fails, as ``resources.max_restarts`` says;
2. ready nodes silent for ``lease_timeout_s`` are ``lost``, and their placements go
   the same way;
3. a cancelling job whose remaining placements were never claimed (no process to
   stop) or are all done becomes ``cancelled``;
4. a running job past its ``resources.max_runtime_s`` fails with ``TimeoutError``;
   its nodes stop their ranks at their next heartbeat;
5. every running sweep takes its decisions (prunes trials, queues the next ones,
   ends when its last trial does; see :mod:`service.services.sweep_rounds`);
6. a scheduling pass runs when jobs are queued (asked of the replica's scheduling loop,
   :mod:`service.services.scheduler_loop`, when the reaper runs inside the API).

Each job is handled in a transaction of its own under its row lock and re-checked
there, so replicas doing the same sweep at the same time are harmless: the second
one finds nothing left to do.

Steps 1 and 2 judge silence, and silence means something only while somebody was
listening. Each replica keeps a :class:`ListeningClock`: the moment since when it has
been able to hear the nodes (its start, and again the end of every database outage it
saw). Until a full ``lease_timeout_s`` has passed on that clock, nothing is declared
lost: an API that was down (restarted, upgraded, its database unreachable) for longer
than the lease timeout first gives every node a full lease period to heartbeat again.
On PostgreSQL, the clock is the cluster's (:mod:`service.services.replicas`): every
replica writes since when it has been listening to ``api_replicas`` on each pass, and
silence is judged from the latest of those moments; a replica that vanished (killed,
stopped, cut off) and was not replaced yet by a replica started since keeps every
other replica from declaring anything lost, for at most ``replica_memory_s``: the nodes
that talked to it could not be heard.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.config import Settings
from service.db.engine import Database, is_unavailable
from service.db.models import Job, Node, Placement, utcnow
from service.services import checkpoints, job_delete, sweep_rounds
from service.services.attempt_outcomes import finish_cancellation
from service.services.lost_placements import lose_placements
from service.services.node_timing import NodeTiming
from service.services.replicas import ClusterHearing, ReplicaRow
from service.services.scheduler import has_queued_jobs, is_postgres, run_pass
from service.services.scheduler_loop import SchedulerLoop
from service.services.transitions import set_node_status, set_placement_status
from service.services.upkeep.timeouts import overrun_limit_s, time_out
from service.services.wakeup import Wakeup
from service.states import ENGINE_AGENTS, JobStatus, NodeStatus, PlacementStatus

log = logging.getLogger(__name__)


class ListeningClock:
    """Since when this replica has been able to hear the nodes without a break."""

    def __init__(self, since: datetime | None = None) -> None:
        self._lock = threading.Lock()
        self._since = since or utcnow()
        self._deaf = False
        # On PostgreSQL, what every replica's row says (see service.services.replicas).
        self._cluster: ClusterHearing | None = None

    @property
    def since(self) -> datetime:
        with self._lock:
            return self._since

    def lost_hearing(self) -> None:
        """The database could not be reached: heartbeats may be going unrecorded."""
        with self._lock:
            self._deaf = True

    def heard(self) -> None:
        """The database answered again: start a fresh grace period if it had not."""
        with self._lock:
            if self._deaf:
                self._deaf = False
                self._since = utcnow()
                log.warning(
                    "the database is reachable again: nodes get a full lease period before being lost"
                )

    def cluster_heard(self, hearing: ClusterHearing) -> None:
        """The cluster of replicas' clock, read on this reaper pass."""
        with self._lock:
            if hearing.deaf and (self._cluster is None or not self._cluster.deaf):
                log.warning(
                    "an API replica was last seen at %s and has not been replaced: "
                    "no node is declared lost until one starts",
                    hearing.vanished,
                )
            self._cluster = hearing

    def grace_left(self, lease_timeout_s: float, now: datetime) -> float:
        """Seconds until silence can be judged (0 once a full lease period was heard, by this
        replica and, on PostgreSQL, by every replica of the cluster)."""
        with self._lock:
            if self._deaf or (self._cluster is not None and self._cluster.deaf):
                return lease_timeout_s
            since = self._since
            if self._cluster is not None:
                since = max(since, self._cluster.since)
            return max(0.0, lease_timeout_s - (now - since).total_seconds())


@dataclass
class SweepResult:
    lost_placements: int = 0
    lost_nodes: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)
    scheduled: list[str] = field(default_factory=list)
    placed_nodes: list[str] = field(default_factory=list)
    trials_queued: list[str] = field(default_factory=list)
    trials_pruned: list[str] = field(default_factory=list)


def _judged_with_its_node(settings: Settings, status: str, expires: datetime, node: Node) -> bool:
    """Whether a claimed placement's expired lease waits for its node to be judged.

    The node's last heartbeat came within one heartbeat interval of the lease's last
    renewal: it can be one the agent sent before it claimed the placement (heartbeats and
    claims travel side by side), so it says nothing of the agent having let the lease go.
    Such a node is going silent with its lease, and is lost with it at most one interval
    later; losing the lease first would put the job back to a node that is about to be
    lost, and spend a second restart there."""
    if status != PlacementStatus.RUNNING or node.engine != ENGINE_AGENTS:
        return False
    if node.status != NodeStatus.READY:
        return False
    renewed = expires - timedelta(seconds=settings.lease_timeout_s)
    return node.last_heartbeat_at < renewed + timedelta(seconds=settings.heartbeat_interval_s)


def _expired_by_job(
    session: Session, settings: Settings, now: datetime
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Placements whose lease ran out, by job, with the failure message naming each node
    (less those judged with their node: :func:`_judged_with_its_node`)."""
    rows = session.execute(
        select(Placement.job_id, Placement.id, Placement.status, Placement.lease_expires_at, Node)
        .join(Node, Node.id == Placement.node_id)
        .where(Placement.status != PlacementStatus.DONE, Placement.lease_expires_at < now)
    ).all()
    by_job: dict[str, tuple[list[str], dict[str, str]]] = {}
    for job_id, placement_id, status, expires, node in rows:
        if _judged_with_its_node(settings, status, expires, node):
            continue
        node_name = node.name
        ids, messages = by_job.setdefault(job_id, ([], {}))
        ids.append(placement_id)
        messages[placement_id] = (
            f"node {node_name} did not claim its placement within {settings.lease_timeout_s:g} s"
            if status == PlacementStatus.ASSIGNED
            else f"node {node_name} stopped heartbeating"
        )
    return by_job


def _mark_lost(session: Session, node_id: str, cutoff: datetime) -> str | None:
    stmt = select(Node).where(
        Node.id == node_id, Node.status == NodeStatus.READY, Node.last_heartbeat_at < cutoff
    )
    if is_postgres(session):
        stmt = stmt.with_for_update(skip_locked=True)
    node = session.scalars(stmt).first()
    if node is None:
        return None
    set_node_status(node, NodeStatus.LOST)
    return node.name


def sweep(
    db: Database, settings: Settings, listening: ListeningClock | None = None, *, schedule: bool = True
) -> SweepResult:
    """One reaper pass (synchronous; safe to run on several replicas at once).

    With ``listening``, leases and nodes are judged only once this replica has heard
    the nodes for a full lease period (see the module's docstring). ``schedule``: run the
    scheduling pass here (else the caller asks its scheduling loop for one)."""
    result = SweepResult()
    now = utcnow()
    if listening is None or listening.grace_left(settings.lease_timeout_s, now) <= 0:
        silent_cutoff = now - timedelta(seconds=settings.lease_timeout_s)
        with db.read_session() as session:
            expired = _expired_by_job(session, settings, now)
            silent_nodes = list(
                session.scalars(
                    select(Node.id).where(
                        # An engine's nodes are kept by its inventory, not by heartbeats.
                        Node.engine == ENGINE_AGENTS,
                        Node.status == NodeStatus.READY,
                        Node.last_heartbeat_at < silent_cutoff,
                    )
                )
            )
        # Silent nodes first: a job requeued by a lost lease must not be placed on them again.
        _lose_silent_nodes(db, settings, silent_nodes, silent_cutoff, expired, result)
        _lose_expired_leases(db, expired, result)
    _settle_cancellations(db, result)
    _time_out_overruns(db, now, result)
    checkpoints.remove_ended_jobs_files(db, checkpoints.CheckpointStore(settings.data_dir))
    job_delete.apply_retention(db, settings)
    decided = sweep_rounds.drive(db, settings)
    result.trials_queued = decided.created
    result.trials_pruned = decided.pruned
    if schedule and has_queued_jobs(db):
        placed = run_pass(db, settings)
        result.scheduled, result.placed_nodes = placed.scheduled, placed.placed_nodes
    return result


def _lose_expired_leases(
    db: Database, expired: dict[str, tuple[list[str], dict[str, str]]], result: SweepResult
) -> None:
    for job_id, (placement_ids, messages) in expired.items():
        with db.transaction() as session:
            if lose_placements(session, job_id, placement_ids, messages):
                result.lost_placements += len(placement_ids)


def _lose_silent_nodes(
    db: Database,
    settings: Settings,
    node_ids: list[str],
    cutoff: datetime,
    expired: dict[str, tuple[list[str], dict[str, str]]],
    result: SweepResult,
) -> None:
    # A placement whose lease had already run out is lost for that reason (a placement
    # never claimed says so), even when its node falls silent in the same pass (a
    # replica that paused past both deadlines must not blur them).
    known = {pid: message for _, messages in expired.values() for pid, message in messages.items()}
    for node_id in node_ids:
        with db.transaction() as session:
            name = _mark_lost(session, node_id, cutoff)
        if name is None:
            continue
        result.lost_nodes.append(name)
        log.warning("node %s is lost: no heartbeat for %.1f s", name, settings.lease_timeout_s)
        lose_node_placements(db, node_id, f"node {name} stopped heartbeating", known)


def _settle_cancellations(db: Database, result: SweepResult) -> None:
    """Cancellations with nothing left to stop."""
    with db.read_session() as session:
        cancelling = list(session.scalars(select(Job.id).where(Job.status == JobStatus.CANCELLING)))
    for job_id in cancelling:
        with db.transaction() as session:
            if _settle_cancel(session, job_id):
                result.cancelled.append(job_id)


def _time_out_overruns(db: Database, now: datetime, result: SweepResult) -> None:
    """Running jobs past their runtime limit."""
    with db.read_session() as session:
        running = session.execute(
            select(Job.id, Job.started_at, Job.spec).where(Job.status == JobStatus.RUNNING)
        ).all()
    for job_id, started_at, spec in running:
        limit = overrun_limit_s(spec, started_at, now)
        if limit is None:
            continue  # checked before taking the write lock; time_out checks again under it
        with db.transaction() as session:
            if time_out(session, job_id, now):
                result.timed_out.append(job_id)
                log.warning("job %s timed out after %s s", job_id, limit)


def unfinished_placements(
    session: Session, node_id: str, *, claimed_only: bool = False
) -> list[tuple[str, str]]:
    """(job id, placement id) of every placement of the node that is not done (with
    ``claimed_only``, of those an agent has claimed: the ones with processes behind them)."""
    wanted = (
        [PlacementStatus.RUNNING] if claimed_only else [PlacementStatus.ASSIGNED, PlacementStatus.RUNNING]
    )
    rows = session.execute(
        select(Placement.job_id, Placement.id).where(
            Placement.node_id == node_id, Placement.status.in_(wanted)
        )
    ).all()
    return [(job_id, placement_id) for job_id, placement_id in rows]


def lose_node_placements(
    db: Database,
    node_id: str,
    message: str,
    known: dict[str, str] | None = None,
    rows: list[tuple[str, str]] | None = None,
) -> int:
    """Every placement of the node that is not done is lost (its job fails, ``message``
    naming the node): the node went silent, or its agent restarted without its ranks.
    ``known`` gives a placement's own message where it was lost for a reason of its own;
    ``rows`` (from :func:`unfinished_placements`) limits it to the placements read then."""
    if rows is None:
        with db.read_session() as session:
            rows = unfinished_placements(session, node_id)
    by_job: dict[str, list[str]] = {}
    for job_id, placement_id in rows:
        by_job.setdefault(job_id, []).append(placement_id)
    own = known or {}
    for job_id, placement_ids in by_job.items():
        with db.transaction() as session:
            messages = {pid: own.get(pid, message) for pid in placement_ids}
            lose_placements(session, job_id, placement_ids, messages)
    return len(rows)


def _settle_cancel(session: Session, job_id: str) -> bool:
    job = session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()
    if job.status != JobStatus.CANCELLING:
        return False
    now = utcnow()
    for placement in session.scalars(
        select(Placement)
        .where(Placement.job_id == job_id, Placement.status == PlacementStatus.ASSIGNED)
        .order_by(Placement.id)
        .with_for_update()
    ):
        # Never claimed: no process exists to stop.
        set_placement_status(placement, PlacementStatus.DONE, now)
    return finish_cancellation(session, job)


async def run_reaper(
    db: Database,
    settings: Settings,
    wakeup: Wakeup,
    stop: asyncio.Event,
    listening: ListeningClock | None = None,
    scheduling: SchedulerLoop | None = None,
    timing: NodeTiming | None = None,
) -> None:
    """The background loop of one API replica, until ``stop`` is set. With ``scheduling``,
    its scheduling passes are asked of that loop (shared with every other request). With
    ``timing``, it counts the nodes now and then and judges silence by the lease of the
    moment (:mod:`service.services.node_timing`)."""
    listening = listening or ListeningClock()
    # SQLite serves one replica: its own clock is the cluster's.
    replica = None if db.is_sqlite else ReplicaRow()
    while not stop.is_set():
        try:
            await run_in_threadpool(db.ping)
            listening.heard()
            if timing is not None:
                if timing.due():
                    await run_in_threadpool(timing.refresh, db)
                settings = timing.settings()
            if replica is not None:
                hearing = await run_in_threadpool(replica.beat, db, settings, listening.since)
                listening.cluster_heard(hearing)
            result = await run_in_threadpool(
                functools.partial(sweep, db, settings, listening, schedule=scheduling is None)
            )
            if result.placed_nodes:
                wakeup.notify(result.placed_nodes)
            if scheduling is not None and await run_in_threadpool(has_queued_jobs, db):
                scheduling.request()
        except Exception as exc:  # keep the loop alive across database outages
            if is_unavailable(exc):
                listening.lost_hearing()
                log.warning("reaper pass skipped: the database is unreachable (%s)", _first_line(exc))
            else:
                log.exception("reaper pass failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), settings.reaper_interval_s)


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__

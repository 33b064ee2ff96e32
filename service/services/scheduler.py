"""Gang scheduling: queued jobs onto ready nodes, every node of a job at once or none.

A job asking for N nodes × P processes is placed only when N distinct ready nodes
each have P free units (free = the node's units minus the units of its placements
that are not done). Its attempt and all N placements — node rank, units, lease
token and lease expiry — are written in the same transaction that moves the job to
``scheduled``; nothing is ever held for a job that cannot start, so two multi-node
jobs can never each hold half of what they need and wait on each other.

Order and fairness: strict first in, first out within a priority (higher priority
first, then oldest first). The first job that the cluster could run but that does
not fit the free capacity right now blocks every job behind it: nothing is
backfilled past it, so a stream of small jobs cannot starve a large one, which
starts as soon as running attempts release enough units. A job the present cluster
could never run — fewer ready nodes than it needs, or none with enough units,
because the cluster shrank after the job was accepted — does not block the queue;
it waits with its reason until nodes come back.

Concurrency: on PostgreSQL a pass takes a transaction-scoped advisory lock, so the
capacity it reads cannot change under it from another API replica's pass. It reads the
head of the queue from the queue's index without locking it, and locks a job ``FOR UPDATE
SKIP LOCKED`` only to place it (a job being cancelled right now is left for the next
pass); a job that just keeps waiting costs the pass no write. On SQLite the writing session's ``BEGIN IMMEDIATE`` already makes
the pass exclusive.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import random
import secrets
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import bindparam, exists, func, select, text, update
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, Job, Placement
from service.db.types import utcnow
from service.services.cluster import NodeCapacity, ready_capacity
from service.services.drain import preempt_job
from service.services.fair_share import Ledger, Running, load_ledger, reclaim_victims, running_attempts
from service.services.jobs import transition
from service.services.teams import DEFAULT_POOL
from service.services.wakeup import announce_placed
from service.states import AttemptStatus, JobStatus, PlacementStatus

log = logging.getLogger(__name__)

# pg_advisory_xact_lock key that serialises scheduling passes across API replicas.
SCHEDULER_LOCK_KEY = 7345002
# Queued jobs looked at per pass; the rest wait for the next pass.
MAX_JOBS_PER_PASS = 500
# What _try_place answers for a job cancelled since the queue was read.
_GONE = "gone"


class QueuedJob(NamedTuple):
    """What a pass reads of a queued job (plain columns: no ORM object per queued job)."""

    id: str
    name: str
    node_count: int
    process_count_per_node: int
    requeue_reason: str | None
    wait_reason: str | None
    team_id: str | None = None
    priority: int = 0

    @property
    def units(self) -> int:
        return self.node_count * self.process_count_per_node


@dataclass
class PassResult:
    """What one scheduling pass did."""

    scheduled: list[str] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)
    # Ids of the nodes that got placements (their parked claims are woken).
    placed_nodes: list[str] = field(default_factory=list)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def is_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _ports_in_use(session: Session, address: str) -> set[int]:
    """Rendezvous ports of attempts on ``address`` that still have a placement not done."""
    live = exists().where(Placement.attempt_id == Attempt.id, Placement.status != PlacementStatus.DONE)
    return set(session.scalars(select(Attempt.master_port).where(Attempt.master_addr == address, live)))


def pick_port(session: Session, settings: Settings, address: str, taken: dict[str, set[int]]) -> int | None:
    used = _ports_in_use(session, address) | taken.setdefault(address, set())
    # A random free port, not the lowest: a just-finished attempt's port may still be
    # in TIME_WAIT on that host.
    candidates = [p for p in range(settings.master_port_min, settings.master_port_max + 1) if p not in used]
    if not candidates:
        return None
    port = random.choice(candidates)
    taken[address].add(port)
    return port


def _wait_reason(job: QueuedJob, nodes: list[NodeCapacity]) -> tuple[str, bool]:
    """Why ``job`` cannot start now, and whether it could start once capacity frees up."""
    n, p = job.node_count, job.process_count_per_node
    big_enough = sum(1 for c in nodes if c.units >= p)
    if big_enough < n:
        return (
            f"waiting for {_plural(n, 'ready node')} with at least {_plural(p, 'processing unit')}; "
            f"the cluster has {big_enough} now",
            False,
        )
    available = sum(1 for c in nodes if c.free >= p)
    return (f"waiting for {_plural(n, 'node')} with {_plural(p, 'free unit')}; {available} available", True)


@functools.lru_cache(maxsize=4096)
def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _choose(nodes: list[NodeCapacity], n: int, p: int) -> list[NodeCapacity] | None:
    fits = [c for c in nodes if c.free >= p]
    if n > 1:
        # A node known only by a loopback address cannot be reached from another host:
        # never mix it into a multi-node gang (its ranks would wait for a rendezvous
        # that can never happen). Nodes all on loopback share one host and are fine.
        remote = [c for c in fits if not _is_loopback(c.address)]
        local = [c for c in fits if _is_loopback(c.address)]
        fits = remote if len(remote) >= n else local
    if len(fits) < n:
        return None
    # Best fit: fill the nodes with the least room left first, keeping big holes for big jobs.
    fits.sort(key=lambda c: (c.free - p, c.name))
    return fits[:n]


def _place(
    session: Session,
    settings: Settings,
    job: Job,
    chosen: list[NodeCapacity],
    port: int,
    now: datetime,
) -> Attempt:
    expires = now + timedelta(seconds=settings.lease_timeout_s)
    job.attempts_count = (job.attempts_count or 0) + 1
    attempt = Attempt(
        job_id=job.id,
        number=job.attempts_count,
        status=AttemptStatus.SCHEDULED,
        master_addr=chosen[0].address,
        master_port=port,
        created_at=now,
    )
    session.add(attempt)
    session.flush()
    for rank, node in enumerate(chosen):
        session.add(new_placement(attempt, job, node.id, rank, expires, now))
        node.free -= job.process_count_per_node
    names = ", ".join(c.name for c in chosen)
    transition(session, job, JobStatus.SCHEDULED, f"attempt {attempt.number} placed on {names}")
    return attempt


def new_placement(
    attempt: Attempt, job: Job, node_id: str, rank: int, expires: datetime, now: datetime
) -> Placement:
    """Node rank ``rank`` of ``attempt``: assigned, with a fresh lease until ``expires``."""
    return Placement(
        attempt_id=attempt.id,
        job_id=job.id,
        node_id=node_id,
        node_rank=rank,
        units=job.process_count_per_node,
        status=PlacementStatus.ASSIGNED,
        lease_token=secrets.token_urlsafe(32),
        lease_expires_at=expires,
        created_at=now,
    )


def schedule(session: Session, settings: Settings) -> PassResult:
    """One scheduling pass in the caller's write transaction (the caller commits).

    The head of the queue is read as plain rows; only a job being placed is locked and
    loaded whole. Behind the blocker a job's reason depends on its shape only, so it is
    worked out once per shape, and wait reasons are written with one ``UPDATE`` per
    distinct reason, only to the jobs whose stored reason differs: a pass over a queue
    that keeps waiting reads a page of its index and writes nothing."""
    result = PassResult()
    queued = _lock_queued(session)
    if not queued:
        return result
    now = utcnow()
    nodes = ready_capacity(session, settings, now)
    ledger = load_ledger(session, {DEFAULT_POOL: sum(n.units for n in nodes)}, unit_word(nodes))
    if ledger.managed:
        # Teams with quotas (docs/teams.md): fair share between them, from the head of each
        # team's own line (a team's flood does not hide the others' jobs).
        queued = list(
            map(QueuedJob._make, session.execute(_TEAM_HEADS, {"per_team": JOBS_PER_TEAM_PER_PASS}))
        )
        TeamPass(session, settings, ledger, nodes, now, result).run(queued)
        _announce(session, result)
        return result
    taken_ports: dict[str, set[int]] = {}
    blocker: QueuedJob | None = None
    behind: dict[tuple[int, int], str] = {}  # reasons behind the blocker, by job shape
    changed: dict[str, list[str]] = {}  # new wait reason -> the jobs to write it to
    for job in queued:
        if blocker is not None:
            reason = _reason_behind(job, nodes, blocker, behind)
        else:
            placed_or_reason, possible = _try_place(session, settings, job, nodes, taken_ports, now)
            if placed_or_reason is None:
                result.scheduled.append(job.id)
                continue
            if placed_or_reason is _GONE:
                continue  # cancelled since the queue was read: nothing to place or explain
            reason = placed_or_reason
            if possible:
                blocker = job
        if job.requeue_reason:
            reason = f"{job.requeue_reason}; {reason}"
        result.waiting[job.id] = reason
        if job.wait_reason != reason:
            changed.setdefault(reason, []).append(job.id)
    _write_reasons(session, changed)
    _announce(session, result)
    return result


def _announce(session: Session, result: PassResult) -> None:
    """Wake the claims of the nodes that got placements."""
    if result.scheduled:
        log.info("scheduled %s", ", ".join(result.scheduled))
        placed = session.scalars(
            select(Placement.node_id).where(
                Placement.job_id.in_(result.scheduled), Placement.status == PlacementStatus.ASSIGNED
            )
        )
        result.placed_nodes = sorted({*placed})
        announce_placed(session, result.placed_nodes)


def _write_reasons(session: Session, changed: dict[str, list[str]]) -> None:
    """One ``UPDATE`` per distinct reason, only to jobs still queued (a cancel may have ended
    one since it was read)."""
    for reason, ids in changed.items():
        session.execute(_WRITE_REASON, {"ids": ids, "reason": reason})


# Built once (SQLAlchemy then works out its cache key once).
_WRITE_REASON = (
    update(Job)
    .where(Job.id.in_(bindparam("ids", expanding=True)), Job.status == JobStatus.QUEUED)
    .values(wait_reason=bindparam("reason"))
    .execution_options(synchronize_session=False)
)


def _lock_queued(session: Session) -> list[QueuedJob]:
    """The queued jobs in order (first MAX_JOBS_PER_PASS), under the scheduler lock.

    They are read in the queue's order from its index (``ix_jobs_queue``: no sort of the
    whole queue), as plain rows of the columns a pass looks at; no row is locked here. A
    job is locked (and read whole) only when it is placed (:func:`_claim_for_placing`), and
    a wait reason is written only to a job still queued, so a pass writes nothing for the
    jobs that just keep waiting."""
    if is_postgres(session):
        session.execute(_SCHEDULER_LOCK, {"key": SCHEDULER_LOCK_KEY})
    return list(map(QueuedJob._make, session.execute(_QUEUE_HEAD)))


# What every pass reads, built once (SQLAlchemy then works out its cache key once).
_SCHEDULER_LOCK = text("SELECT pg_advisory_xact_lock(:key)")
_QUEUE_HEAD = (
    select(
        Job.id,
        Job.name,
        Job.node_count,
        Job.process_count_per_node,
        Job.requeue_reason,
        Job.wait_reason,
        Job.team_id,
        Job.priority,
    )
    .where(Job.status == JobStatus.QUEUED)
    .order_by(Job.priority.desc(), Job.created_at, Job.id)
    .limit(MAX_JOBS_PER_PASS)
)


# With teams: the first jobs of each team's line (priority, then age), in the queue's order.
JOBS_PER_TEAM_PER_PASS = 200
_RANKED = (
    select(
        *_QUEUE_HEAD.selected_columns,
        Job.created_at,
        func.row_number()
        .over(partition_by=Job.team_id, order_by=(Job.priority.desc(), Job.created_at, Job.id))
        .label("in_line"),
    )
    .where(Job.status == JobStatus.QUEUED)
    .subquery()
)
_TEAM_HEADS = (
    select(*(_RANKED.c[c.name] for c in _QUEUE_HEAD.selected_columns))
    .where(_RANKED.c.in_line <= bindparam("per_team"))
    .order_by(_RANKED.c.priority.desc(), _RANKED.c.created_at, _RANKED.c.id)
)


def _claim_for_placing(session: Session, job_id: str) -> Job | None:
    """Lock the job and read it whole, if it is still queued: a job being cancelled right now
    (locked) or cancelled since the queue was read is left alone (None). On SQLite the
    pass's write transaction is exclusive already."""
    stmt = (
        select(Job)
        .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
        .execution_options(populate_existing=True)
    )
    if is_postgres(session):
        stmt = stmt.with_for_update(skip_locked=True)
    return session.scalars(stmt).first()


def _reason_behind(
    job: QueuedJob, nodes: list[NodeCapacity], blocker: QueuedJob, known: dict[tuple[int, int], str]
) -> str:
    """Why ``job`` waits while ``blocker``, first in line, cannot be placed yet (``known``:
    the reasons found so far by job shape; nothing is placed behind the blocker, so the
    capacity, and the reason for each shape, stay the same for the rest of the pass)."""
    shape = (job.node_count, job.process_count_per_node)
    if shape not in known:
        reason, possible = _wait_reason(job, nodes)
        if possible:
            reason = f"queued behind job {blocker.name!r} ({blocker.id}), which is first in line"
        known[shape] = reason
    return known[shape]


def _try_place(
    session: Session,
    settings: Settings,
    job: QueuedJob,
    nodes: list[NodeCapacity],
    taken_ports: dict[str, set[int]],
    now: datetime,
) -> tuple[str | None, bool]:
    """Place ``job`` if nodes and a port are free: (None, True). Otherwise (why it waits,
    whether it could ever be placed)."""
    chosen = _choose(nodes, job.node_count, job.process_count_per_node)
    if chosen is None:
        return _wait_reason(job, nodes)
    port = pick_port(session, settings, chosen[0].address, taken_ports)
    if port is None:
        return (
            f"waiting for a free rendezvous port on {chosen[0].address} "
            f"(range {settings.master_port_min}-{settings.master_port_max} in use)"
        ), True
    row = _claim_for_placing(session, job.id)
    if row is None:
        return _GONE, False
    _place(session, settings, row, chosen, port, now)
    return None, True


def unit_word(nodes: list[NodeCapacity]) -> str:
    """What a pool's units are, for the reasons users read: GPUs where its nodes have them."""
    return "GPUs" if any(n.accelerator not in ("cpu", "") for n in nodes) else "CPU slots"


class TeamPass:
    """One pass between teams with quotas (:mod:`service.services.fair_share`): the team
    furthest below its fair share goes next; within a team, its line in order, nothing past
    its first job that waits; a job within its team's quota that finds the units lent out
    gets them back by preemption of borrowed jobs."""

    def __init__(
        self,
        session: Session,
        settings: Settings,
        ledger: Ledger,
        nodes: list[NodeCapacity],
        now: datetime,
        result: PassResult,
    ) -> None:
        self.session = session
        self.settings = settings
        self.ledger = ledger
        self.nodes = nodes
        self.now = now
        self.result = result
        self.taken_ports: dict[str, set[int]] = {}
        self.blockers: dict[str, QueuedJob] = {}
        self.changed: dict[str, list[str]] = {}
        self._running: list[Running] | None = None
        # Each team's line of queued jobs not considered yet in this pass.
        self.lines: dict[str, deque[QueuedJob]] = {}

    def run(self, queued: list[QueuedJob]) -> None:
        lines = self.lines
        for job in queued:
            lines.setdefault(job.team_id or "", deque()).append(job)
        for team_id, line in lines.items():
            head = line[0]
            book = self.ledger.book(team_id or None)
            if book.used.get(DEFAULT_POOL, 0) + head.units <= book.quota(DEFAULT_POOL).nominal:
                book.wants.add(DEFAULT_POOL)
        while lines:
            team_id = min(lines, key=lambda t: (self.ledger.share(t or None), -lines[t][0].priority))
            job = lines[team_id].popleft()
            if not lines[team_id]:
                del lines[team_id]
            self._consider(team_id, job)
        _write_reasons(self.session, self.changed)

    def _wait(self, job: QueuedJob, reason: str) -> None:
        if job.requeue_reason:
            reason = f"{job.requeue_reason}; {reason}"
        self.result.waiting[job.id] = reason
        if job.wait_reason != reason:
            self.changed.setdefault(reason, []).append(job.id)

    def _consider(self, team_id: str, job: QueuedJob) -> None:
        blocker = self.blockers.get(team_id)
        if blocker is not None:
            name = self.ledger.book(team_id or None).name
            self._wait(job, f"queued behind job {blocker.name!r} ({blocker.id}), first in team {name}'s line")
            return
        decision = self.ledger.decide(job.team_id, DEFAULT_POOL, job.units)
        if not decision.admitted:
            self.blockers[team_id] = job
            self._wait(job, decision.reason or "waiting for its team's quota")
            return
        placed_or_reason, possible = _try_place(
            self.session, self.settings, job, self.nodes, self.taken_ports, self.now
        )
        if placed_or_reason is None:
            self.ledger.take(job.team_id, DEFAULT_POOL, job.units)
            self.result.scheduled.append(job.id)
            return
        if placed_or_reason is _GONE:
            return
        reason = placed_or_reason
        if possible:
            self.blockers[team_id] = job
            if not decision.borrowing and DEFAULT_POOL in self.ledger.managed:
                reason = self._reclaim(job) or reason
        self._wait(job, reason)

    def _reclaim(self, job: QueuedJob) -> str | None:
        """Preempt borrowed jobs so that ``job``, within its team's quota, can start, and with
        it the team's jobs behind it up to its quota: the whole of what the team is owed, at
        once (not a job's worth per checkpoint interval). At least the job's own units are
        taken back, free units scattered over nodes notwithstanding (it could not be placed)."""
        if self._running is None:
            self._running = running_attempts(self.session)
        book = self.ledger.book(job.team_id)
        owed = book.quota(DEFAULT_POOL).nominal - book.used.get(DEFAULT_POOL, 0)
        want = job.units
        for behind in self.lines.get(job.team_id or "", ()):
            if want + behind.units > owed:
                break
            want += behind.units
        free = sum(n.free for n in self.nodes)
        needed = max(job.units, want - free)
        victims, coming = reclaim_victims(
            self.ledger,
            self._running,
            team_id=job.team_id,
            pool=DEFAULT_POOL,
            needed=needed,
            priority=job.priority,
            now=self.now,
            min_run_s=self.settings.reclaim_min_run_s,
        )
        team = self.ledger.book(job.team_id).name
        word = self.ledger.unit_word
        for victim in victims:
            lender = self.ledger.book(victim.team_id).name
            why = (
                f"team {team} took back its quota ({victim.units} {word} lent to team {lender})"
                if lender != team
                else f"a job of priority {job.priority} of team {team} needed its {victim.units} {word}"
            )
            log.info("job %s: preempting job %s: %s", job.id, victim.job_id, why)
            preempt_job(self.session, victim.job_id, self.now, why)
        if victims:
            self._running = None
            names = ", ".join(f"{v.job_name!r} ({v.job_id})" for v in victims)
            return f"reclaiming {sum(v.units for v in victims) + coming} {word} of team {team}'s quota: preempting {names}"
        if coming:
            return f"{coming} {word} of team {team}'s quota on their way back from preempted jobs"
        return None


def run_pass(db: Database, settings: Settings) -> PassResult:
    """A scheduling pass in a transaction of its own, committed."""
    with db.transaction() as session:
        return schedule(session, settings)


def has_queued_jobs(db: Database) -> bool:
    with db.read_session() as session:
        # In the queue's order: read from the head of its index whatever the queue's length.
        first = session.scalars(
            select(Job.id)
            .where(Job.status == JobStatus.QUEUED)
            .order_by(Job.priority.desc(), Job.created_at, Job.id)
            .limit(1)
        ).first()
        return first is not None

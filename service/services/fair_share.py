"""Admission between teams (docs/teams.md): quotas with borrowing and lending, weighted
fair share, and preemption to reclaim lent capacity.

The ledger is built at the start of a scheduling pass from the teams' quotas and the units
each team holds now, per resource pool. A pool where no team has a quota is *unmanaged*:
nothing is checked there and the queue is the one first-come line it always was.

In a managed pool, a job of team T needing ``d`` units, T holding ``u`` with nominal
quota ``n`` and borrowing limit ``b``:

* ``u + d <= n``: within its quota, it is admitted; if the units are lent out, borrowed
  jobs are preempted to give them back (:func:`reclaim_victims`);
* otherwise it borrows ``u + d - n`` units: refused past ``b`` (the reason names the
  quota: ``team vision at its quota: 16 of 16 GPUs in pool default, borrowing 8 of 8``),
  or when fewer units are lendable: free units minus what other teams keep back (their
  idle nominal beyond their lending limit, and all of it while they have jobs waiting
  within their quota, so what is reclaimed is not lent again at once).

Between teams the one furthest below its fair share goes first: the smallest weighted
dominant share, ``max over pools (u / n) / weight`` (units over the pool's capacity where
the team has no quota). Within a team: priority, then age; nothing is placed past a team's
first job that waits (no backfill), as the single line never did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db.models import Attempt, Job, Team, TeamQuota
from service.services.teams import DEFAULT_POOL, usage
from service.states import LIVE_ATTEMPT_STATUSES, JobStatus


@dataclass
class Quota:
    nominal: int
    borrowing_limit: int | None = None
    lending_limit: int | None = None


@dataclass
class TeamBook:
    id: str
    name: str
    weight: float = 1.0
    preempt_within: bool = False
    quotas: dict[str, Quota] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)
    # Pools where the team has a job waiting within its nominal quota (its idle nominal is
    # then kept back from borrowers).
    wants: set[str] = field(default_factory=set)
    slurm_account: str | None = None
    kueue_queue: str | None = None

    def quota(self, pool: str) -> Quota:
        return self.quotas.get(pool, Quota(0))


@dataclass(frozen=True)
class Decision:
    admitted: bool
    borrowing: bool = False
    reason: str | None = None


UNMANAGED = Decision(admitted=True)


class Ledger:
    """Who holds what, against which quotas (see the module's docstring)."""

    def __init__(
        self, teams: dict[str, TeamBook], capacity: dict[str, int], unit_word: str = "units"
    ) -> None:
        self.teams = teams
        self.capacity = capacity
        self.unit_word = unit_word
        self.managed = {pool for team in teams.values() for pool in team.quotas}

    def book(self, team_id: str | None) -> TeamBook:
        key = team_id or ""
        if key not in self.teams:
            self.teams[key] = TeamBook(id=key, name="(none)")
        return self.teams[key]

    def used(self, pool: str) -> int:
        return sum(team.used.get(pool, 0) for team in self.teams.values())

    def share(self, team_id: str | None) -> float:
        team = self.book(team_id)
        shares = [0.0]
        for pool, units in team.used.items():
            nominal = team.quota(pool).nominal if pool in self.managed else 0
            base = nominal or self.capacity.get(pool, 0) or 1
            shares.append(units / base)
        return max(shares) / team.weight

    def kept_back(self, pool: str, borrower: str) -> int:
        """Idle nominal units other teams do not lend to ``borrower`` now."""
        kept = 0
        for team in self.teams.values():
            if team.id == borrower:
                continue
            quota = team.quota(pool)
            idle = max(0, quota.nominal - team.used.get(pool, 0))
            if pool in team.wants:
                kept += idle
            elif quota.lending_limit is not None:
                kept += max(0, idle - quota.lending_limit)
        return kept

    def lendable(self, pool: str, borrower: str) -> int:
        free = self.capacity.get(pool, 0) - self.used(pool)
        return max(0, free - self.kept_back(pool, borrower))

    def decide(self, team_id: str | None, pool: str, units: int) -> Decision:
        if pool not in self.managed:
            return UNMANAGED
        team = self.book(team_id)
        quota = team.quota(pool)
        held = team.used.get(pool, 0)
        if held + units <= quota.nominal:
            return Decision(admitted=True)
        over = held + units - quota.nominal
        borrowed = max(0, held - quota.nominal)
        if quota.borrowing_limit is not None and over > quota.borrowing_limit:
            return Decision(
                admitted=False,
                reason=f"team {team.name} at its quota: {min(held, quota.nominal)} of {quota.nominal} "
                f"{self.unit_word} in pool {pool}, borrowing {borrowed} of {quota.borrowing_limit}",
            )
        # What it borrows now: the part of this job past its nominal quota.
        borrowing = min(units, over)
        lendable = self.lendable(pool, team.id)
        if borrowing > lendable:
            return Decision(
                admitted=False,
                reason=f"team {team.name} is past its quota ({held} of {quota.nominal} {self.unit_word} in "
                f"pool {pool}) and would borrow {borrowing}; {lendable} are free to borrow",
            )
        return Decision(admitted=True, borrowing=True)

    def take(self, team_id: str | None, pool: str, units: int) -> None:
        team = self.book(team_id)
        team.used[pool] = team.used.get(pool, 0) + units


def load_ledger(session: Session, capacity: dict[str, int], unit_word: str) -> Ledger:
    teams: dict[str, TeamBook] = {}
    for team in session.scalars(select(Team)):
        teams[team.id] = TeamBook(
            id=team.id,
            name=team.name,
            weight=team.weight,
            preempt_within=team.preempt_within,
            slurm_account=team.slurm_account,
            kueue_queue=team.kueue_queue,
        )
    for quota in session.scalars(select(TeamQuota)):
        if quota.team_id in teams:
            teams[quota.team_id].quotas[quota.pool] = Quota(
                quota.nominal, quota.borrowing_limit, quota.lending_limit
            )
    ledger = Ledger(teams, capacity, unit_word)
    for (team_id, pool), units in usage(session).items():
        ledger.take(team_id or None, pool, units)
    return ledger


@dataclass(frozen=True)
class Running:
    """A live attempt that holds units: a preemption candidate."""

    job_id: str
    job_name: str
    attempt_id: str
    team_id: str | None
    priority: int
    units: int
    started_at: datetime | None
    preempting: bool
    # Why it was asked to stop (``team X took back its quota ...``): whose units are coming back.
    reason: str | None = None

    def coming_back_to(self, team_name: str) -> bool:
        return self.preempting and (self.reason or "").startswith(f"team {team_name} ")


def running_attempts(session: Session, pool: str = DEFAULT_POOL) -> list[Running]:
    """The live attempts, each holding its job's nodes × processes (see :func:`teams.usage`)."""
    rows = session.execute(
        select(
            Job.id,
            Job.name,
            Attempt.id,
            Job.team_id,
            Job.priority,
            Job.node_count * Job.process_count_per_node,
            Attempt.started_at,
            Attempt.created_at,
            Attempt.preempt_requested_at,
            Attempt.preempt_reason,
        )
        .join(Attempt, Attempt.job_id == Job.id)
        .where(Attempt.status.in_(LIVE_ATTEMPT_STATUSES))
    ).all()
    return [
        Running(
            job_id,
            name,
            attempt_id,
            team_id,
            priority,
            int(units),
            started or created,
            preempt is not None,
            why,
        )
        for job_id, name, attempt_id, team_id, priority, units, started, created, preempt, why in rows
    ]


def reclaim_victims(
    ledger: Ledger,
    running: Iterable[Running],
    *,
    team_id: str | None,
    pool: str,
    needed: int,
    priority: int,
    now: datetime,
    min_run_s: float,
) -> tuple[list[Running], int]:
    """The attempts to preempt so that ``team_id`` gets ``needed`` more units of its own quota
    back, and how many units are already on their way back to it (attempts asked to stop
    earlier for this team; another team's reclaim does not hold this one back).

    Only borrowed units are taken: from teams holding more than their nominal quota, their
    lowest-priority jobs first, then the newest; whole jobs (every node of a gang) or none; an
    attempt that has run less than ``min_run_s`` is left alone (it would lose its work and
    thrash). Within the team, lower-priority jobs go too when the team allows it."""
    candidates = list(running)
    coming = sum(r.units for r in candidates if r.coming_back_to(ledger.book(team_id).name))
    if coming >= needed:
        return [], coming
    cutoff = now - timedelta(seconds=min_run_s)
    over = {
        t.id: max(0, t.used.get(pool, 0) - t.quota(pool).nominal)
        for t in ledger.teams.values()
        if t.id != (team_id or "")
    }
    for r in candidates:
        if r.preempting and (r.team_id or "") in over:
            over[r.team_id or ""] = max(0, over[r.team_id or ""] - r.units)

    def ripe(r: Running) -> bool:
        return not r.preempting and (r.started_at is None or r.started_at <= cutoff)

    chosen: list[Running] = []
    freed = coming
    lent = sorted(
        (
            r
            for r in candidates
            if ripe(r) and (r.team_id or "") in over and (r.team_id or "") != (team_id or "")
        ),
        key=lambda r: (r.priority, -(r.started_at.timestamp() if r.started_at else 0.0)),
    )
    for r in lent:
        if freed >= needed:
            break
        key = r.team_id or ""
        if over[key] <= 0:
            continue
        chosen.append(r)
        over[key] -= r.units
        freed += r.units
    if freed < needed and ledger.book(team_id).preempt_within:
        own = [r for r in candidates if ripe(r) and r.team_id == team_id and r.priority < priority]
        freed = _take_until(sorted(own, key=_victim_order), chosen, freed, needed)
    if freed < needed:
        return [], coming  # not enough to take back: preempt nothing (no half measures)
    return chosen, coming


def _victim_order(r: Running) -> tuple[int, float]:
    """Lowest priority first, then the newest."""
    return (r.priority, -(r.started_at.timestamp() if r.started_at else 0.0))


def _take_until(candidates: list[Running], chosen: list[Running], freed: int, needed: int) -> int:
    for r in candidates:
        if freed >= needed:
            break
        chosen.append(r)
        freed += r.units
    return freed


@dataclass(frozen=True)
class QueuePosition:
    job: Job
    team: TeamBook


def admission_order(
    session: Session, capacity: dict[str, int], unit_word: str, limit: int = 200
) -> tuple[Ledger, list[QueuePosition]]:
    """The queued jobs in the order the next pass considers them (as if each were admitted in
    turn: the team furthest below its fair share next), and the ledger of now."""
    ledger = load_ledger(session, capacity, unit_word)
    ranked = (
        select(
            Job.id,
            func.row_number()
            .over(partition_by=Job.team_id, order_by=(Job.priority.desc(), Job.created_at, Job.id))
            .label("in_line"),
        )
        .where(Job.status == JobStatus.QUEUED, Job.deleted_at.is_(None))
        .subquery()
    )
    heads = select(ranked.c.id).where(ranked.c.in_line <= limit)
    queued = list(
        session.scalars(
            select(Job).where(Job.id.in_(heads)).order_by(Job.priority.desc(), Job.created_at, Job.id)
        )
    )
    now_used = {key: dict(team.used) for key, team in ledger.teams.items()}
    lines: dict[str, list[Job]] = {}
    for job in queued:
        lines.setdefault(job.team_id or "", []).append(job)
    order: list[QueuePosition] = []
    while lines:
        team_id = min(
            lines, key=lambda t: (ledger.share(t or None), -lines[t][0].priority, lines[t][0].created_at)
        )
        job = lines[team_id].pop(0)
        if not lines[team_id]:
            del lines[team_id]
        order.append(QueuePosition(job, ledger.book(team_id or None)))
        ledger.take(team_id or None, DEFAULT_POOL, job.node_count * job.process_count_per_node)
    for key, used in now_used.items():
        ledger.teams[key].used = used
    return ledger, order

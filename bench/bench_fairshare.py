"""Fair share between teams under a flood, through the real scheduler (docs/teams.md).

Three teams share one pool of ``--nodes`` nodes × 8 units (1,000 units by default) with
nominal quotas of 50 %, 30 % and 20 %: ``vision`` (500), ``speech`` (300) and ``robotics``
(200). At the start ``vision`` floods ``--flood`` jobs (10,000); ``speech`` submits a burst
at ``--speech-at`` minutes and then a steady stream, ``robotics`` the same at
``--robotics-at`` minutes; both streams ask for somewhat more than their quota, so once
``robotics`` has started every team wants more than it has.

Everything but the agents is the real thing: the database is a fresh one on the local
PostgreSQL server (migrated to head), the teams and quotas are written by
:mod:`service.services.teams`, and every placement and every preemption is decided by
:func:`service.services.scheduler.run_pass`, one pass per simulated tick (``--tick``, 10 s).
The nodes are rows of engine ``agents`` whose ``last_heartbeat_at`` is refreshed every tick.
What the agents would do is done in the database between passes, as they would report it:

- a job placed by a pass is claimed at once: placements ``running``, attempt ``running``,
  job ``running``;
- each job needs a random amount of work (simulated seconds); it checkpoints every
  ``--checkpoint`` seconds of its attempt (60); when it has done its work it succeeds
  (placements done, attempt and job ``succeeded``, as tests/support/worker_fixtures.finish_job
  settles a job);
- an attempt asked to stop (``attempts.preempt_requested_at``, written by the pass's
  reclaim) stops at its next checkpoint, so within one checkpoint interval: its placements
  go ``done`` and :func:`service.services.attempt_outcomes.finish_preemption` puts the job
  back in the queue, as its agents' reports would. The work up to that checkpoint is kept.

Time. The ticks are simulated (a run of hours takes minutes), but the scheduler reads the
clock: the minimum run time before a borrowed job may be preempted
(``reclaim_min_run_s``, 300 s by default) is ``utcnow() - started_at``. Instead of setting
it to 0 and checking it apart, the bench *ages* the live attempts: every tick moves their
``created_at`` and ``started_at`` back by the simulated time that tick stands for, less the
real time it took, so that ``utcnow() - started_at`` is the attempt's simulated age and the
scheduler's own rule is what is measured, at its default. (Nothing else the pass reads
compares times: job order is by submission, and the nodes' heartbeats are real.)

Reported, per run:

- each team's units over time (a row every ``--every`` minutes) and, over the ticks where
  all three have jobs waiting (contended), the mean share against its entitlement and the
  fraction of ticks within 5 % of it (goal: within 5 %);
- for ``speech`` and ``robotics``: from their burst to the first tick after which their
  first waiting job is no longer within their quota (they hold their quota as nearly as
  their jobs' sizes allow) (goal: a checkpoint interval plus a pass);
- idle units while the first job of some team's line fits the free units (goal: 0): unit
  seconds and ticks, and how many of those the team of that job was within its quota;
- preemptions per simulated hour, and the shortest simulated run time of a preempted attempt;
- scheduling pass time (ms) at that queue length.

``--no-borrowing`` gives every team a borrowing limit of 0 (quotas are hard caps), for
comparison. ``--steady-priority`` gives speech's and robotics' jobs a priority (0 by
default, as the flood's).

Usage (from the repository root)::

    python -m bench.bench_fairshare
    python -m bench.bench_fairshare --no-borrowing
    python -m bench.bench_fairshare --steady-priority 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import select, update

from service.config import Settings
from service.db.engine import Database
from service.db.migrate import upgrade
from service.db.models import Attempt, Job, Node, Placement
from service.db.types import new_id, utcnow
from service.services import teams
from service.services.attempt_outcomes import finish_preemption, locked_job
from service.services.cluster import ready_capacity
from service.services.jobs import transition
from service.services.scheduler import _choose, run_pass
from service.services.teams import QuotaSpec
from service.services.transitions import set_attempt_status, set_placement_status
from service.states import LIVE_ATTEMPT_STATUSES, AttemptStatus, JobStatus, PlacementStatus
from tests.conftest import scratch_database
from tests.support.queue_fill import owner_and_dataset

UNITS_PER_NODE = 8
LIVE = [s.value for s in LIVE_ATTEMPT_STATUSES]
_AGE = sa.text(
    "UPDATE attempts SET created_at = created_at - :shift, started_at = started_at - :shift "
    "WHERE status = ANY(:live)"
)


@dataclass(frozen=True)
class Mix:
    """A team's jobs: shapes (nodes, processes per node) with weights, and work in seconds."""

    shapes: tuple[tuple[int, int, float], ...]
    work: tuple[float, float]

    def mean_units(self) -> float:
        total = sum(w for _, _, w in self.shapes)
        return sum(n * p * w for n, p, w in self.shapes) / total

    def draw(self, rng: random.Random) -> tuple[int, int, float]:
        n, p, _ = rng.choices(self.shapes, weights=[w for _, _, w in self.shapes])[0]
        return n, p, rng.uniform(*self.work)


FLOOD_MIX = Mix(((1, 1, 0.25), (1, 2, 0.25), (1, 4, 0.25), (1, 8, 0.15), (2, 8, 0.10)), (600.0, 3600.0))
SPEECH_MIX = Mix(((1, 2, 0.3), (1, 4, 0.4), (1, 8, 0.2), (2, 8, 0.1)), (600.0, 2400.0))
ROBOTICS_MIX = Mix(((1, 1, 0.3), (1, 4, 0.4), (1, 8, 0.3)), (600.0, 2400.0))


@dataclass
class TeamPlan:
    name: str
    share: float  # of the pool: its nominal quota
    mix: Mix
    start_s: float  # when it submits its first jobs
    burst: int  # jobs submitted at once at start_s (the flood for vision)
    demand: float  # units its steady stream keeps asking for (0: none)
    priority: int = 0
    id: str = ""
    nominal: int = 0

    def rate_per_s(self) -> float:
        """Jobs per second that keep ``demand`` units busy: demand / (units × work) per job."""
        if not self.demand:
            return 0.0
        return self.demand / (self.mix.mean_units() * statistics.fmean(self.mix.work))


@dataclass
class Running:
    """The agents' side of a job: work left, and the attempt being run."""

    team: str
    units: int
    work_left: float
    started_s: float = 0.0  # simulated time its present attempt started
    stop_at_s: float | None = None  # asked to stop: when it reaches its checkpoint


@dataclass
class Stats:
    held: dict[str, list[int]] = field(default_factory=dict)  # per team, per tick
    contended: list[bool] = field(default_factory=list)
    pass_ms: list[float] = field(default_factory=list)
    queue_len: list[int] = field(default_factory=list)
    idle_fit_ticks: int = 0
    idle_fit_unit_s: float = 0.0
    idle_fit_within_quota_ticks: int = 0
    idle_fit_examples: list[str] = field(default_factory=list)
    preemptions: int = 0
    preempted_runs_s: list[float] = field(default_factory=list)
    reclaimed_at: dict[str, float] = field(default_factory=dict)
    tick_times_s: list[float] = field(default_factory=list)


def _phase(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f} s] {text}", file=sys.stderr, flush=True)


class Simulation:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.args = args
        self.db = Database(url)
        self.settings = Settings(database_url=url, engine="agents")
        self.rng = random.Random(args.seed)
        self.tick = float(args.tick)
        self.capacity = args.nodes * UNITS_PER_NODE
        self.now_s = 0.0
        self.running: dict[str, Running] = {}
        self.work: dict[str, float] = {}  # queued jobs' work left
        self.job_team: dict[str, str] = {}
        self.stats = Stats()
        steady_priority = args.steady_priority
        self.plans = [
            TeamPlan("vision", 0.5, FLOOD_MIX, 0.0, args.flood, 0.0),
            TeamPlan(
                "speech", 0.3, SPEECH_MIX, args.speech_at * 60, 60, 1.3 * 0.3 * self.capacity, steady_priority
            ),
            TeamPlan(
                "robotics",
                0.2,
                ROBOTICS_MIX,
                args.robotics_at * 60,
                50,
                1.3 * 0.2 * self.capacity,
                steady_priority,
            ),
        ]
        self.shifted_at = time.monotonic()

    # --- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        self.owner = owner_and_dataset(self.db)
        with self.db.transaction() as s:
            for i in range(self.args.nodes):
                s.add(
                    Node(
                        name=f"n{i:04d}",
                        address=f"10.1.{i // 250}.{i % 250}",
                        units=UNITS_PER_NODE,
                        accelerator="cpu",
                        token_id=self.owner[0],
                        engine="agents",
                    )
                )
            borrowing = 0 if self.args.no_borrowing else None
            for plan in self.plans:
                plan.nominal = round(plan.share * self.capacity)
                team = teams.create_team(s, plan.name, [QuotaSpec("default", plan.nominal, borrowing)])
                s.flush()
                plan.id = team.id
        for plan in self.plans:
            self.stats.held[plan.name] = []

    def submit(self, plan: TeamPlan, count: int) -> None:
        """``count`` jobs of ``plan``'s team, queued now (one INSERT)."""
        if count <= 0:
            return
        now = utcnow()
        rows = []
        for i in range(count):
            n, p, work = plan.mix.draw(self.rng)
            job_id = new_id()
            self.work[job_id] = work
            self.job_team[job_id] = plan.name
            rows.append(
                {
                    "id": job_id,
                    "owner_id": self.owner[0],
                    "team_id": plan.id,
                    "name": f"{plan.name}-{len(self.job_team)}",
                    "status": "queued",
                    "type": "train",
                    "spec": {
                        "model": {"architecture": "resnet18"},
                        "parameters": {},
                        "resources": {"node_count": n, "process_count_per_node": p},
                    },
                    "architecture": "resnet18",
                    "train_dataset_id": self.owner[1],
                    "validation_dataset_id": self.owner[1],
                    "node_count": n,
                    "process_count_per_node": p,
                    "priority": plan.priority,
                    "attempts_count": 0,
                    "restarts": 0,
                    # Distinct, increasing submission times: the order within the team's line.
                    "created_at": now + timedelta(microseconds=i),
                    "updated_at": now,
                }
            )
        with self.db.transaction() as s:
            s.execute(sa.insert(Job), rows)

    # --- the agents' side ---------------------------------------------------------------------

    def age_and_heartbeat(self) -> None:
        """Live attempts one tick older (less the real time since the last shift: see the
        module's docstring); every node heard from now."""
        real = time.monotonic()
        shift = timedelta(seconds=self.tick - (real - self.shifted_at))
        self.shifted_at = real
        with self.db.transaction() as s:
            s.execute(_AGE, {"shift": shift, "live": LIVE})
            s.execute(update(Node).values(last_heartbeat_at=utcnow()))

    def claim(self, job_ids: list[str]) -> None:
        """The agents claim what a pass placed and start the ranks."""
        if not job_ids:
            return
        now = utcnow()
        with self.db.transaction() as s:
            jobs = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(job_ids)).with_for_update())}
            for attempt in s.scalars(
                select(Attempt).where(Attempt.job_id.in_(job_ids), Attempt.status == AttemptStatus.SCHEDULED)
            ):
                for p in s.scalars(select(Placement).where(Placement.attempt_id == attempt.id)):
                    set_placement_status(p, PlacementStatus.RUNNING, now)
                set_attempt_status(attempt, AttemptStatus.RUNNING, now)
                job = jobs[attempt.job_id]
                transition(s, job, JobStatus.RUNNING, "ranks started")
                self.running[job.id] = Running(
                    self.job_team[job.id], job.node_count * job.process_count_per_node, self.work.pop(job.id)
                )
                self.running[job.id].started_s = self.now_s

    def notice_preemptions(self) -> None:
        """Attempts the last pass asked to stop: each stops at its next checkpoint."""
        with self.db.read_session() as s:
            asked = list(
                s.scalars(
                    select(Attempt.job_id).where(
                        Attempt.status.in_(LIVE), Attempt.preempt_requested_at.is_not(None)
                    )
                )
            )
        every = self.args.checkpoint
        for job_id in asked:
            r = self.running.get(job_id)
            if r is None or r.stop_at_s is not None:
                continue
            ran = self.now_s - r.started_s
            r.stop_at_s = r.started_s + every * (math.floor(ran / every) + 1)
            self.stats.preemptions += 1
            self.stats.preempted_runs_s.append(ran)

    def advance(self) -> None:
        """One tick of work: jobs that finish succeed, jobs asked to stop that reach their
        checkpoint stop (back to the queue), as their agents would report it."""
        done, stopped = [], []
        for job_id, r in self.running.items():
            ends = r.started_s + r.work_left
            if r.stop_at_s is not None and r.stop_at_s <= self.now_s and r.stop_at_s < ends:
                stopped.append(job_id)
            elif ends <= self.now_s:
                done.append(job_id)
        now = utcnow()
        if done:
            with self.db.transaction() as s:
                for job_id in done:
                    job = locked_job(s, job_id)
                    attempt = s.scalars(
                        select(Attempt).where(Attempt.job_id == job_id, Attempt.status.in_(LIVE))
                    ).one()
                    for p in s.scalars(select(Placement).where(Placement.attempt_id == attempt.id)):
                        set_placement_status(p, PlacementStatus.DONE, now)
                    set_attempt_status(attempt, AttemptStatus.SUCCEEDED, now)
                    job.model_sha256 = "f" * 64
                    transition(s, job, JobStatus.SUCCEEDED)
                    del self.running[job_id]
        if stopped:
            with self.db.transaction() as s:
                for job_id in stopped:
                    job = locked_job(s, job_id)
                    attempt = s.scalars(
                        select(Attempt).where(Attempt.job_id == job_id, Attempt.status.in_(LIVE))
                    ).one()
                    for p in s.scalars(select(Placement).where(Placement.attempt_id == attempt.id)):
                        set_placement_status(p, PlacementStatus.DONE, now)
                    finish_preemption(s, job, attempt)
                    r = self.running.pop(job_id)
                    assert r.stop_at_s is not None
                    self.work[job_id] = r.work_left - (r.stop_at_s - r.started_s)

    # --- measuring ----------------------------------------------------------------------------

    def observe(self) -> None:
        """The state the last pass left, which holds until the next tick."""
        with self.db.read_session() as s:
            held = teams.usage(s)
            nodes = ready_capacity(s, self.settings, utcnow())
            heads: dict[str, tuple[int, int] | None] = {}
            for plan in self.plans:
                row = s.execute(
                    select(Job.node_count, Job.process_count_per_node)
                    .where(Job.status == JobStatus.QUEUED, Job.team_id == plan.id)
                    .order_by(Job.priority.desc(), Job.created_at, Job.id)
                    .limit(1)
                ).first()
                heads[plan.name] = (row[0], row[1]) if row else None
            queued = s.scalar(select(sa.func.count()).where(Job.status == JobStatus.QUEUED))
        self.stats.queue_len.append(int(queued or 0))
        by_name = {}
        for plan in self.plans:
            units = held.get((plan.id, "default"), 0)
            self.stats.held[plan.name].append(units)
            by_name[plan.name] = units
        self.stats.contended.append(all(heads[p.name] is not None for p in self.plans))
        free = sum(n.free for n in nodes)
        fitting = [
            (plan, head)
            for plan in self.plans
            if (head := heads[plan.name]) is not None and _choose(nodes, head[0], head[1]) is not None
        ]
        if free and fitting:
            self.stats.idle_fit_ticks += 1
            self.stats.idle_fit_unit_s += free * self.tick
            if any(by_name[p.name] + h[0] * h[1] <= p.nominal for p, h in fitting):
                self.stats.idle_fit_within_quota_ticks += 1
            if len(self.stats.idle_fit_examples) < 5:
                shown = ", ".join(f"{p.name} {h[0]}x{h[1]}" for p, h in fitting)
                held_text = ", ".join(f"{k} {v}" for k, v in by_name.items())
                self.stats.idle_fit_examples.append(
                    f"t={self.now_s / 60:.1f} min: {free} free; heads that fit: {shown}; held: {held_text}"
                )
        for plan in self.plans[1:]:
            if plan.name in self.stats.reclaimed_at or self.now_s < plan.start_s:
                continue
            # Its quota is back once its first waiting job is no longer within it (or none waits).
            head = heads[plan.name]
            if head is None or by_name[plan.name] + head[0] * head[1] > plan.nominal:
                self.stats.reclaimed_at[plan.name] = self.now_s - plan.start_s

    # --- the run ------------------------------------------------------------------------------

    def run(self, t0: float) -> None:
        ticks = int(self.args.hours * 3600 / self.tick)
        carry = {p.name: 0.0 for p in self.plans}
        run_pass(self.db, self.settings)  # connecting and compiling the statements: not timed
        for i in range(ticks):
            self.now_s = i * self.tick
            self.age_and_heartbeat()
            self.advance()
            for plan in self.plans:
                if self.now_s < plan.start_s:
                    continue
                count = 0
                if self.now_s - plan.start_s < self.tick:
                    count += plan.burst
                elif plan.demand:
                    # Poisson arrivals at the plan's rate over the tick.
                    carry[plan.name] += plan.rate_per_s() * self.tick
                    while carry[plan.name] >= 1 or (
                        carry[plan.name] > 0 and self.rng.random() < carry[plan.name]
                    ):
                        count += 1
                        carry[plan.name] -= 1
                    carry[plan.name] = 0.0 if carry[plan.name] < 0 else carry[plan.name]
                self.submit(plan, count)
            start = time.perf_counter()
            result = run_pass(self.db, self.settings)
            self.stats.pass_ms.append((time.perf_counter() - start) * 1000)
            self.claim(result.scheduled)
            self.notice_preemptions()
            self.observe()
            self.stats.tick_times_s.append(self.now_s)
            if i % 60 == 0:
                held = self.stats.held
                _phase(
                    t0,
                    f"t={self.now_s / 60:5.0f} min  "
                    + "  ".join(f"{p.name} {held[p.name][-1]:4d}" for p in self.plans)
                    + f"  queued {self.stats.queue_len[-1]}  pass {self.stats.pass_ms[-1]:.0f} ms",
                )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(
    sim: Simulation, args: argparse.Namespace, wall_s: float, load: tuple[float, ...]
) -> dict[str, Any]:
    st = sim.stats
    cap = sim.capacity
    every = max(1, int(args.every * 60 / sim.tick))
    names = [p.name for p in sim.plans]
    print()
    mode = "borrowing off (quotas are caps)" if args.no_borrowing else "borrowing on"
    print(
        f"{args.nodes} nodes x {UNITS_PER_NODE} = {cap} units; quotas "
        + ", ".join(f"{p.name} {p.nominal}" for p in sim.plans)
        + f"; {mode}; flood {args.flood}; speech/robotics priority {args.steady_priority}; "
        f"tick {sim.tick:.0f} s, checkpoint every {args.checkpoint:.0f} s, "
        f"reclaim_min_run_s {sim.settings.reclaim_min_run_s:.0f}"
    )
    print()
    print("| t (min) | " + " | ".join(f"{n} units (share)" for n in names) + " | queued | pass ms |")
    print("| --- | " + " | ".join("---" for _ in names) + " | --- | --- |")
    for i in range(0, len(st.tick_times_s), every):
        cells = [f"{st.held[n][i]} ({st.held[n][i] / cap:.0%})" for n in names]
        print(
            f"| {st.tick_times_s[i] / 60:.0f} | "
            + " | ".join(cells)
            + f" | {st.queue_len[i]} | {st.pass_ms[i]:.0f} |"
        )
    contended = [i for i, c in enumerate(st.contended) if c]
    out: dict[str, Any] = {"contended_ticks": len(contended), "teams": {}}
    print()
    print(f"Contended (every team has a job waiting): {len(contended) * sim.tick / 60:.0f} simulated min")
    print()
    print(
        "| team | entitlement | mean share contended | min - max | ticks within 5 % of entitlement | burst -> quota held |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for plan in sim.plans:
        shares = [st.held[plan.name][i] / cap for i in contended]
        within = sum(1 for s in shares if abs(s - plan.share) <= 0.05 * plan.share)
        reclaimed = st.reclaimed_at.get(plan.name)
        if plan.name == "vision":
            reclaim_text = "-"
        elif reclaimed is None:
            reclaim_text = "not within the run"
        else:
            reclaim_text = f"{reclaimed:.0f} s"
        mean = statistics.fmean(shares) if shares else float("nan")
        lo, hi = (min(shares), max(shares)) if shares else (float("nan"), float("nan"))
        frac = within / len(shares) if shares else float("nan")
        print(
            f"| {plan.name} | {plan.share:.0%} | {mean:.1%} | {lo:.1%} - {hi:.1%} | {frac:.0%} | {reclaim_text} |"
        )
        out["teams"][plan.name] = {
            "mean_share": mean,
            "within_5pct": frac,
            "reclaim_s": reclaimed,
        }
    hours = len(st.tick_times_s) * sim.tick / 3600
    total_unit_s = cap * len(st.tick_times_s) * sim.tick
    print()
    print(
        f"Idle units while a team's first waiting job fits: {st.idle_fit_ticks} of {len(st.tick_times_s)} ticks, "
        f"{st.idle_fit_unit_s / 3600:.1f} unit-hours ({st.idle_fit_unit_s / total_unit_s:.2%} of the pool's time); "
        f"in {st.idle_fit_within_quota_ticks} of those ticks the job was within its team's quota"
    )
    for example in st.idle_fit_examples:
        print(f"  {example}")
    short = sum(1 for r in st.preempted_runs_s if r < sim.settings.reclaim_min_run_s)
    print(
        f"Preemptions: {st.preemptions} in {hours:.1f} simulated h ({st.preemptions / hours:.0f}/h); "
        f"shortest run before preemption {min(st.preempted_runs_s, default=float('nan')):.0f} s, "
        f"{short} under reclaim_min_run_s"
    )
    print(
        f"Scheduling pass: mean {statistics.fmean(st.pass_ms):.1f} ms, p50 {_pct(st.pass_ms, 0.5):.1f}, "
        f"p95 {_pct(st.pass_ms, 0.95):.1f}, max {max(st.pass_ms):.1f} ms over {len(st.pass_ms)} passes; "
        f"queue {min(st.queue_len)}-{max(st.queue_len)} jobs"
    )
    print(
        f"Wall time {wall_s:.0f} s; load average before/after {load[0]:.2f} / {os.getloadavg()[0]:.2f}; "
        f"{platform.machine()}, {os.cpu_count()} cores"
    )
    out.update(
        idle_fit_ticks=st.idle_fit_ticks,
        idle_fit_unit_hours=st.idle_fit_unit_s / 3600,
        preemptions_per_hour=st.preemptions / hours,
        pass_ms_mean=statistics.fmean(st.pass_ms),
        pass_ms_p95=_pct(st.pass_ms, 0.95),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=125)
    parser.add_argument("--flood", type=int, default=10_000, help="jobs vision submits at the start")
    parser.add_argument("--hours", type=float, default=2.5, help="simulated hours")
    parser.add_argument("--tick", type=float, default=10.0, help="simulated seconds per scheduling pass")
    parser.add_argument(
        "--checkpoint", type=float, default=60.0, help="simulated seconds between checkpoints"
    )
    parser.add_argument("--speech-at", type=float, default=15.0, help="minute of speech's burst")
    parser.add_argument("--robotics-at", type=float, default=45.0, help="minute of robotics' burst")
    parser.add_argument("--steady-priority", type=int, default=0)
    parser.add_argument("--no-borrowing", action="store_true")
    parser.add_argument("--every", type=float, default=10.0, help="minutes between rows of the table")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the summary here too")
    args = parser.parse_args()
    t0 = time.monotonic()
    load = os.getloadavg()
    with scratch_database("bench_fairshare") as url:
        upgrade(url)
        sim = Simulation(url, args)
        sim.setup()
        _phase(t0, f"database ready; flooding {args.flood} jobs")
        try:
            sim.run(t0)
        finally:
            sim.db.dispose()
    summary = report(sim, args, time.monotonic() - t0, load)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)


if __name__ == "__main__":
    main()

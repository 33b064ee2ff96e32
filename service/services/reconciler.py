"""One reconciler for every engine: the engine's answers made into torchyard's rows.

A driver (:mod:`service.engines`) knows nothing of the database; everything written here
is written the same way whatever the engine. One pass (in the replica's scheduling loop,
every ``driver.period_s`` and whenever something asks):

* an engine that does not schedule (the built-in agents: ``Capabilities.schedules`` off)
  gets the service's gang scheduler (:mod:`service.services.scheduler`), whose placements
  the agents claim; nothing else happens here for it;
* an engine that schedules (Slurm, Kubernetes) is talked to under a cluster-wide lock on
  PostgreSQL, so that one replica at a time does it:

  1. **inventory** → the node rows (``engine`` = the driver's name): ready, drained or
     lost; a node newly lost (or gone from the inventory) loses its placements
     (``WorkerLostError`` naming it, the job restarts);
  2. **hand-over**: each queued job that fits the engine's nodes gets an attempt
     (committed first, with a fresh launch token), then ``submit`` — an attempt committed
     but never recorded as submitted (the API stopped in between) is submitted again
     (the driver adopts an engine job of the attempt's name: nothing runs twice);
  3. **poll** every attempt whose engine job has not been settled: a pending one's reason
     goes into its job's (``waiting in Slurm (job 12): Resources``); an ended one settles
     the attempt — the launchers' reports decide, the engine's ending fills the gaps (see
     :meth:`Reconciler._settle`);
  4. **cancel**: the engine job of every attempt that ended in torchyard (cancelled,
     failed, restarted) is cancelled while it still runs; a succeeded attempt's launchers
     get ``LAUNCHER_EXIT_S`` to exit by themselves first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, Job, Node, Placement, Team
from service.db.types import utcnow
from service.engines.base import (
    Driver,
    Ending,
    EngineJobState,
    EngineNotAnswering,
    LaunchRequest,
    NodeSeen,
    Phase,
    SubmitRefused,
    engine_job_name,
)
from service.services import launches
from service.services.attempt_outcomes import fail_attempt, finish_cancellation, finish_preemption, requeue
from service.services.cluster import check_resources, ready_capacity
from service.services.drain import preempt_job
from service.services.fair_share import Ledger, TeamBook, admission_order, reclaim_victims, running_attempts
from service.services.jobs import request_cancel
from service.services.lost_placements import lose_node_placements, lose_placements
from service.services.scheduler import PassResult, is_postgres, run_pass, unit_word
from service.services.teams import DEFAULT_POOL
from service.services.transitions import set_attempt_status, set_node_status, set_placement_status
from service.states import (
    LIVE_ATTEMPT_STATUSES,
    PLACED_STATUSES,
    AttemptStatus,
    EngineName,
    JobStatus,
    NodeStatus,
    PlacementStatus,
)
from torchyard.contract.errors import ConflictError, EngineError, ResourceLimitError
from torchyard.contract.failures import Failure

log = logging.getLogger(__name__)

# pg_try_advisory_xact_lock key: one replica at a time talks to the engine.
ENGINE_LOCK_KEY = 7345013
# How long the launchers of a succeeded attempt have to exit before its engine job is cancelled.
LAUNCHER_EXIT_S = 30.0
# An engine job cancelled this recently is not asked to stop again yet.
CANCEL_AGAIN_S = 10.0


@dataclass
class Reconciler:
    """The engine of a replica: its driver and the passes that reconcile it with the rows."""

    driver: Driver
    # Engine jobs this replica already cancelled, by id (asked again only after a while).
    _cancelled: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.driver.name

    @property
    def period_s(self) -> float | None:
        return self.driver.period_s

    def start(self) -> None:
        self.driver.start()

    def run_pass(self, db: Database, settings: Settings) -> PassResult:
        if not self.driver.capabilities.schedules:
            return run_pass(db, settings)
        result = PassResult()
        with db.session() as lock:
            if is_postgres(lock) and not lock.scalar(
                text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": ENGINE_LOCK_KEY}
            ):
                return result  # another replica is talking to the engine right now
            try:
                self._mirror(db, self.driver.inventory())
                self._hand_over_queued(db, settings, result)
                self._poll(db, settings)
            except EngineNotAnswering as exc:
                log.warning("%s does not answer: %s", self.driver.display_name, exc)
            lock.rollback()
        return result

    # --- inventory ------------------------------------------------------------------------

    def _mirror(self, db: Database, seen: list[NodeSeen]) -> None:
        """The inventory into the node rows; the placements of nodes newly lost are lost."""
        engine = self.driver.name
        lost: list[tuple[str, str]] = []
        now = utcnow()
        names = [s.name for s in seen]
        with db.transaction() as session:
            owner = launches.engine_owner(session, engine)
            rows = {n.name: n for n in session.scalars(select(Node).where(Node.name.in_(names)))}
            for node in seen:
                row = rows.get(node.name)
                if row is None:
                    row = Node(
                        name=node.name,
                        token_id=owner,
                        registered_at=now,
                        last_heartbeat_at=now,
                        engine=engine,
                    )
                    session.add(row)
                was = row.status
                _mirror_node(row, node, engine, owner, now)
                if row.status == NodeStatus.LOST and was != NodeStatus.LOST and row.id:
                    lost.append((row.id, node.why or f"node {node.name} is {node.state}"))
            gone = session.scalars(
                select(Node).where(
                    Node.engine == engine, Node.name.not_in(names), Node.status != NodeStatus.LOST
                )
            )
            for row in gone:
                set_node_status(row, NodeStatus.LOST)
                lost.append((row.id, f"node {row.name} left {self.driver.display_name}'s nodes"))
        for node_id, message in lost:
            log.warning("%s", message)
            lose_node_placements(db, node_id, message)

    # --- hand-over ------------------------------------------------------------------------

    def _hand_over_queued(self, db: Database, settings: Settings, result: PassResult) -> None:
        """Hand queued jobs to the engine: all of them in the queue's order, or, where teams
        have quotas (docs/teams.md), those admitted, in fair-share order; a job within its
        team's quota whose units are lent out gets them back by preemption."""
        with db.read_session() as session:
            nodes = ready_capacity(session, settings, utcnow())
            capacity = {DEFAULT_POOL: sum(n.units for n in nodes)}
            ledger, order = admission_order(session, capacity, unit_word(nodes))
        if not ledger.managed:
            for entry in order:
                handed = self._hand_over(db, settings, entry.job.id, result)
                if handed is not None:
                    self._submit(db, *handed)
            return
        for entry in order:
            job = entry.job
            units = job.node_count * job.process_count_per_node
            decision = ledger.decide(job.team_id, DEFAULT_POOL, units)
            if decision.admitted and not decision.borrowing:
                free = ledger.capacity[DEFAULT_POOL] - ledger.used(DEFAULT_POOL)
                if units > free:
                    self._hold(db, job.id, self._reclaim(db, settings, ledger, job, units - free), result)
                    continue
            if not decision.admitted:
                self._hold(db, job.id, decision.reason or "waiting for its team's quota", result)
                continue
            handed = self._hand_over(db, settings, job.id, result)
            if handed is not None:
                ledger.take(job.team_id, DEFAULT_POOL, units)
                self._submit(db, *handed, team=entry.team)

    def _hold(self, db: Database, job_id: str, reason: str, result: PassResult) -> None:
        with db.transaction() as session:
            job = session.scalars(
                select(Job).where(Job.id == job_id, Job.status == JobStatus.QUEUED).with_for_update()
            ).first()
            if job is None:
                return
            if job.requeue_reason:
                reason = f"{job.requeue_reason}; {reason}"
            job.wait_reason = reason
            result.waiting[job_id] = reason

    def _reclaim(self, db: Database, settings: Settings, ledger: Ledger, job: Job, needed: int) -> str:
        """Preempt borrowed attempts so that ``job`` gets its team's units back; why it waits."""
        now = utcnow()
        with db.transaction() as session:
            victims, coming = reclaim_victims(
                ledger,
                running_attempts(session),
                team_id=job.team_id,
                pool=DEFAULT_POOL,
                needed=needed,
                priority=job.priority,
                now=now,
                min_run_s=settings.reclaim_min_run_s,
            )
            team = ledger.book(job.team_id).name
            for victim in victims:
                lender = ledger.book(victim.team_id).name
                preempt_job(
                    session,
                    victim.job_id,
                    now,
                    f"team {team} took back its quota ({victim.units} lent to {lender})",
                )
        if victims:
            return f"reclaiming team {team}'s quota: preempting " + ", ".join(
                repr(v.job_name) for v in victims
            )
        if coming:
            return f"team {team}'s quota on its way back from preempted jobs"
        return f"waiting for team {team}'s quota: its units are in use"

    def _hand_over(
        self, db: Database, settings: Settings, job_id: str, result: PassResult
    ) -> tuple[str, str] | None:
        """A queued job's new attempt and launch token (committed), or None when it waits."""
        display = self.driver.display_name
        with db.transaction() as session:
            job = session.scalars(
                select(Job).where(Job.id == job_id, Job.status == JobStatus.QUEUED).with_for_update()
            ).first()
            if job is None:
                return None
            try:
                check_resources(session, settings, job.node_count, job.process_count_per_node)
            except ResourceLimitError as exc:
                # The engine's nodes shrank since the job was accepted: it waits for them.
                reason = f"waiting for {display}'s nodes: {exc.message}"
                if job.requeue_reason:
                    reason = f"{job.requeue_reason}; {reason}"
                job.wait_reason = reason
                result.waiting[job.id] = reason
                return None
            name = engine_job_name(job.id, (job.attempts_count or 0) + 1)
            attempt, token = launches.start_attempt(
                session, job, self.driver.name, f"submitted to {display} as {name}"
            )
            job.wait_reason = f"submitting to {display} as {name}"
            result.scheduled.append(job.id)
            return attempt.id, token

    def _submit(self, db: Database, attempt_id: str, token: str, *, team: TeamBook | None = None) -> None:
        with db.read_session() as session:
            attempt = session.get_one(Attempt, attempt_id)
            job = session.get_one(Job, attempt.job_id)
            limit = ((job.spec or {}).get("resources") or {}).get("max_runtime_s")
            row = session.get(Team, job.team_id) if team is None and job.team_id else None
            request = LaunchRequest(
                job_id=job.id,
                attempt_id=attempt.id,
                attempt_number=attempt.number,
                node_count=job.node_count,
                process_count_per_node=job.process_count_per_node,
                launch_token=token,
                max_runtime_s=float(limit) if isinstance(limit, int | float) else None,
                account=team.slurm_account if team is not None else (row.slurm_account if row else None),
                queue=team.kueue_queue if team is not None else (row.kueue_queue if row else None),
            )
        try:
            engine_job_id = self.driver.submit(request)
        except SubmitRefused as exc:
            self._refused(db, attempt_id, str(exc))
            return
        with db.transaction() as session:
            attempt = session.get_one(Attempt, attempt_id)
            attempt.engine_job_id = engine_job_id
            job = session.scalars(select(Job).where(Job.id == attempt.job_id).with_for_update()).one()
            if job.status == JobStatus.SCHEDULED:
                job.wait_reason = f"waiting in {self.driver.display_name} (job {engine_job_id}): submitted"
        log.info(
            "job %s attempt %d: %s job %s", request.job_id, request.attempt_number, self.name, engine_job_id
        )

    def _refused(self, db: Database, attempt_id: str, message: str) -> None:
        """The engine refused the attempt: EngineError with its words, not retried."""
        with db.transaction() as session:
            job, attempt = launches.lock_attempt(session, attempt_id)
            attempt.engine_state = "REFUSED"
            launches.revoke_launch_tokens(session, attempt_id)
            failure = Failure(code=EngineError.code, message=message)
            fail_attempt(session, job, attempt, failure, f"{EngineError.code}: {message}")
        log.error("job %s: %s", job.id, message)

    def _resubmit(self, db: Database, attempt_id: str) -> None:
        """An attempt committed but never recorded as submitted (the API stopped in between):
        submitted now with a fresh launch token (the driver adopts a job of its name)."""
        with db.transaction() as session:
            attempt = session.get_one(Attempt, attempt_id)
            token = launches.issue_launch_token(session, attempt)
        self._submit(db, attempt_id, token)

    # --- poll -----------------------------------------------------------------------------

    def _poll(self, db: Database, settings: Settings) -> None:
        with db.read_session() as session:
            open_attempts = list(
                session.execute(
                    select(
                        Attempt.id,
                        Attempt.engine_job_id,
                        Attempt.status,
                        Attempt.finished_at,
                        select(Placement.id).where(Placement.attempt_id == Attempt.id).exists(),
                    ).where(Attempt.engine == self.driver.name, Attempt.engine_state.is_(None))
                )
            )
        states = self.driver.poll([row.engine_job_id for row in open_attempts if row.engine_job_id])
        now = utcnow()
        for attempt_id, engine_job_id, status, finished_at, bound in open_attempts:
            if engine_job_id is None:
                if status in LIVE_ATTEMPT_STATUSES:
                    self._resubmit(db, attempt_id)
                continue
            state = states.get(engine_job_id)
            if state is None:
                continue
            if state.phase is Phase.ENDED:
                self._settle(db, attempt_id, state)
                # Whatever of it the engine keeps goes (Kubernetes' ended pods and their owner).
                self._cancel(engine_job_id)
            elif status in LIVE_ATTEMPT_STATUSES:
                self._follow(db, settings, attempt_id, state, bound=bool(bound))
            elif not _exiting_by_itself(status, finished_at, now):
                self._cancel(engine_job_id)

    def _follow(
        self, db: Database, settings: Settings, attempt_id: str, state: EngineJobState, *, bound: bool
    ) -> None:
        """A live attempt's engine job pends or runs: its reason, its ranks' nodes (once: ``bound``
        says its placements exist), a disruption."""
        if state.phase is Phase.PENDING:
            self._pending_reason(db, attempt_id, state)
            return
        if state.nodes and not bound and self.driver.capabilities.binds_ranks:
            self._bind(db, settings, attempt_id, state)
        if state.disrupted:
            self._preempt(db, attempt_id, state)

    def _pending_reason(self, db: Database, attempt_id: str, state: EngineJobState) -> None:
        if not state.reason:
            return
        reason = f"waiting in {self.driver.display_name} (job {state.id}): {state.reason}"
        with db.transaction() as session:
            attempt = session.get_one(Attempt, attempt_id)
            row = session.get_one(Job, attempt.job_id)
            if row.status == JobStatus.SCHEDULED and row.wait_reason != reason:
                row.wait_reason = reason
                attempt.engine_reason = state.reason

    def _bind(self, db: Database, settings: Settings, attempt_id: str, state: EngineJobState) -> None:
        """Every rank of the attempt is on a node: its placements, once (the launchers waiting
        at their check-in then find theirs)."""
        with db.transaction() as session:
            job, attempt = launches.lock_attempt(session, attempt_id)
            if attempt.status not in LIVE_ATTEMPT_STATUSES or job.status not in PLACED_STATUSES:
                return
            if session.scalar(select(Placement.id).where(Placement.attempt_id == attempt_id).limit(1)):
                return
            try:
                launches.bind_ranks(
                    session, settings, job, attempt, list(state.nodes), {state.nodes[0]: state.master_addr}
                )
            except ConflictError as exc:
                failure = Failure(code=EngineError.code, message=f"{self.driver.display_name}: {exc.message}")
                fail_attempt(session, job, attempt, failure, f"{EngineError.code}: {failure.message}")

    def _preempt(self, db: Database, attempt_id: str, state: EngineJobState) -> None:
        """The engine is taking a running attempt back: every rank checkpoints and stops (the
        launchers' heartbeats say so), and the job resumes later, no restart counted."""
        with db.transaction() as session:
            job, attempt = launches.lock_attempt(session, attempt_id)
            if (
                attempt.status in LIVE_ATTEMPT_STATUSES
                and attempt.preempt_requested_at is None
                and job.status in PLACED_STATUSES
            ):
                attempt.preempt_requested_at = utcnow()
                log.warning("job %s attempt %d: %s: preempting it", job.id, attempt.number, state.disrupted)

    def _cancel(self, engine_job_id: str) -> None:
        now = time.monotonic()
        if now - self._cancelled.get(engine_job_id, -1e9) < CANCEL_AGAIN_S:
            return
        self._cancelled[engine_job_id] = now
        self.driver.cancel(engine_job_id)

    # --- settling an attempt whose engine job ended ---------------------------------------

    def _settle(self, db: Database, attempt_id: str, state: EngineJobState) -> None:
        """The engine job of a not-yet-settled attempt ended: the launchers' reports decide,
        the engine's ending fills the gaps they left."""
        display = self.driver.display_name
        with db.transaction() as session:
            job, attempt = launches.lock_attempt(session, attempt_id)
            attempt.engine_state = state.state
            launches.revoke_launch_tokens(session, attempt_id)
            if attempt.status not in LIVE_ATTEMPT_STATUSES:
                return
            placements = list(
                session.scalars(
                    select(Placement).where(Placement.attempt_id == attempt_id).order_by(Placement.node_rank)
                )
            )
            open_ids = [p.id for p in placements if p.status != PlacementStatus.DONE]
            if job.status == JobStatus.CANCELLING:
                _close(session, placements)
                finish_cancellation(session, job)
            elif state.ending is Ending.CANCELLED and job.status in PLACED_STATUSES:
                _close(session, placements)
                request_cancel(
                    session, job, f"cancelled in {display} (job {state.id} was {self.driver.cancel_verb})"
                )
                finish_cancellation(session, job)
            elif state.ending is Ending.UNSCHEDULABLE and not open_ids:
                _release(session, job, attempt, f"waiting in {display}: {state.reason}")
            elif attempt.preempt_requested_at is not None or (
                state.ending is Ending.PREEMPTED and placements
            ):
                if attempt.preempt_requested_at is None:
                    attempt.preempt_requested_at = utcnow()
                _close(session, placements)
                finish_preemption(session, job, attempt)
            elif state.ending is Ending.NODE_LOST and all(
                p.status == PlacementStatus.ASSIGNED for p in placements
            ):
                # A node failed before any launcher took up its ranks (the engine placed the
                # job on a node it had not yet seen go): nothing ran, so this is neither the
                # job's failure nor a restart. It waits again; the engine knows the node is down.
                _close(session, placements)
                _release(
                    session,
                    job,
                    attempt,
                    f"{display} job {state.id} lost a node before its launcher started "
                    f"({state.state}{': ' + state.reason if state.reason else ''})",
                )
            elif open_ids and any(p.status != PlacementStatus.ASSIGNED for p in placements):
                nodes = {p.id: session.get_one(Node, p.node_id).name for p in placements}
                messages = {
                    pid: f"node {nodes[pid]}: {display} job {state.id} ended {state.state} without a report "
                    "from its launcher"
                    for pid in open_ids
                }
                session.flush()
                lose_placements(session, job.id, open_ids, messages)
            elif all(p.status == PlacementStatus.ASSIGNED for p in placements):
                # No launcher ever reported: its placements (bound by an engine that says where
                # ranks run) were never taken up. The engine's output says why.
                _close(session, placements)
                tail = state.output_tail
                message = (
                    f"{state.summary} without any report from torchyard's launcher "
                    f"({self.driver.launcher!r}); the end of its output:\n{tail}"
                )
                failure = Failure(code=EngineError.code, message=message, traceback=tail or None)
                fail_attempt(session, job, attempt, failure, f"{EngineError.code}: {message}")


def _exiting_by_itself(status: str, finished_at: datetime | None, now: datetime) -> bool:
    """A succeeded attempt's launchers exit by themselves (the engine's job then ends
    completed, not cancelled) if given ``LAUNCHER_EXIT_S``; any other ended attempt's engine
    job is stopped at once."""
    return (
        status == AttemptStatus.SUCCEEDED
        and finished_at is not None
        and now - finished_at < timedelta(seconds=LAUNCHER_EXIT_S)
    )


def _mirror_node(row: Node, seen: NodeSeen, engine: EngineName, owner: str, now: datetime) -> None:
    row.engine = engine
    row.token_id = owner
    row.agent_key_hash = None
    row.address = seen.address
    row.units = seen.units
    row.accelerator = seen.accelerator
    set_node_status(row, seen.status)
    row.drained_by = engine if seen.status is NodeStatus.DRAINED else None
    row.info = {"engine": engine, "state": seen.state, **seen.info}
    # When the engine's inventory last saw it (shown with the node; its readiness is the
    # inventory's word, not a heartbeat's age: Capabilities.nodes_heartbeat is off).
    row.last_heartbeat_at = now


def _close(session: Session, placements: list[Placement]) -> None:
    now = utcnow()
    for p in placements:
        set_placement_status(p, PlacementStatus.DONE, now)
    session.flush()


def _release(session: Session, job: Job, attempt: Attempt, reason: str) -> None:
    """The engine released an attempt it could not place whole: the job waits in the queue
    again (no restart counted), its reason the engine's."""
    set_attempt_status(attempt, AttemptStatus.PREEMPTED, utcnow())
    attempt.failure_message = f"released: {reason}"
    if job.status in PLACED_STATUSES:
        requeue(session, job, reason)

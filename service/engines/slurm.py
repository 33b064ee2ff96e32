"""The Slurm engine (docs/slurm.md): jobs run on an existing Slurm cluster, Slurm doing the scheduling.

One pass (in the replica's scheduling loop, every ``TORCHYARD_SLURM_POLL_S`` and whenever
something asks) does, under a cluster-wide lock on PostgreSQL so that one replica at a
time talks to Slurm:

1. **inventory**: ``sinfo`` of the partitions, mirrored into the node rows (``engine`` =
   ``slurm``): units are GPUs from the gres column, else CPUs; Slurm's ``down``/``*``
   states make a node ``lost`` (its placements fail with ``WorkerLostError`` naming it),
   ``drain`` makes it ``drained``;
2. **submit**: each queued job gets an attempt (committed first, with a fresh launch
   token), then one ``sbatch --parsable`` named ``torchyard-<job id>-<attempt>`` — unless
   Slurm already has a job of that name submitted by the API's own Slurm user (an API
   that died between ``sbatch`` and its commit never submits twice; another user's job of
   that name is never adopted: every ``squeue`` is limited to that user and each job's user
   is checked). All nodes at once (``-N n --ntasks-per-node=1``:
   Slurm's allocation is the gang), ``--gres=gpu:P`` on GPU nodes, ``-c P`` on CPU ones,
   ``--no-requeue`` (torchyard resubmits itself), ``--time`` from ``max_runtime_s``,
   ``--signal=USR1@<grace>``; the script ``exec srun``s the launcher on every node;
3. **poll**: ``squeue`` says what pends (the job's reason: ``waiting in Slurm (job 12):
   Resources``), runs or ended; for an ended job ``scontrol -o show job`` adds its exit
   code. The launchers' reports decide an attempt's outcome; Slurm's state fills the gaps:
   a job cancelled from outside (``scancel``) is ``cancelled``; one whose launchers were
   signalled (preemption, time limit) is requeued ``preempted``; a node that failed is
   ``WorkerLostError``; a job that ended without any launcher checking in is
   ``EngineError`` with the tail of its output, not retried;
4. **cancel**: the Slurm job of every attempt that ended in torchyard (cancelled, failed,
   restarted) is ``scancel``ed while it is still pending or running; a succeeded attempt's
   launchers get ``LAUNCHER_EXIT_S`` to exit by themselves first (Slurm's job then ends
   ``COMPLETED``, not ``CANCELLED``).
"""

from __future__ import annotations

import logging
import math
import shlex
import time
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, Job, Node, Placement, utcnow
from service.engines.base import EngineUnavailable
from service.engines.slurm_cli import Slurm, SlurmCommandError, SlurmJob, SlurmNode, missing_commands
from service.schemas.jobs import Failure
from service.services import launches
from service.services.attempts import fail_attempt, finish_cancellation, finish_preemption, lose_placements
from service.services.cluster import check_resources
from service.services.jobs import request_cancel
from service.services.reaper import lose_node_placements
from service.services.scheduler import PassResult, is_postgres
from service.states import (
    ENGINE_SLURM,
    LIVE_ATTEMPT_STATUSES,
    AttemptStatus,
    JobStatus,
    NodeStatus,
    PlacementStatus,
)
from torchyard.contract.errors import EngineError, ResourceLimitError

log = logging.getLogger(__name__)

# pg_try_advisory_xact_lock key: one replica at a time talks to Slurm.
SLURM_LOCK_KEY = 7345013
_LIVE = [s.value for s in LIVE_ATTEMPT_STATUSES]
OUTPUT_TAIL_BYTES = 4000
# How long the launchers of a succeeded attempt have to exit before its Slurm job is scancel'ed.
LAUNCHER_EXIT_S = 30.0


def job_name(job_id: str, attempt_number: int) -> str:
    return f"torchyard-{job_id}-{attempt_number}"


@dataclass
class SlurmEngine:
    settings: Settings
    slurm: Slurm = field(default_factory=Slurm)
    name: str = ENGINE_SLURM
    partitions: list[str] = field(default_factory=list)
    # Whether the partitions' nodes have GPUs (gres): jobs then ask for GPUs, else CPUs.
    gpus: bool = False
    # Slurm jobs this replica already scancel'ed (asked again only after a while).
    _cancelled: dict[str, float] = field(default_factory=dict)

    @property
    def period_s(self) -> float | None:
        return self.settings.slurm_poll_s

    # --- start ----------------------------------------------------------------------------

    def start(self) -> None:
        """Check the commands and partitions: one clear line when something is missing."""
        missing = missing_commands()
        if missing:
            raise EngineUnavailable(
                f"TORCHYARD_ENGINE=slurm: Slurm's {', '.join(missing)} not found on PATH "
                "(install slurm-client on the API's machine)"
            )
        wanted = [p.strip() for p in self.settings.slurm_partitions.split(",") if p.strip()]
        try:
            if not wanted:
                default = self.slurm.default_partition()
                if default is None:
                    raise EngineUnavailable(
                        "TORCHYARD_ENGINE=slurm: the Slurm cluster has no default partition"
                    )
                wanted = [default]
            known = {p for node in self.slurm.nodes([]) for p in node.partitions}
        except SlurmCommandError as exc:
            raise EngineUnavailable(f"TORCHYARD_ENGINE=slurm: Slurm does not answer: {exc}") from exc
        unknown = [p for p in wanted if p not in known]
        if unknown:
            raise EngineUnavailable(
                f"TORCHYARD_SLURM_PARTITIONS: no partition {', '.join(unknown)} in this Slurm cluster "
                f"(it has {', '.join(sorted(known)) or 'none'})"
            )
        self.partitions = wanted
        self.settings.slurm_outputs.mkdir(parents=True, exist_ok=True)
        for partition in wanted:
            grace = self.slurm.partition_grace_s(partition)
            if grace and self.settings.preempt_grace_s > grace:
                log.warning(
                    "TORCHYARD_PREEMPT_GRACE_S is %g s but partition %s gives preempted jobs %d s "
                    "(GraceTime): checkpoints may be cut short",
                    self.settings.preempt_grace_s,
                    partition,
                    grace,
                )
        log.info("Slurm engine: partitions %s, launcher %r", ",".join(wanted), self.settings.slurm_launcher)

    # --- one pass -------------------------------------------------------------------------

    def run_pass(self, db: Database, settings: Settings) -> PassResult:
        result = PassResult()
        with db.session() as lock:
            if is_postgres(lock) and not lock.scalar(
                text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": SLURM_LOCK_KEY}
            ):
                return result  # another replica is talking to Slurm right now
            try:
                self.inventory(db)
                queue = self.slurm.queue()
            except SlurmCommandError as exc:
                log.warning("Slurm does not answer: %s", exc)
                return result
            self._submit_queued(db, queue, result)
            self._poll(db, queue)
            lock.rollback()
        return result

    # --- inventory ------------------------------------------------------------------------

    def inventory(self, db: Database) -> None:
        nodes = self.slurm.nodes(self.partitions)
        self.gpus = any(n.gpus for n in nodes)
        lost: list[tuple[str, str]] = []
        now = utcnow()
        with db.transaction() as session:
            owner = launches.engine_owner(session, ENGINE_SLURM)
            rows = {
                n.name: n for n in session.scalars(select(Node).where(Node.name.in_([s.name for s in nodes])))
            }
            for seen in nodes:
                row = rows.get(seen.name)
                if row is None:
                    row = Node(name=seen.name, token_id=owner, registered_at=now, engine=ENGINE_SLURM)
                    session.add(row)
                was = row.status
                self._mirror(row, seen, owner, now)
                if row.status == NodeStatus.LOST.value and was != NodeStatus.LOST.value and row.id:
                    lost.append((row.id, f"node {seen.name} is {seen.state} in Slurm"))
            gone = session.scalars(
                select(Node).where(
                    Node.engine == ENGINE_SLURM,
                    Node.name.not_in([s.name for s in nodes]),
                    Node.status != NodeStatus.LOST.value,
                )
            )
            for row in gone:
                row.status = NodeStatus.LOST.value
                lost.append((row.id, f"node {row.name} left Slurm's partitions"))
        for node_id, message in lost:
            log.warning("%s", message)
            lose_node_placements(db, node_id, message)

    @staticmethod
    def _mirror(row: Node, seen: SlurmNode, owner: str, now: datetime) -> None:
        row.engine = ENGINE_SLURM
        row.token_id = owner
        row.agent_key_hash = None
        row.address = seen.address
        row.units = seen.units
        row.accelerator = "gpu" if seen.gpus else "cpu"
        row.status = seen.status
        row.drained_by = "slurm" if seen.status == NodeStatus.DRAINED.value else None
        row.info = {
            "engine": ENGINE_SLURM,
            "state": seen.state,
            "partitions": list(seen.partitions),
            "gpus": seen.gpus,
            "cpus": seen.cpus,
        }
        if seen.status == NodeStatus.READY.value:
            row.last_heartbeat_at = now

    # --- submit ---------------------------------------------------------------------------

    def _submit_queued(self, db: Database, queue: dict[str, SlurmJob], result: PassResult) -> None:
        with db.read_session() as session:
            queued = list(
                session.scalars(
                    select(Job.id)
                    .where(Job.status == JobStatus.QUEUED.value)
                    .order_by(Job.priority.desc(), Job.created_at, Job.id)
                    .limit(500)
                )
            )
        for job_id in queued:
            handed = self._hand_over(db, job_id, result)
            if handed is not None:
                self._sbatch(db, *handed, queue)

    def _hand_over(self, db: Database, job_id: str, result: PassResult) -> tuple[str, str] | None:
        """A queued job's new attempt and launch token (committed), or None when it waits."""
        with db.transaction() as session:
            job = session.scalars(
                select(Job).where(Job.id == job_id, Job.status == JobStatus.QUEUED.value).with_for_update()
            ).first()
            if job is None:
                return None
            try:
                check_resources(session, self.settings, job.node_count, job.process_count_per_node)
            except ResourceLimitError as exc:
                # The partitions shrank since the job was accepted: it waits for nodes to return.
                reason = f"waiting for Slurm's nodes: {exc.message}"
                if job.requeue_reason:
                    reason = f"{job.requeue_reason}; {reason}"
                job.wait_reason = reason
                result.waiting[job.id] = reason
                return None
            name = job_name(job.id, (job.attempts_count or 0) + 1)
            attempt, token = launches.start_attempt(
                session, job, ENGINE_SLURM, f"submitted to Slurm as {name}"
            )
            job.wait_reason = f"submitting to Slurm as {name}"
            result.scheduled.append(job.id)
            return attempt.id, token

    def _sbatch(self, db: Database, attempt_id: str, token: str, queue: dict[str, SlurmJob]) -> None:
        with db.read_session() as session:
            attempt = session.get_one(Attempt, attempt_id)
            job = session.get_one(Job, attempt.job_id)
            name = job_name(job.id, attempt.number)
            argv, env = self._sbatch_command(job, attempt, name, token)
        try:
            # Only the API's own Slurm user's jobs are seen (Slurm.queue, job_ids_named): a job of
            # this name that someone else submitted is not adopted.
            existing = [j for j in queue.values() if j.name == name] or [
                SlurmJob(id=i, name=name, state="?", reason="", nodes="")
                for i in self.slurm.job_ids_named(name)
            ]
            slurm_id = existing[0].id if existing else self.slurm.submit(argv, env)
        except SlurmCommandError as exc:
            self._refused(db, attempt_id, exc)
            return
        if existing:
            log.warning("job %s: Slurm already has %s (job %s): not submitted again", job.id, name, slurm_id)
        with db.transaction() as session:
            attempt = session.get_one(Attempt, attempt_id)
            attempt.engine_job_id = slurm_id
            job = session.scalars(select(Job).where(Job.id == attempt.job_id).with_for_update()).one()
            if job.status == JobStatus.SCHEDULED.value:
                job.wait_reason = f"waiting in Slurm (job {slurm_id}): submitted"
        log.info("job %s attempt %d: Slurm job %s (%s)", job.id, attempt.number, slurm_id, name)

    def _sbatch_command(
        self, job: Job, attempt: Attempt, name: str, token: str
    ) -> tuple[list[str], dict[str, str]]:
        settings = self.settings
        out_dir = settings.slurm_outputs
        out_dir.mkdir(parents=True, exist_ok=True)
        launcher = shlex.split(settings.slurm_launcher)
        launcher += ["--api", str(settings.slurm_api_url), "--attempt", attempt.id]
        if settings.slurm_work_dir:
            launcher += ["--work-dir", settings.slurm_work_dir]
        script = out_dir / f"{name}.sh"
        script.write_text(
            "#!/bin/sh\n# torchyard: one launcher per node runs this attempt's placement there.\n"
            f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 {shlex.join(launcher)}\n",
            encoding="utf-8",
        )
        p = job.process_count_per_node
        gpu = self.gpus
        argv = [
            "-J", name,
            "-p", ",".join(self.partitions),
            "-N", str(job.node_count),
            "--ntasks-per-node=1",
            f"--gres=gpu:{p}" if gpu else f"--cpus-per-task={p}",
            "--no-requeue",
            f"--signal=USR1@{math.ceil(settings.preempt_grace_s)}",
            f"--output={out_dir / f'{name}-%j.out'}",
            f"--chdir={out_dir}",
        ]  # fmt: skip
        limit = ((job.spec or {}).get("resources") or {}).get("max_runtime_s")
        if isinstance(limit, int | float) and limit > 0:
            argv.append(f"--time={max(1, math.ceil(limit / 60))}")
        argv += shlex.split(settings.slurm_sbatch_args)
        argv.append(str(script))
        env = dict(self.slurm.env)
        env["TORCHYARD_LAUNCH_TOKEN"] = token
        env["TORCHYARD_PREEMPT_GRACE_S"] = f"{settings.preempt_grace_s:g}"
        return argv, env

    def _refused(self, db: Database, attempt_id: str, exc: SlurmCommandError) -> None:
        """sbatch refused the job: EngineError with Slurm's words, not retried."""
        with db.transaction() as session:
            job, attempt = launches.lock_attempt(session, attempt_id)
            attempt.engine_state = "REFUSED"
            launches.revoke_launch_tokens(session, attempt_id)
            message = f"sbatch refused the job: {exc.output.strip()[-1000:] or exc}"
            failure = Failure(code=EngineError.code, message=message)
            fail_attempt(session, job, attempt, failure, f"{EngineError.code}: {message}")
        log.error("job %s: %s", attempt.job_id, exc)

    # --- poll -----------------------------------------------------------------------------

    def _poll(self, db: Database, queue: dict[str, SlurmJob]) -> None:
        with db.read_session() as session:
            open_attempts = list(
                session.execute(
                    select(Attempt.id, Attempt.engine_job_id, Attempt.status, Attempt.finished_at).where(
                        Attempt.engine == ENGINE_SLURM, Attempt.engine_state.is_(None)
                    )
                )
            )
        now = utcnow()
        for attempt_id, slurm_id, status, finished_at in open_attempts:
            if slurm_id is None:
                if status in _LIVE:
                    self._resubmit(db, attempt_id, queue)
                continue
            job = queue.get(slurm_id)
            if job is None:
                shown = self.slurm.show_job(slurm_id)
                state = (shown.get("JobState") or "FORGOTTEN").split()[0]
                job = SlurmJob(id=slurm_id, name="", state=state, reason=shown.get("Reason", ""), nodes="")
            if not job.ended:
                if status in _LIVE:
                    self._pending_reason(db, attempt_id, job)
                elif not (
                    status == AttemptStatus.SUCCEEDED.value
                    and finished_at is not None
                    and (now - finished_at).total_seconds() < LAUNCHER_EXIT_S
                ):
                    # A succeeded attempt's launchers exit by themselves (Slurm's job then
                    # ends COMPLETED); any other ended attempt is stopped now.
                    self._scancel(job.id)
                continue
            self._ended(db, attempt_id, job)

    def _resubmit(self, db: Database, attempt_id: str, queue: dict[str, SlurmJob]) -> None:
        """An attempt committed but never recorded as submitted (the API stopped in between):
        adopt Slurm's job of its name, or submit it now with a fresh launch token."""
        with db.transaction() as session:
            attempt = session.get_one(Attempt, attempt_id)
            token = launches.issue_launch_token(session, attempt)
        self._sbatch(db, attempt_id, token, queue)

    def _pending_reason(self, db: Database, attempt_id: str, job: SlurmJob) -> None:
        if job.state != "PENDING":
            return
        reason = f"waiting in Slurm (job {job.id}): {job.reason}"
        with db.transaction() as session:
            attempt = session.get_one(Attempt, attempt_id)
            row = session.get_one(Job, attempt.job_id)
            if row.status == JobStatus.SCHEDULED.value and row.wait_reason != reason:
                row.wait_reason = reason
                attempt.engine_reason = job.reason

    def _scancel(self, slurm_id: str) -> None:
        now = time.monotonic()
        if now - self._cancelled.get(slurm_id, -1e9) < 10:
            return
        self._cancelled[slurm_id] = now
        log.info("scancel %s: its attempt is over", slurm_id)
        self.slurm.cancel(slurm_id)

    def _output_tail(self, name: str, slurm_id: str) -> str:
        path = self.settings.slurm_outputs / f"{name}-{slurm_id}.out"
        try:
            with open(path, "rb") as fh:
                size = fh.seek(0, 2)
                fh.seek(max(0, size - OUTPUT_TAIL_BYTES))
                return fh.read().decode("utf-8", errors="replace").strip()
        except OSError:
            return f"(no output at {path}: TORCHYARD_SLURM_OUTPUT_DIR must be storage the API shares)"

    def _ended(self, db: Database, attempt_id: str, slurm_job: SlurmJob) -> None:
        """The Slurm job of a not-yet-settled attempt ended: Slurm's state fills the gaps the
        launchers' reports left."""
        shown = self.slurm.show_job(slurm_job.id)
        state = slurm_job.state
        with db.transaction() as session:
            job, attempt = launches.lock_attempt(session, attempt_id)
            attempt.engine_state = state
            launches.revoke_launch_tokens(session, attempt_id)
            if attempt.status not in _LIVE:
                return
            placements = list(
                session.scalars(
                    select(Placement).where(Placement.attempt_id == attempt_id).order_by(Placement.node_rank)
                )
            )
            open_ids = [p.id for p in placements if p.status != PlacementStatus.DONE]
            name = job_name(job.id, attempt.number)
            if job.status == JobStatus.CANCELLING.value:
                _close(session, placements)
                finish_cancellation(session, job)
            elif state == "CANCELLED" and job.status in (JobStatus.SCHEDULED.value, JobStatus.RUNNING.value):
                _close(session, placements)
                request_cancel(session, job, f"cancelled in Slurm (job {slurm_job.id} was scancel'ed)")
                finish_cancellation(session, job)
            elif attempt.preempt_requested_at is not None or (
                state in ("PREEMPTED", "TIMEOUT") and placements
            ):
                if attempt.preempt_requested_at is None:
                    attempt.preempt_requested_at = utcnow()
                _close(session, placements)
                finish_preemption(session, job, attempt)
            elif open_ids:
                nodes = {p.id: session.get_one(Node, p.node_id).name for p in placements}
                messages = {
                    pid: f"node {nodes[pid]}: Slurm job {slurm_job.id} ended {state} without a report from "
                    "its launcher"
                    for pid in open_ids
                }
                session.flush()
                lose_placements(session, job.id, open_ids, messages)
            elif not placements:
                exit_code = shown.get("ExitCode", "?")
                tail = self._output_tail(name, slurm_job.id)
                message = (
                    f"Slurm job {slurm_job.id} ended {state} (exit code {exit_code}, reason "
                    f"{shown.get('Reason') or slurm_job.reason or 'none'}) without any report from torchyard's "
                    f"launcher ({self.settings.slurm_launcher!r}); the end of its output:\n{tail}"
                )
                failure = Failure(code=EngineError.code, message=message, traceback=tail or None)
                fail_attempt(session, job, attempt, failure, f"{EngineError.code}: {message}")


def _close(session: Session, placements: list[Placement]) -> None:
    now = utcnow()
    for p in placements:
        if p.status != PlacementStatus.DONE:
            p.status = PlacementStatus.DONE
            p.finished_at = now
    session.flush()

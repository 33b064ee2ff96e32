"""The reconciler: an engine's answers made into node, attempt and job rows, the same for
every engine that schedules.

The driver here is scripted: it answers the port's four operations from what each test
sets (the port is the boundary under test; the real drivers are tested against their real
clusters and with recorded output). The database is real (SQLite and PostgreSQL), and
every pass is one the test made.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from service.config import Settings
from service.db.engine import Database
from service.db.migrate import upgrade
from service.db.models import Attempt, Job, Node, Placement, Token
from service.db.types import utcnow
from service.engines.base import (
    Capabilities,
    Ending,
    EngineJobState,
    EngineNotAnswering,
    LaunchRequest,
    NodeSeen,
    Phase,
    SubmitRefused,
)
from service.services.jobs import request_cancel
from service.services.reconciler import LAUNCHER_EXIT_S, Reconciler
from service.services.tokens import hash_token
from service.states import AttemptStatus, EngineName, JobStatus, NodeStatus, PlacementStatus
from tests.support.queue_fill import owner_and_dataset

pytestmark = pytest.mark.both_databases


@dataclass
class ScriptedDriver:
    """The port, answered from what the test sets; every call is noted."""

    name: EngineName = EngineName.SLURM
    display_name: str = "Testcluster"
    launcher: str = "torchyard launch"
    cancel_verb: str = "deleted"
    capabilities: Capabilities = field(
        default_factory=lambda: Capabilities(schedules=True, nodes_heartbeat=False, reports_ends=True)
    )
    nodes: list[NodeSeen] = field(default_factory=list)
    states: dict[str, EngineJobState] = field(default_factory=dict)
    refuse: str | None = None
    silent: bool = False
    submitted: list[LaunchRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    polled: list[list[str]] = field(default_factory=list)

    @property
    def period_s(self) -> float | None:
        return 1.0

    def start(self) -> None:
        return None

    def inventory(self) -> list[NodeSeen]:
        if self.silent:
            raise EngineNotAnswering("no answer within 30 s")
        return list(self.nodes)

    def submit(self, request: LaunchRequest) -> str:
        if self.refuse is not None:
            raise SubmitRefused(self.refuse)
        self.submitted.append(request)
        engine_id = f"E{len(self.submitted)}"
        self.states[engine_id] = EngineJobState(id=engine_id, phase=Phase.PENDING, state="Pending", reason="")
        return engine_id

    def poll(self, ids: Sequence[str]) -> dict[str, EngineJobState]:
        self.polled.append(list(ids))
        return {i: self.states[i] for i in ids if i in self.states}

    def cancel(self, engine_job_id: str) -> None:
        self.cancelled.append(engine_job_id)


def node(name: str, units: int = 4, status: NodeStatus = NodeStatus.READY) -> NodeSeen:
    return NodeSeen(
        name=name,
        address=f"10.0.0.{name[-1]}",
        units=units,
        accelerator="gpu",
        status=status,
        state="Ready" if status is NodeStatus.READY else "NotReady",
        why="" if status is NodeStatus.READY else f"node {name} is NotReady in Testcluster",
        info={"gpus": units},
    )


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    upgrade(db_url)
    database = Database(db_url)
    yield database
    database.dispose()


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    value: Settings = make_settings(engine="slurm", slurm_api_url="http://api.example:8000")
    return value


@pytest.fixture
def driver() -> ScriptedDriver:
    return ScriptedDriver(nodes=[node("n1"), node("n2")])


def add_job(db: Database, nodes: int = 2, procs: int = 2, max_runtime_s: int | None = None) -> str:
    owner, dataset = owner_and_dataset(db)
    resources: dict[str, Any] = {"node_count": nodes, "process_count_per_node": procs}
    if max_runtime_s is not None:
        resources["max_runtime_s"] = max_runtime_s
    with db.transaction() as s:
        job = Job(
            owner_id=owner,
            name="job",
            status=JobStatus.QUEUED,
            spec={"model": {"architecture": "resnet18"}, "parameters": {}, "resources": resources},
            architecture="resnet18",
            train_dataset_id=dataset,
            validation_dataset_id=dataset,
            node_count=nodes,
            process_count_per_node=procs,
        )
        s.add(job)
        s.flush()
        return job.id


def job_row(db: Database, job_id: str) -> Job:
    with db.read_session() as s:
        return s.get_one(Job, job_id)


def attempts(db: Database, job_id: str) -> list[Attempt]:
    with db.read_session() as s:
        return list(s.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number)))


def submitted_job(
    db: Database, settings: Settings, driver: ScriptedDriver, **kw: Any
) -> tuple[str, Reconciler]:
    job_id = add_job(db, **kw)
    reconciler = Reconciler(driver)
    reconciler.run_pass(db, settings)
    return job_id, reconciler


def bind(
    db: Database, job_id: str, ranks: int = 2, status: PlacementStatus = PlacementStatus.RUNNING
) -> None:
    """What the launchers' check-in leaves: one placement per node rank, the job running."""
    with db.transaction() as s:
        attempt = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        job = s.get_one(Job, job_id)
        names = [f"n{rank + 1}" for rank in range(ranks)]
        ids = dict(s.execute(select(Node.name, Node.id).where(Node.name.in_(names))).all())
        for rank, name in enumerate(names):
            s.add(
                Placement(
                    attempt_id=attempt.id,
                    job_id=job_id,
                    node_id=ids[name],
                    node_rank=rank,
                    units=job.process_count_per_node,
                    status=status,
                    lease_token=f"lease-{rank}",
                    lease_expires_at=utcnow() + timedelta(minutes=5),
                )
            )
        attempt.status = AttemptStatus.RUNNING
        job.status = JobStatus.RUNNING


def end(driver: ScriptedDriver, engine_id: str, ending: Ending, state: str, reason: str = "") -> None:
    driver.states[engine_id] = EngineJobState(
        id=engine_id,
        phase=Phase.ENDED,
        state=state,
        reason=reason,
        ending=ending,
        summary=f"Testcluster job {engine_id} ended {state} (exit code 1)",
        output_tail="Traceback (most recent call last):\nImportError: no module named torchyard",
    )


def test_the_inventory_becomes_the_engines_node_rows(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    driver.nodes.append(node("n3", units=8, status=NodeStatus.LOST))
    Reconciler(driver).run_pass(db, settings)
    with db.read_session() as s:
        rows = {n.name: n for n in s.scalars(select(Node))}
    assert sorted(rows) == ["n1", "n2", "n3"]
    assert {n: (r.engine, r.status, r.units, r.accelerator) for n, r in rows.items()} == {
        "n1": (EngineName.SLURM, NodeStatus.READY, 4, "gpu"),
        "n2": (EngineName.SLURM, NodeStatus.READY, 4, "gpu"),
        "n3": (EngineName.SLURM, NodeStatus.LOST, 8, "gpu"),
    }
    assert rows["n1"].info == {"engine": "slurm", "state": "Ready", "gpus": 4}
    assert rows["n1"].address == "10.0.0.1" and rows["n1"].agent_key_hash is None
    # The rows belong to a worker token nobody holds: no agent can speak for these nodes.
    with db.read_session() as s:
        owner = s.get_one(Token, rows["n1"].token_id)
    assert owner.name == "slurm engine" and owner.role == "worker"


def test_a_queued_job_gets_one_attempt_submitted_once_with_its_shape_and_a_launch_token(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver, max_runtime_s=600)
    (request,) = driver.submitted
    (attempt,) = attempts(db, job_id)
    assert (request.job_id, request.attempt_id, request.attempt_number) == (job_id, attempt.id, 1)
    assert (request.node_count, request.process_count_per_node, request.max_runtime_s) == (2, 2, 600.0)
    assert request.name == f"torchyard-{job_id}-1"
    with db.read_session() as s:
        token = s.scalars(select(Token).where(Token.token_hash == hash_token(request.launch_token))).one()
    assert token.attempt_id == attempt.id and token.revoked_at is None
    assert attempt.engine == EngineName.SLURM and attempt.engine_job_id == "E1"
    job = job_row(db, job_id)
    assert job.status == JobStatus.SCHEDULED
    assert job.wait_reason == "waiting in Testcluster (job E1): submitted"
    # Later passes poll it and submit nothing more.
    reconciler.run_pass(db, settings)
    assert len(driver.submitted) == 1 and driver.polled[-1] == ["E1"]


def test_a_pending_engine_job_gives_its_job_the_engines_reason(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    driver.states["E1"] = EngineJobState(id="E1", phase=Phase.PENDING, state="Pending", reason="Resources")
    reconciler.run_pass(db, settings)
    assert job_row(db, job_id).wait_reason == "waiting in Testcluster (job E1): Resources"
    assert attempts(db, job_id)[0].engine_reason == "Resources"


def test_a_job_the_engines_nodes_cannot_hold_waits_for_them_without_an_attempt(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id = add_job(db, nodes=1, procs=8)  # accepted when a larger node was there
    Reconciler(driver).run_pass(db, settings)
    job = job_row(db, job_id)
    assert job.status == JobStatus.QUEUED and attempts(db, job_id) == []
    assert job.wait_reason is not None and job.wait_reason.startswith("waiting for Testcluster's nodes: ")
    assert driver.submitted == []


def test_a_refused_submission_fails_the_job_with_engine_error_not_retried(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    driver.refuse = "sbatch refused the job: Invalid account"
    job_id, _ = submitted_job(db, settings, driver)
    job = job_row(db, job_id)
    assert job.status == JobStatus.FAILED and job.failure_code == "EngineError"
    assert job.failure_message == "sbatch refused the job: Invalid account" and job.restarts == 0
    (attempt,) = attempts(db, job_id)
    assert attempt.status == AttemptStatus.FAILED and attempt.engine_state == "REFUSED"


def test_an_attempt_never_recorded_as_submitted_is_submitted_again_with_a_fresh_token(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    first = driver.submitted[0]
    with db.transaction() as s:  # as if the API stopped between submit and its commit
        s.get_one(Attempt, first.attempt_id).engine_job_id = None
    reconciler.run_pass(db, settings)
    assert len(driver.submitted) == 2
    again = driver.submitted[1]
    assert (again.attempt_id, again.name) == (first.attempt_id, first.name)
    assert again.launch_token != first.launch_token
    with db.read_session() as s:
        old = s.scalars(select(Token).where(Token.token_hash == hash_token(first.launch_token))).one()
    assert old.revoked_at is not None
    assert len(attempts(db, job_id)) == 1


def test_an_engine_job_that_ended_with_no_launcher_report_is_engine_error_with_its_output(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    end(driver, "E1", Ending.FAILED, "FAILED", "NonZeroExitCode")
    reconciler.run_pass(db, settings)
    job = job_row(db, job_id)
    assert job.status == JobStatus.FAILED and job.failure_code == "EngineError" and job.restarts == 0
    assert job.failure_message is not None
    assert job.failure_message.startswith(
        "Testcluster job E1 ended FAILED (exit code 1) without any report from torchyard's launcher "
        "('torchyard launch'); the end of its output:\nTraceback"
    )
    (attempt,) = attempts(db, job_id)
    assert attempt.engine_state == "FAILED"
    with db.read_session() as s:
        tokens = list(s.scalars(select(Token).where(Token.attempt_id == attempt.id)))
    assert tokens and all(t.revoked_at is not None for t in tokens)


def test_an_engine_job_cancelled_from_outside_cancels_the_job(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    bind(db, job_id)
    end(driver, "E1", Ending.CANCELLED, "CANCELLED")
    reconciler.run_pass(db, settings)
    job = job_row(db, job_id)
    assert job.status == JobStatus.CANCELLED
    assert job.cancel_reason == "cancelled in Testcluster (job E1 was deleted)"
    with db.read_session() as s:
        assert set(s.scalars(select(Placement.status).where(Placement.job_id == job_id))) == {
            PlacementStatus.DONE
        }


def test_a_preempted_engine_job_requeues_the_job_without_a_restart(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    bind(db, job_id)
    end(driver, "E1", Ending.PREEMPTED, "PREEMPTED")
    reconciler.run_pass(db, settings)
    job = job_row(db, job_id)
    assert job.restarts == 0 and job.requeue_reason == "preempted"
    assert attempts(db, job_id)[0].status == AttemptStatus.PREEMPTED
    # The next pass hands it over again: a second attempt.
    reconciler.run_pass(db, settings)
    assert [a.number for a in attempts(db, job_id)] == [1, 2] and len(driver.submitted) == 2


def test_an_ended_engine_job_whose_launchers_did_not_report_loses_its_placements(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    bind(db, job_id)
    end(driver, "E1", Ending.FAILED, "FAILED")
    reconciler.run_pass(db, settings)
    job = job_row(db, job_id)
    # WorkerLostError is retryable: the job restarts.
    attempt = attempts(db, job_id)[0]
    assert attempt.status == AttemptStatus.FAILED and attempt.failure_code == "WorkerLostError"
    lost = "n1" if (attempt.failure_message or "").startswith("node n1:") else "n2"  # the first one wins
    assert (
        attempt.failure_message
        == f"node {lost}: Testcluster job E1 ended FAILED without a report from its launcher"
    )
    assert job.restarts == 1 and job.requeue_reason is not None
    assert job.requeue_reason.startswith(f"restarting after WorkerLostError on node {lost}")


@pytest.mark.parametrize("bound", [True, False], ids=["ranks-bound", "not-bound"])
def test_a_node_lost_before_any_launcher_started_requeues_the_job_without_a_restart(
    db: Database, settings: Settings, driver: ScriptedDriver, bound: bool
) -> None:
    """The engine placed the attempt on a node it had not yet seen go down, and then ended
    the engine job ``NODE_FAIL``: nothing ran, so the job waits again, neither failed
    (``EngineError``) nor restarted."""
    job_id, reconciler = submitted_job(db, settings, driver)
    if bound:
        bind(db, job_id, status=PlacementStatus.ASSIGNED)
    end(driver, "E1", Ending.NODE_LOST, "NODE_FAIL", "NodeDown")
    reconciler.run_pass(db, settings)
    job = job_row(db, job_id)
    assert job.failure_code is None and job.restarts == 0
    reason = "Testcluster job E1 lost a node before its launcher started (NODE_FAIL: NodeDown)"
    assert job.requeue_reason == reason
    first = attempts(db, job_id)[0]
    assert first.status == AttemptStatus.PREEMPTED and first.failure_message == f"released: {reason}"
    with db.read_session() as s:
        assert set(s.scalars(select(Placement.status).where(Placement.job_id == job_id))) <= {
            PlacementStatus.DONE
        }
    # The job is handed over again as a new attempt.
    reconciler.run_pass(db, settings)
    assert len(driver.submitted) == 2 and len(attempts(db, job_id)) == 2


def test_a_failed_engine_job_with_ranks_bound_but_never_taken_up_is_engine_error(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    bind(db, job_id, status=PlacementStatus.ASSIGNED)
    end(driver, "E1", Ending.FAILED, "FAILED", "NonZeroExitCode")
    reconciler.run_pass(db, settings)
    job = job_row(db, job_id)
    assert job.status == JobStatus.FAILED and job.failure_code == "EngineError" and job.restarts == 0


def test_an_unschedulable_gang_released_by_the_engine_waits_in_the_queue_with_its_reason(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    reason = "1 of 2 pods unschedulable: Insufficient nvidia.com/gpu"
    end(driver, "E1", Ending.UNSCHEDULABLE, "Unschedulable", reason)
    reconciler.run_pass(db, settings)
    job = job_row(db, job_id)
    assert job.restarts == 0 and job.failure_code is None
    assert job.requeue_reason == f"waiting in Testcluster: {reason}"
    attempt = attempts(db, job_id)[0]
    assert (
        attempt.status == AttemptStatus.PREEMPTED
        and attempt.failure_message == f"released: waiting in Testcluster: {reason}"
    )


def test_a_node_lost_from_the_inventory_loses_its_placements(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    bind(db, job_id)
    driver.nodes = [node("n1"), node("n2", status=NodeStatus.LOST)]
    reconciler.run_pass(db, settings)
    attempt = attempts(db, job_id)[0]
    assert attempt.failure_code == "WorkerLostError"
    assert attempt.failure_message == "node n2 is NotReady in Testcluster"
    # A node gone from the inventory altogether is lost too.
    driver.nodes = [node("n2")]
    reconciler.run_pass(db, settings)
    with db.read_session() as s:
        assert s.scalars(select(Node.status).where(Node.name == "n1")).one() == NodeStatus.LOST


def test_the_engine_job_of_an_attempt_ended_in_torchyard_is_cancelled_once_a_while(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    bind(db, job_id)
    driver.states["E1"] = EngineJobState(id="E1", phase=Phase.RUNNING, state="Running")
    with db.transaction() as s:  # rank 0 reported success (the job's own end is not read here)
        attempt = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        attempt.status = AttemptStatus.SUCCEEDED
        attempt.finished_at = utcnow()
    reconciler.run_pass(db, settings)
    assert driver.cancelled == []  # a succeeded attempt's launchers exit by themselves first
    with db.transaction() as s:
        attempt = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        attempt.finished_at = utcnow() - timedelta(seconds=LAUNCHER_EXIT_S + 1)
    reconciler.run_pass(db, settings)
    reconciler.run_pass(db, settings)
    assert driver.cancelled == ["E1"]  # asked once, not at every pass


def test_a_user_cancel_of_a_submitted_job_settles_when_the_engine_job_ends(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    job_id, reconciler = submitted_job(db, settings, driver)
    with db.transaction() as s:
        request_cancel(s, s.get_one(Job, job_id), "cancelled by its owner")
    reconciler.run_pass(db, settings)
    end(driver, "E1", Ending.CANCELLED, "CANCELLED")
    reconciler.run_pass(db, settings)
    assert job_row(db, job_id).status == JobStatus.CANCELLED


def test_an_engine_that_does_not_answer_changes_nothing(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    driver.silent = True
    job_id, _ = submitted_job(db, settings, driver)
    assert job_row(db, job_id).status == JobStatus.QUEUED and driver.submitted == []
    with db.read_session() as s:
        assert list(s.scalars(select(Node))) == []


def test_teams_quotas_are_admitted_before_the_hand_over_and_their_account_goes_along(
    db: Database, settings: Settings, driver: ScriptedDriver
) -> None:
    from sqlalchemy import update

    from service.services import teams
    from service.services.teams import QuotaSpec

    with db.transaction() as s:
        vision = teams.create_team(s, "vision", [QuotaSpec("default", 4, 0)], slurm_account="vision-lab").id
    first, second = add_job(db, nodes=1, procs=4), add_job(db, nodes=1, procs=4)
    with db.transaction() as s:
        s.execute(update(Job).where(Job.id.in_([first, second])).values(team_id=vision))
    Reconciler(driver).run_pass(db, settings)
    assert [r.job_id for r in driver.submitted] == [first]
    assert driver.submitted[0].account == "vision-lab"
    # Held by torchyard before Slurm ever sees it, though Slurm has room: the quota says so.
    assert job_row(db, second).status == JobStatus.QUEUED
    assert (
        job_row(db, second).wait_reason
        == "team vision at its quota: 4 of 4 GPUs in pool default, borrowing 0 of 0"
    )

"""The job state machine: legal transitions, refused illegal ones, database guards."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from service.config import Settings
from service.db.engine import Database
from service.db.migrate import upgrade
from service.db.models import Attempt, Dataset, Job, JobEvent, Token
from service.services.jobs import transition
from service.states import TRANSITIONS, JobStatus
from torchyard.contract.errors import IllegalTransitionError
from torchyard.contract.failures import Failure


@pytest.fixture
def db(db_url: str) -> Database:
    upgrade(db_url)
    database = Database(db_url)
    yield database  # type: ignore[misc]
    database.dispose()


def _job(db: Database, status: JobStatus = JobStatus.QUEUED) -> str:
    with db.transaction() as s:
        owner = Token(name="u", role="user", token_hash=Token.__name__ + str(datetime.now(UTC).timestamp()))
        s.add(owner)
        s.flush()
        ds = Dataset(
            owner_id=owner.id,
            name="d",
            source="upload",
            storage_path="x",
            classes=["a", "b"],
            class_counts={"a": 1, "b": 1},
            num_images=2,
            size_bytes=1,
            sha256="0" * 64,
        )
        s.add(ds)
        s.flush()
        job = Job(
            owner_id=owner.id,
            name="j",
            status=status.value,
            spec={},
            architecture="resnet18",
            train_dataset_id=ds.id,
            validation_dataset_id=ds.id,
            node_count=1,
            process_count_per_node=1,
            finished_at=datetime.now(UTC) if status.is_final() else None,
            failure_code="RankFailedError" if status is JobStatus.FAILED else None,
            model_sha256="f" * 64 if status is JobStatus.SUCCEEDED else None,
        )
        s.add(job)
        s.flush()
        return job.id


# Sorted: the targets are sets, and every xdist worker must collect the same order.
LEGAL = [(a, b) for a, targets in TRANSITIONS.items() for b in sorted(targets)]
ILLEGAL = [(a, b) for a, b in itertools.product(JobStatus, JobStatus) if b not in TRANSITIONS[a]]


@pytest.mark.parametrize(("current", "new"), LEGAL)
def test_every_legal_transition(db: Database, current: JobStatus, new: JobStatus) -> None:
    job_id = _job(db, current)
    with db.transaction() as s:
        job = s.get(Job, job_id)
        assert job is not None
        if new is JobStatus.SUCCEEDED:
            job.model_sha256 = "a" * 64
        failure = (
            Failure(code="RankFailedError", message="boom", rank=1, node="n")
            if new is JobStatus.FAILED
            else None
        )
        transition(s, job, new, "because", failure=failure)
    with db.read_session() as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert job.status == new.value
        assert (job.finished_at is not None) == new.is_final()
        events = list(s.scalars(sa.select(JobEvent).where(JobEvent.job_id == job_id)))
        assert [(e.status, e.message) for e in events] == [(new.value, "because")]


@pytest.mark.parametrize(("current", "new"), ILLEGAL[::3])
def test_illegal_transitions_are_refused(db: Database, current: JobStatus, new: JobStatus) -> None:
    job_id = _job(db, current)
    with db.transaction() as s:
        job = s.get(Job, job_id)
        assert job is not None
        with pytest.raises(IllegalTransitionError):
            transition(s, job, new)
        assert job.status == current.value


def test_final_states_are_terminal() -> None:
    for status in JobStatus:
        assert (TRANSITIONS[status] == frozenset()) == status.is_final()


@pytest.mark.both_databases
@pytest.mark.parametrize(
    "values",
    [
        {"status": "sleeping"},
        {"status": "succeeded"},  # final without finish time (and without a model)
        {"status": "failed", "finished_at": datetime.now(UTC)},  # failed without a code
        {"status": "succeeded", "finished_at": datetime.now(UTC)},  # succeeded without a model
        {"finished_at": datetime.now(UTC)},  # queued with a finish time
        {"node_count": 0},
    ],
)
def test_constraints_make_bad_states_impossible(db: Database, values: dict[str, object]) -> None:
    job_id = _job(db)
    with pytest.raises(IntegrityError), db.transaction() as s:
        s.execute(sa.update(Job).where(Job.id == job_id).values(**values))


@pytest.mark.both_databases
def test_one_live_attempt_per_job(db: Database) -> None:
    job_id = _job(db, JobStatus.SCHEDULED)
    with db.transaction() as s:
        s.add(Attempt(job_id=job_id, number=1, status="running", master_addr="a", master_port=1))
    with pytest.raises(IntegrityError), db.transaction() as s:
        s.add(Attempt(job_id=job_id, number=2, status="scheduled", master_addr="a", master_port=1))
    with db.transaction() as s:  # a finished attempt beside the live one is fine
        s.add(Attempt(job_id=job_id, number=3, status="failed", master_addr="a", master_port=1))


def test_settings_refuse_a_lease_shorter_than_the_heartbeat(tmp_path: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"TORCHYARD_LEASE_TIMEOUT_S \(4\) must be larger than TORCHYARD_HEARTBEAT_INTERVAL_S \(5\)",
    ):
        Settings(heartbeat_interval_s=5, lease_timeout_s=4)
    with pytest.raises(ValueError, match="sqlite:// or postgresql://"):
        Settings(database_url="mysql://x")

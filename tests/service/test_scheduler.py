"""Gang scheduler: placement all at once or not at all, strict FIFO, wait reasons, ports.

Runs on SQLite and PostgreSQL, directly against the service functions (no app, no
reaper running beside it), so every pass is one the test made.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from service.config import Settings
from service.db.engine import Database
from service.db.migrate import upgrade
from service.db.models import Attempt, Job, Node, Placement
from service.db.types import utcnow
from service.services.scheduler import run_pass, schedule
from service.states import JobStatus
from tests.support.queue_fill import owner_and_dataset
from tests.support.worker_fixtures import finish_job

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    upgrade(db_url)
    database = Database(db_url)
    yield database
    database.dispose()


@pytest.fixture
def sched_settings(make_settings: Any) -> Settings:
    settings: Settings = make_settings(master_port_min=30100, master_port_max=30199)
    return settings


@pytest.fixture
def owner(db: Database) -> tuple[str, str]:
    """A token id and a dataset id for jobs to reference."""
    return owner_and_dataset(db)


def add_node(db: Database, owner: tuple[str, str], name: str, units: int, address: str | None = None) -> str:
    with db.transaction() as s:
        node = Node(
            name=name,
            address=address or f"host-{name}",
            units=units,
            accelerator="cpu",
            token_id=owner[0],
        )
        s.add(node)
        s.flush()
        return node.id


_created = [0]


def add_job(db: Database, owner: tuple[str, str], nodes: int, procs: int, *, priority: int = 0) -> str:
    _created[0] += 1
    now = utcnow() + timedelta(milliseconds=_created[0])  # distinct, increasing submission times
    spec = {
        "model": {"architecture": "resnet18"},
        "parameters": {},
        "resources": {"node_count": nodes, "process_count_per_node": procs},
    }
    with db.transaction() as s:
        job = Job(
            owner_id=owner[0],
            name=f"job{_created[0]}",
            status="queued",
            spec=spec,
            architecture="resnet18",
            train_dataset_id=owner[1],
            validation_dataset_id=owner[1],
            node_count=nodes,
            process_count_per_node=procs,
            priority=priority,
            created_at=now,
            updated_at=now,
        )
        s.add(job)
        s.flush()
        return job.id


def job_row(db: Database, job_id: str) -> Job:
    with db.read_session() as s:
        return s.get_one(Job, job_id)


def placements(db: Database, job_id: str) -> list[tuple[str, int, int]]:
    """(node name, node rank, units) of the job's placements."""
    with db.read_session() as s:
        rows = s.execute(
            select(Node.name, Placement.node_rank, Placement.units)
            .join(Node, Node.id == Placement.node_id)
            .where(Placement.job_id == job_id)
            .order_by(Placement.node_rank)
        ).all()
        return [tuple(r) for r in rows]  # type: ignore[misc]


def test_two_gang_jobs_on_three_nodes_run_one_after_the_other(
    db: Database, sched_settings: Settings, owner: tuple[str, str]
) -> None:
    for name in ("n1", "n2", "n3"):
        add_node(db, owner, name, 1)
    first = add_job(db, owner, 2, 1)
    second = add_job(db, owner, 2, 1)

    result = run_pass(db, sched_settings)
    assert result.scheduled == [first]
    assert job_row(db, first).status == "scheduled"
    got = placements(db, first)
    assert [p[1] for p in got] == [0, 1] and len({p[0] for p in got}) == 2
    # The second job holds nothing: one node is free, but it needs two.
    assert placements(db, second) == []
    waiting = job_row(db, second)
    assert waiting.status == "queued"
    assert waiting.wait_reason == "waiting for 2 nodes with 1 free unit; 1 available"

    # Nothing changes while the first runs.
    assert run_pass(db, sched_settings).scheduled == []
    assert placements(db, second) == []

    finish_job(db, first)
    assert run_pass(db, sched_settings).scheduled == [second]
    assert job_row(db, second).wait_reason is None
    assert len(placements(db, second)) == 2


def test_attempt_shape_and_lease(db: Database, sched_settings: Settings, owner: tuple[str, str]) -> None:
    add_node(db, owner, "big", 4, address="192.0.2.10")
    add_node(db, owner, "small", 2, address="192.0.2.11")
    job_id = add_job(db, owner, 2, 2)
    before = utcnow()
    assert run_pass(db, sched_settings).scheduled == [job_id]
    with db.read_session() as s:
        attempt = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        rows = list(
            s.scalars(select(Placement).where(Placement.job_id == job_id).order_by(Placement.node_rank))
        )
        rank0 = s.get_one(Node, rows[0].node_id)
        job = s.get_one(Job, job_id)
    assert attempt.number == 1 and job.attempts_count == 1
    # Best fit: the node with the least room left is rank 0, and its address is the master's.
    assert rank0.name == "small" and attempt.master_addr == "192.0.2.11"
    assert 30100 <= attempt.master_port <= 30199
    assert {p.units for p in rows} == {2}
    assert len({p.lease_token for p in rows}) == 2 and all(len(p.lease_token) >= 32 for p in rows)
    for p in rows:
        remaining = (p.lease_expires_at - before).total_seconds()
        assert sched_settings.lease_timeout_s - 1 <= remaining <= sched_settings.lease_timeout_s + 5


def test_strict_fifo_blocks_backfill(db: Database, sched_settings: Settings, owner: tuple[str, str]) -> None:
    add_node(db, owner, "a", 2)
    add_node(db, owner, "b", 2)
    running = add_job(db, owner, 1, 2)
    assert run_pass(db, sched_settings).scheduled == [running]
    big = add_job(db, owner, 2, 2)
    small = add_job(db, owner, 1, 1)  # would fit on the free node, but arrived later
    result = run_pass(db, sched_settings)
    assert result.scheduled == []
    assert job_row(db, big).wait_reason == "waiting for 2 nodes with 2 free units; 1 available"
    reason = job_row(db, small).wait_reason
    assert reason is not None and "queued behind job" in reason and big in reason

    finish_job(db, running)
    assert run_pass(db, sched_settings).scheduled == [big]
    finish_job(db, big)
    assert run_pass(db, sched_settings).scheduled == [small]


def test_priority_goes_first(db: Database, sched_settings: Settings, owner: tuple[str, str]) -> None:
    add_node(db, owner, "a", 1)
    low = add_job(db, owner, 1, 1)
    high = add_job(db, owner, 1, 1, priority=5)
    assert run_pass(db, sched_settings).scheduled == [high]
    assert job_row(db, low).wait_reason == "waiting for 1 node with 1 free unit; 0 available"


def test_job_the_cluster_cannot_run_now_does_not_block(
    db: Database, sched_settings: Settings, owner: tuple[str, str]
) -> None:
    add_node(db, owner, "a", 2)
    add_node(db, owner, "b", 2)
    too_wide = add_job(db, owner, 3, 1)  # accepted when a third node existed
    too_deep = add_job(db, owner, 1, 4)
    fits = add_job(db, owner, 2, 2)
    assert run_pass(db, sched_settings).scheduled == [fits]
    assert (
        job_row(db, too_wide).wait_reason
        == "waiting for 3 ready nodes with at least 1 processing unit; the cluster has 2 now"
    )
    assert (
        job_row(db, too_deep).wait_reason
        == "waiting for 1 ready node with at least 4 processing units; the cluster has 0 now"
    )


def test_lost_and_silent_nodes_are_not_used(
    db: Database, sched_settings: Settings, owner: tuple[str, str]
) -> None:
    lost = add_node(db, owner, "lost", 1)
    silent = add_node(db, owner, "silent", 1)
    with db.transaction() as s:
        s.get_one(Node, lost).status = "lost"
        s.get_one(Node, silent).last_heartbeat_at = utcnow() - timedelta(seconds=600)
    job = add_job(db, owner, 1, 1)
    assert run_pass(db, sched_settings).scheduled == []
    assert "the cluster has 0 now" in (job_row(db, job).wait_reason or "")
    add_node(db, owner, "fresh", 1)
    assert run_pass(db, sched_settings).scheduled == [job]


def test_rendezvous_ports_are_not_shared_on_one_address(
    db: Database, make_settings: Any, owner: tuple[str, str]
) -> None:
    settings: Settings = make_settings(master_port_min=30200, master_port_max=30201)
    # Two nodes on one host (two agents on one machine) share an address.
    add_node(db, owner, "x", 1, address="198.51.100.7")
    add_node(db, owner, "y", 1, address="198.51.100.7")
    add_node(db, owner, "z", 1, address="198.51.100.7")
    jobs = [add_job(db, owner, 1, 1) for _ in range(3)]
    assert run_pass(db, settings).scheduled == jobs[:2]
    with db.read_session() as s:
        ports = set(s.scalars(select(Attempt.master_port)))
    assert ports == {30200, 30201}
    reason = job_row(db, jobs[2]).wait_reason
    assert reason is not None and "rendezvous port" in reason
    finish_job(db, jobs[0])
    assert run_pass(db, settings).scheduled == [jobs[2]]


def test_concurrent_passes_never_overcommit(
    db: Database, sched_settings: Settings, owner: tuple[str, str]
) -> None:
    for i in range(3):
        add_node(db, owner, f"n{i}", 2)
    jobs = [add_job(db, owner, 1 + i % 2, 1 + (i // 2) % 2) for i in range(12)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        try:
            barrier.wait()
            for _ in range(3):
                with db.transaction() as s:
                    schedule(s, sched_settings)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with db.read_session() as s:
        held = dict(
            s.execute(
                select(Placement.node_id, func.sum(Placement.units))
                .where(Placement.status != "done")
                .group_by(Placement.node_id)
            ).all()
        )
        units = dict(s.execute(select(Node.id, Node.units)).all())
        scheduled = list(s.scalars(select(Job.id).where(Job.status == JobStatus.SCHEDULED.value)))
        attempts = s.scalar(select(func.count(Attempt.id)))
    assert all(held[n] <= units[n] for n in held)
    assert attempts == len(scheduled) >= 1
    # Every scheduled job holds exactly its gang.
    for job_id in scheduled:
        job = job_row(db, job_id)
        assert len(placements(db, job_id)) == job.node_count
    assert set(scheduled) <= set(jobs)


def test_multi_node_gang_never_mixes_loopback_and_remote_nodes() -> None:
    from service.services.scheduler import NodeCapacity, _choose

    def node(name: str, address: str) -> NodeCapacity:
        return NodeCapacity(id=name, name=name, address=address, units=1, free=1)

    mixed = [node("local", "127.0.0.1"), node("remote", "10.0.0.2")]
    assert _choose(mixed, 2, 1) is None
    assert [c.name for c in _choose(mixed, 1, 1) or []] in (["local"], ["remote"])
    same_host = [node("a", "127.0.0.1"), node("b", "127.0.0.1"), node("r", "10.0.0.2")]
    assert {c.name for c in _choose(same_host, 2, 1) or []} == {"a", "b"}
    remote = [node("l", "127.0.0.1"), node("x", "10.0.0.2"), node("y", "10.0.0.3")]
    assert {c.name for c in _choose(remote, 2, 1) or []} == {"x", "y"}

"""The cluster view and its limits, on SQLite and PostgreSQL.

Limits count the ready nodes and those heard from within TORCHYARD_NODE_MEMORY_S (a node
lost longer ago counts for nothing; the memory itself is in tests/service/test_reaper_and_outages.py); a queued job that the shrunken cluster can no longer run keeps
waiting with a reason that says so, and starts once nodes come back.
(The single-limit messages are in tests/service/test_jobs_validation.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job, Node
from service.db.types import utcnow
from service.services.cluster import submission_limits
from service.services.scheduler import run_pass
from service.states import NodeStatus
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


@pytest.fixture
def db(settings: Settings, client: TestClient) -> Iterator[Database]:
    database = Database(settings.sqlalchemy_url)
    yield database
    database.dispose()


@pytest.fixture
def data(client: TestClient, settings: Settings) -> dict[str, str]:
    me = token_id(client, client.headers["Authorization"].split()[1])
    return {
        "train": insert_dataset(settings, me, name="train"),
        "val": insert_dataset(settings, me, name="val"),
    }


def _submit(client: TestClient, data: dict[str, str], nodes: int = 1, ppn: int = 1, **extra: Any) -> Any:
    spec = job_spec(
        data["train"], data["val"], resources={"node_count": nodes, "process_count_per_node": ppn}
    )
    spec.update(extra)
    return client.post("/v1/jobs", json=spec)


def _lose(db: Database, name: str, *, how: str = "marked") -> None:
    """Make a node lost an hour ago (longer than TORCHYARD_NODE_MEMORY_S): marked so by the
    reaper, or merely silent past the lease timeout."""
    with db.transaction() as s:
        values: dict[str, Any] = {"last_heartbeat_at": utcnow() - timedelta(hours=1)}
        if how == "marked":
            values["status"] = NodeStatus.LOST.value
        s.execute(update(Node).where(Node.name == name).values(**values))


def _job(db: Database, job_id: str) -> Job:
    with db.read_session() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job


def test_cluster_view_lists_nodes_load_and_limits(
    client: TestClient, settings: Settings, db: Database, data: dict[str, str]
) -> None:
    worker = create_token(client, "worker")
    register_node(client, worker, "node-a", units=4, address="10.0.0.11")
    register_node(client, worker, "node-b", units=2, address="10.0.0.12")
    view = client.get("/v1/cluster").json()
    assert view["max_nodes"] == 2
    assert view["max_nodes_source"] == "ready_nodes"
    assert view["max_units_per_node"] == 4
    assert (view["ready_nodes"], view["lost_nodes"], view["total_units"], view["free_units"]) == (2, 0, 6, 6)
    a = view["nodes"][0]
    assert a["name"] == "node-a"
    assert a["address"] == "10.0.0.11"
    assert (a["units"], a["used_units"], a["free_units"]) == (4, 0, 4)
    assert a["accelerator"] == "cpu"
    assert a["status"] == "ready"
    assert a["last_heartbeat_at"] and a["seconds_since_heartbeat"] < 5
    assert a["running_attempts"] == [] and a["attempts"] == []

    # A 2-node × 2-process job is placed on both nodes: the view shows who holds what.
    job_id = _submit(client, data, nodes=2, ppn=2).json()["id"]
    # The app's own reaper runs a scheduling pass every second: on a busy machine it
    # may place the job before this pass does. Either way it is placed exactly once.
    assert run_pass(db, settings).scheduled in ([job_id], [])
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "scheduled"
    view = client.get("/v1/cluster").json()
    by_name = {n["name"]: n for n in view["nodes"]}
    assert (by_name["node-a"]["used_units"], by_name["node-a"]["free_units"]) == (2, 2)
    assert (by_name["node-b"]["used_units"], by_name["node-b"]["free_units"]) == (2, 0)
    assert view["free_units"] == 2
    shares = [by_name[n]["attempts"][0] for n in ("node-a", "node-b")]
    assert {s["job_id"] for s in shares} == {job_id}
    assert sorted(s["node_rank"] for s in shares) == [0, 1]
    assert all(s["units"] == 2 and s["status"] == "assigned" and s["attempt_number"] == 1 for s in shares)
    assert by_name["node-a"]["running_attempts"] == [shares[0]["attempt_id"]]
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "scheduled"
    assert sorted(job["nodes"]) == ["node-a", "node-b"]

    # Another user sees the load but not whose job it is.
    other = create_token(client, "user", "eve")
    seen = client.get("/v1/cluster", headers=auth(other)).json()
    assert [n["attempts"][0]["job_id"] for n in seen["nodes"]] == [None, None]
    assert [n["used_units"] for n in seen["nodes"]] == [2, 2]
    # Workers do not read the cluster view.
    assert client.get("/v1/cluster", headers=auth(worker)).status_code == 403


@pytest.mark.parametrize("how", ["marked", "silent"])
def test_lost_nodes_are_not_counted(client: TestClient, db: Database, data: dict[str, str], how: str) -> None:
    worker = create_token(client, "worker")
    register_node(client, worker, "big", units=8)
    register_node(client, worker, "small", units=4)
    assert _submit(client, data, nodes=2, ppn=8).status_code == 201
    _lose(db, "big", how=how)

    view = client.get("/v1/cluster").json()
    big = next(n for n in view["nodes"] if n["name"] == "big")
    assert (big["status"], big["free_units"]) == ("lost", 0)
    assert (view["max_nodes"], view["max_units_per_node"], view["ready_nodes"], view["lost_nodes"]) == (
        1,
        4,
        1,
        1,
    )
    assert (view["total_units"], view["free_units"]) == (4, 4)

    r = _submit(client, data, nodes=2, ppn=8)
    assert r.status_code == 422
    body = r.json()
    assert body["code"] == "ResourceLimitError"
    assert "node_count 2 exceeds the cluster's 1 node" in body["message"]
    assert "process_count_per_node 8 exceeds the 4 processing units of the largest node" in body["message"]
    # Both problems, each with its field, value and limit.
    assert body["details"] == [
        {"field": "resources.node_count", "value": 2, "limit": 1, "message": body["details"][0]["message"]},
        {
            "field": "resources.process_count_per_node",
            "value": 8,
            "limit": 4,
            "message": body["details"][1]["message"],
        },
    ]
    assert _submit(client, data, nodes=1, ppn=4).status_code == 201

    # The node speaks again: it counts again.
    register_node(client, worker, "big", units=8)
    assert _submit(client, data, nodes=2, ppn=8).status_code == 201


def test_no_ready_node_at_all(client: TestClient, db: Database, data: dict[str, str]) -> None:
    r = _submit(client, data)
    assert r.status_code == 422
    assert "node_count 1 exceeds the cluster's 0 nodes" in r.json()["message"]
    assert "the cluster has no ready nodes (start a worker)" in r.json()["message"]
    register_node(client, create_token(client, "worker"), "only", units=1)
    _lose(db, "only")
    assert _submit(client, data).status_code == 422


def test_max_nodes_setting_is_reported_and_named(make_settings: Any) -> None:
    from service.api.app import create_app

    settings = make_settings(max_nodes=3)
    with TestClient(create_app(settings)) as c:
        c.headers["Authorization"] = f"Bearer {settings.admin_token_path.read_text().strip()}"
        register_node(c, create_token(c, "worker"), "n1", units=2)
        view = c.get("/v1/cluster").json()
        assert (view["max_nodes"], view["max_nodes_source"], view["ready_nodes"]) == (3, "setting", 1)
        me = token_id(c, c.headers["Authorization"].split()[1])
        t, v = insert_dataset(settings, me), insert_dataset(settings, me)
        r = c.post("/v1/jobs", json=job_spec(t, v, resources={"node_count": 4}))
        assert r.status_code == 422
        assert r.json()["message"] == "node_count 4 exceeds the cluster's 3 nodes (TORCHYARD_MAX_NODES)"
        assert r.json()["details"][0]["limit"] == 3

        # Accepted by the setting, but the registry has one node: it waits, saying so.
        job_id = c.post("/v1/jobs", json=job_spec(t, v, resources={"node_count": 3})).json()["id"]
        db = Database(settings.sqlalchemy_url)
        try:
            result = run_pass(db, settings)
        finally:
            db.dispose()
        assert job_id in result.waiting
        reason = c.get(f"/v1/jobs/{job_id}").json()["reason"]
        assert "3 ready nodes" in reason and "the cluster has 1" in reason


def test_job_that_no_longer_fits_keeps_waiting_and_starts_when_nodes_return(
    client: TestClient, settings: Settings, db: Database, data: dict[str, str]
) -> None:
    worker = create_token(client, "worker")
    register_node(client, worker, "n1", units=2)
    register_node(client, worker, "n2", units=2)
    # n2 is lost before the scheduling pass the submission asks for, but was heard recently
    # enough for the job to be valid when submitted; then it is long gone.
    with db.transaction() as s:
        s.execute(update(Node).where(Node.name == "n2").values(status=NodeStatus.LOST.value))
    big = _submit(client, data, nodes=2, ppn=2).json()["id"]
    _lose(db, "n2")
    small = _submit(client, data, nodes=1, ppn=1).json()["id"]

    result = run_pass(db, settings)
    # Not failed: it waits, with a reason naming what it needs and what the cluster has.
    job = client.get(f"/v1/jobs/{big}").json()
    assert job["status"] == "queued"
    assert job["failure"] is None
    assert "2 ready nodes" in job["reason"] and "the cluster has 1" in job["reason"]
    assert result.waiting[big] == job["reason"]
    # A job the present cluster can never run does not hold up those behind it (placed by
    # this pass or by the one its submission asked for).
    assert big not in result.scheduled and _job(db, small).status == "scheduled"

    # Also for process_count_per_node: the big node is lost, the job waits for one with 4 units.
    register_node(client, worker, "wide", units=4)
    with db.transaction() as s:  # silent before the pass its submission asks for
        s.execute(
            update(Node).where(Node.name == "wide").values(last_heartbeat_at=utcnow() - timedelta(minutes=1))
        )
    wide = _submit(client, data, nodes=1, ppn=4).json()["id"]
    _lose(db, "wide", how="silent")
    run_pass(db, settings)
    reason = client.get(f"/v1/jobs/{wide}").json()["reason"]
    assert "4 processing units" in reason and "the cluster has 0" in reason

    # The lost nodes come back: both start (n1 has 1 free unit left, n2 and wide are empty).
    # Each registration asks for a pass: n3 and n2 first, so that big takes those two.
    register_node(client, worker, "n3", units=2)
    register_node(client, worker, "n2", units=2)
    register_node(client, worker, "wide", units=4)
    run_pass(db, settings)  # (or the passes the registrations asked for)
    assert _job(db, wide).status == "scheduled"
    assert _job(db, big).status == "scheduled"
    assert _job(db, big).wait_reason is None


def test_submission_limits_count_ready_and_recently_seen_nodes_in_one_look(
    client: TestClient, db: Database, data: dict[str, str], make_settings: Any
) -> None:
    """The limits a submission is checked against, read in one query: the ready nodes, and
    besides them every node of the engine heard from within the memory (lost, silent or
    drained), each counted once; a node silent for longer, or another engine's, counts for
    nothing. A change to the registry counts from the next submission on."""
    worker = create_token(client, "worker")
    owner = token_id(client, client.headers["Authorization"].split()[1])
    now = utcnow()
    rows = [
        # name, units, status, seconds since its last heartbeat, engine
        ("ready-2", 2, NodeStatus.READY, 0, "agents"),
        ("ready-4", 4, NodeStatus.READY, 0, "agents"),
        ("silent-8", 8, NodeStatus.READY, 120, "agents"),  # past the lease: lost, not marked yet
        ("lost-16", 16, NodeStatus.LOST, 300, "agents"),
        ("drained-3", 3, NodeStatus.DRAINED, 5, "agents"),
        ("gone-64", 64, NodeStatus.LOST, 3600, "agents"),  # beyond the memory
        ("slurm-32", 32, NodeStatus.READY, 0, "slurm"),  # another engine's inventory
    ]
    with db.transaction() as s:
        for name, units, status, ago, engine in rows:
            s.add(
                Node(
                    name=name,
                    address="10.0.0.1",
                    units=units,
                    accelerator="cpu",
                    status=status.value,
                    token_id=owner,
                    last_heartbeat_at=now - timedelta(seconds=ago),
                    engine=engine,
                )
            )

    def limits(**overrides: Any) -> tuple[int, int, int, str]:
        settings = make_settings(**{"lease_timeout_s": 60, "node_memory_s": 600, **overrides})
        with db.read_session() as s:
            got = submission_limits(s, settings, now)
        return got.max_nodes, got.max_units_per_node, got.ready_nodes, got.max_nodes_source

    assert limits() == (5, 16, 2, "seen_nodes")
    assert limits(max_nodes=10) == (10, 16, 2, "setting")
    assert limits(node_memory_s=0) == (2, 4, 2, "ready_nodes")
    assert limits(node_memory_s=0, max_nodes=1) == (1, 4, 2, "setting")
    assert limits(lease_timeout_s=600) == (5, 16, 3, "seen_nodes")  # the silent node is ready again

    # Through the API: the limits follow the registry from one submission to the next.
    assert _submit(client, data, nodes=5, ppn=16).status_code == 201
    r = _submit(client, data, nodes=6)
    assert r.status_code == 422 and r.json()["details"][0]["limit"] == 5
    register_node(client, worker, "new-one", units=1)
    assert _submit(client, data, nodes=6).status_code == 201
    _lose(db, "lost-16")  # an hour ago: beyond the memory
    r = _submit(client, data, nodes=1, ppn=16)
    assert r.status_code == 422 and r.json()["details"][0]["limit"] == 8

"""The reaper's grace clock is the cluster's on PostgreSQL (docs/restarts.md, last bullet).

Two ``torchyard serve`` replicas, A and B, on one fresh PostgreSQL database; two
scripted nodes that talk to A only (as an agent configured with A's address does). A is
SIGKILLed and stays down for longer than the lease timeout while B runs on: B must not
take the nodes' silence for death (nobody could hear them). When A is back, the node
that heartbeats again keeps its node and its running job; the node that stays silent is
declared lost, one full lease period after A began listening again, not before.

With ``TORCHYARD_REPLICA_MEMORY_S=0`` (a vanished replica ignored) B declares the silent
nodes lost while A is still down: the protection above is the cluster clock's doing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from service.config import Settings
from service.services.replicas import cluster_hearing
from tests.conftest import PG_ADMIN_URL
from tests.support.api_process import ApiProcess
from tests.support.factories import auth, insert_dataset, job_spec
from tests.support.fake_agent import FakeAgent
from tests.support.worker_fixtures import user_client, worker_token

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

LEASE_S = 3.0
SETTINGS = {
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5",
    "TORCHYARD_LEASE_TIMEOUT_S": str(LEASE_S),
    "TORCHYARD_REAPER_INTERVAL_S": "0.2",
    "TORCHYARD_CLAIM_POLL_TIMEOUT_S": "2",
}
# A stays down this long: before the cluster clock, B lost A's nodes after one lease.
DOWN_S = 2.5 * LEASE_S


@pytest.fixture
def fresh_pg(pg_database: str) -> Iterator[str]:
    """A database of this test's own (``serve`` migrates it); skipped without PostgreSQL."""
    name = f"torchyard_clock_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield admin.url.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _start_pair(url: str, tmp_path: Path, extra: dict[str, str]) -> list[ApiProcess]:
    data = tmp_path / "data"  # shared by both, as on a shared volume
    apis = [ApiProcess(data, url, settings={**SETTINGS, **extra}, name=n) for n in ("a", "b")]
    apis[0].start().wait_ready()  # the first applies the migrations
    apis[1].start().wait_ready()
    return apis


def _node_statuses(engine: sa.Engine) -> dict[str, str]:
    """As the reaper marked them in the database (the cluster view also shows a node silent
    past the lease as lost, which is not what is tested here)."""
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT name, status FROM nodes")).all())  # type: ignore[arg-type]


def _running_job(a: ApiProcess, url: str) -> tuple[httpx.Client, str, FakeAgent, FakeAgent]:
    """A 1-node job running on n1; n2 idle. Both nodes talk to A only."""
    admin = httpx.Client(base_url=a.url, headers=auth(a.admin_token), timeout=30)
    user = user_client(admin, a.url)
    token = worker_token(admin)
    owner = user.get("/v1/whoami").json()["id"]
    dataset = insert_dataset(Settings(data_dir=a.data_dir, database_url=url), owner)
    n1 = FakeAgent(a.url, token, "n1", units=1)
    r = user.post(
        "/v1/jobs", json=job_spec(dataset, dataset, resources={"node_count": 1, "process_count_per_node": 1})
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    placement = n1.claim()
    n1.status(placement, "running")
    n2 = FakeAgent(a.url, token, "n2", units=1)
    return user, job_id, n1, n2


def _tear_down(agents: tuple[FakeAgent | None, ...], apis: tuple[ApiProcess, ...], engine: sa.Engine) -> None:
    for agent in agents:
        if agent is not None:
            agent.close()
    for api in apis:
        api.terminate()
    engine.dispose()


def test_a_replica_down_longer_than_the_lease_loses_none_of_its_nodes(fresh_pg: str, tmp_path: Path) -> None:
    a, b = _start_pair(fresh_pg, tmp_path, {})
    engine = sa.create_engine(fresh_pg)
    n1 = n2 = None
    try:
        user, job_id, n1, n2 = _running_job(a, fresh_pg)
        time.sleep(2 * LEASE_S)  # both replicas have listened a full lease period: judging is on
        assert _node_statuses(engine) == {"n1": "ready", "n2": "ready"}

        a.kill()
        n2.close()  # n2 dies with A's outage and never speaks again; n1 keeps trying A
        killed = time.monotonic()
        seen: set[tuple[str, str]] = set()
        while time.monotonic() - killed < DOWN_S:
            seen |= set(_node_statuses(engine).items())
            time.sleep(0.2)
        # Nobody could hear either node: B lost neither, however long A was away.
        assert seen == {("n1", "ready"), ("n2", "ready")}, seen
        assert b.alive()

        restarted = time.monotonic()
        a.start().wait_ready()
        # Judged from when A answers again: how long its process takes to start is the
        # machine's (seconds on a loaded test machine), not its listening clock's.
        deadline = time.monotonic() + 6 * LEASE_S
        while _node_statuses(engine)["n2"] != "lost":
            assert time.monotonic() < deadline, "the silent node n2 was never declared lost"
            time.sleep(0.1)
        lost_after = time.monotonic() - restarted
        # One full lease after A began listening again, not before.
        assert lost_after >= LEASE_S, lost_after
        time.sleep(LEASE_S)  # n1 is judged as long as n2 was: it heartbeats again, it stays

        assert _node_statuses(engine) == {"n1": "ready", "n2": "lost"}
        job = user.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "running", job
        assert len(job["attempts"]) == 1 and job["restarts"] == 0, job["attempts"]
        # B's view agrees (the same database).
        r = httpx.get(f"{b.url}/v1/jobs/{job_id}", headers=dict(user.headers), timeout=30)
        assert r.json()["status"] == "running"
        assert "has not been replaced" in b.log()
    finally:
        _tear_down((n1, n2), (a, b), engine)


def test_with_replica_memory_off_a_vanished_replica_is_ignored(fresh_pg: str, tmp_path: Path) -> None:
    a, b = _start_pair(fresh_pg, tmp_path, {"TORCHYARD_REPLICA_MEMORY_S": "0"})
    engine = sa.create_engine(fresh_pg)
    n1 = n2 = None
    try:
        user, job_id, n1, n2 = _running_job(a, fresh_pg)
        time.sleep(2 * LEASE_S)
        a.kill()
        killed = time.monotonic()
        while _node_statuses(engine) != {"n1": "lost", "n2": "lost"}:
            assert time.monotonic() - killed < DOWN_S, _node_statuses(engine)
            time.sleep(0.1)
        assert not a.alive()
        job = httpx.get(f"{b.url}/v1/jobs/{job_id}", headers=dict(user.headers), timeout=30).json()
        assert "WorkerLostError" in str(job), job
    finally:
        _tear_down((n1, n2), (a, b), engine)


def test_the_rule() -> None:
    settings = Settings(lease_timeout_s=10, reaper_interval_s=1)  # a replica is stale after 3 s
    now = datetime(2026, 1, 1, tzinfo=UTC)

    def ago(s: float) -> datetime:
        return now - timedelta(seconds=s)

    me = (ago(100), ago(100), now)
    # Alone and listening for long: judging is on from the start of listening.
    assert cluster_hearing([me], settings, now).since == ago(100)
    # Another replica just back from a database outage: a full lease from then.
    hearing = cluster_hearing([me, (ago(50), ago(2), ago(1))], settings, now)
    assert hearing.since == ago(2) and not hearing.deaf
    # A replica last seen 5 s ago (killed): deaf, whatever the others' clocks say.
    hearing = cluster_hearing([me, (ago(50), ago(50), ago(5))], settings, now)
    assert hearing.deaf and hearing.vanished == ago(5)
    # ...until a replica starts after it vanished (its restart).
    hearing = cluster_hearing([me, (ago(50), ago(50), ago(5)), (ago(1), ago(1), now)], settings, now)
    assert not hearing.deaf and hearing.since == ago(1)
    # A replica that only saw the database again does not replace it.
    hearing = cluster_hearing([(ago(100), ago(1), now), (ago(50), ago(50), ago(5))], settings, now)
    assert hearing.deaf
    # Forgotten after TORCHYARD_REPLICA_MEMORY_S (600 s).
    assert not cluster_hearing([me, (ago(700), ago(700), ago(601))], settings, now).deaf

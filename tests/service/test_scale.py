"""The control plane at scale: query plans at 100,000 queued jobs, scheduling passes that do not
multiply with waiting nodes, and wake-ups across API processes (PostgreSQL)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.config import Settings
from service.db.engine import Database
from service.db.models import Base
from service.services.scheduler import SCHEDULER_LOCK_KEY
from tests.conftest import LiveServer, _reset_pg, fast_leases
from tests.support.api_process import ApiProcess
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id
from tests.support.queue_fill import add_nodes, fill_history, fill_queue, owner_and_dataset

pytestmark = pytest.mark.postgres
ON_POSTGRES = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)

QUEUED = 100_000
# The tables that grow with the queue and its history: never read whole, never sorted whole.
BIG_TABLES = {"jobs", "placements", "attempts", "job_events"}
# A sort of more rows than this is a sort of the queue (or a history), not of one page of it.
MAX_SORTED_ROWS = 1_000


class StatementLog:
    """Every statement the app sends to PostgreSQL, with its parameters."""

    def __init__(self, db: Database) -> None:
        self.engine = db.engine
        self.seen: dict[str, Any] = {}
        self.recording = False

    def __enter__(self) -> StatementLog:
        sa.event.listen(self.engine, "before_cursor_execute", self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._record)

    def _record(self, _conn: Any, _cursor: Any, statement: str, parameters: Any, *_args: Any) -> None:
        if self.recording and statement.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE")):
            if isinstance(parameters, list | tuple) and parameters and isinstance(parameters[0], dict):
                parameters = parameters[0]  # executemany: one set explains the plan
            self.seen.setdefault(statement, parameters)


def _plan_problems(plan: dict[str, Any]) -> list[str]:
    problems = []
    node_type = plan.get("Node Type")
    if node_type == "Seq Scan" and plan.get("Relation Name") in BIG_TABLES:
        problems.append(f"sequential scan of {plan['Relation Name']}")
    if node_type == "Sort" and plan.get("Plan Rows", 0) > MAX_SORTED_ROWS:
        problems.append(f"sort of {plan['Plan Rows']} rows")
    for child in plan.get("Plans", []):
        problems.extend(_plan_problems(child))
    return problems


@pytest.fixture
def emptied_after(db_url: str) -> Iterator[str]:
    """The session's PostgreSQL, emptied with TRUNCATE afterwards (the next test's DELETE-based
    reset is made for small tables, not for 120,000 jobs)."""
    yield db_url
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
        conn.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()


@ON_POSTGRES
def test_hot_queries_read_the_queue_through_indexes(make_settings: Any, emptied_after: str) -> None:
    """Every query the API makes while nodes register, heartbeat, claim and report, users submit
    and list jobs and the reaper and scheduler pass, EXPLAINed with 100,000 queued jobs and a
    history of 20,000 finished ones on 1,000 nodes: no sequential scan of the big tables, no
    sort of more than a page."""
    settings: Settings = make_settings(**fast_leases(reaper_s=0.2, lease_s=30, ports=(30500, 30599)))
    db = Database(emptied_after)
    owner = owner_and_dataset(db)
    nodes = add_nodes(db, owner[0], 1000)
    fill_history(db, owner, 20_000, nodes)
    fill_queue(db, owner, QUEUED)
    with db.engine.connect() as conn:
        conn.execute(sa.text("ANALYZE"))
        conn.commit()
    db.dispose()

    with TestClient(create_app(settings)) as client, StatementLog(client.app.state.db) as statements:  # type: ignore[attr-defined]
        admin = auth(settings.admin_token_path.read_text().strip())
        worker = auth(_token(client, admin, "worker"))
        user_token = _token(client, admin, "user")
        user = auth(user_token)
        train = insert_dataset(settings, token_id(client, user_token))
        statements.recording = True
        node = {"name": "live", "address": "10.1.0.1", "units": 1, "accelerator": "cpu"}
        assert client.post("/v1/worker/nodes", json=node, headers=worker).status_code == 200
        r = client.post("/v1/jobs", json=job_spec(train, train, priority=2), headers=user)
        assert r.status_code == 201, r.text
        r = client.post("/v1/worker/nodes/live/claim", params={"wait": 5}, headers=worker)
        assert r.status_code == 200, r.text
        lease = r.json()["lease_token"]
        beat = client.post("/v1/worker/nodes/live/heartbeat", json={"leases": [lease]}, headers=worker)
        assert beat.status_code == 200, beat.text
        lease_header = {**worker, "X-Torchyard-Lease": lease}
        assert client.post(
            "/v1/worker/placements/status", json={"state": "running"}, headers=lease_header
        ).is_success
        for query in ({"limit": 50}, {"limit": 50, "status": "queued"}):
            page = client.get("/v1/jobs", params=query, headers=admin)
            assert page.status_code == 200, page.text
            nxt = client.get(
                "/v1/jobs", params={**query, "cursor": page.json()["next_cursor"]}, headers=admin
            )
            assert nxt.status_code == 200, nxt.text
        assert client.get("/v1/jobs", params={"limit": 50}, headers=user).status_code == 200
        assert client.get("/v1/cluster", headers=admin).status_code == 200
        failed = {"state": "failed", "exit_code": 1}
        assert client.post("/v1/worker/placements/status", json=failed, headers=lease_header).is_success
        time.sleep(1.0)  # reaper passes and the scheduling pass the failure asked for
        statements.recording = False
        seen = dict(statements.seen)
        explained = 0
        problems: dict[str, list[str]] = {}
        with client.app.state.db.engine.connect() as conn:  # type: ignore[attr-defined]
            for statement, parameters in seen.items():
                if "pg_advisory" in statement or "pg_notify" in statement:
                    continue
                row = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).scalar_one()
                plan = (row if isinstance(row, list) else json.loads(row))[0]["Plan"]
                explained += 1
                found = _plan_problems(plan)
                if found:
                    problems[statement] = found
            conn.rollback()
    assert explained > 20  # the routes, the reaper and the scheduler were all exercised
    assert any("ORDER BY jobs.priority DESC" in s for s in seen), "no scheduling pass ran"
    assert problems == {}, json.dumps(problems, indent=1)


def _token(client: TestClient, admin: dict[str, str], role: str) -> str:
    r = client.post("/v1/tokens", json={"name": f"{role}-token", "role": role}, headers=admin)
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


NODES = 20
BURST = 200


@ON_POSTGRES
def test_a_burst_of_submissions_costs_one_or_two_passes(make_settings: Any, db_url: str) -> None:
    """20 nodes wait in claims while 200 jobs are submitted during one scheduling pass (held on
    the scheduler's lock by the test): the burst is absorbed by one more pass, whatever the
    number of nodes waiting, and every waiting node gets a job."""
    settings: Settings = make_settings(**fast_leases(reaper_s=60, lease_s=60, ports=(30600, 30699)))
    server = LiveServer(settings).start()
    try:
        scheduling = server.server.config.app.state.scheduling  # type: ignore[attr-defined]
        admin = httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=60)
        worker_token = create_token(admin, "worker")
        user_token = create_token(admin, "user")
        user = httpx.Client(base_url=server.url, headers=auth(user_token), timeout=60)
        train = insert_dataset(settings, token_id(admin, user_token))
        for i in range(NODES):
            register_node(admin, worker_token, f"n{i}", units=1)
        claimed: dict[str, Any] = {}

        def claim(name: str) -> None:
            with httpx.Client(base_url=server.url, headers=auth(worker_token), timeout=60) as http:
                claimed[name] = http.post(f"/v1/worker/nodes/{name}/claim", params={"wait": 30})

        waiters = [threading.Thread(target=claim, args=(f"n{i}",)) for i in range(NODES)]
        for t in waiters:
            t.start()
        time.sleep(0.5)  # the claims are parked
        lock = sa.create_engine(settings.sqlalchemy_url)
        with lock.connect() as conn:
            conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": SCHEDULER_LOCK_KEY})
            before = scheduling.passes
            for i in range(BURST):
                r = user.post("/v1/jobs", json=job_spec(train, train, name=f"burst-{i}"))
                assert r.status_code == 201, r.text
            assert scheduling.passes == before  # the first pass waits on the lock
            conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": SCHEDULER_LOCK_KEY})
            conn.commit()
        lock.dispose()
        for t in waiters:
            t.join(60)
        deadline = time.monotonic() + 10
        while scheduling.pending() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        passes = scheduling.passes - before
        codes = {name: r.status_code for name, r in claimed.items()}
        jobs = {r.json()["job_id"] for r in claimed.values() if r.status_code == 200}
    finally:
        server.stop()
    assert codes == {f"n{i}": 200 for i in range(NODES)}, codes
    assert len(jobs) == NODES
    assert 1 <= passes <= 2, passes


TWO_PROCESSES = {
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "1",
    "TORCHYARD_LEASE_TIMEOUT_S": "30",
    # Neither replica's reaper passes during the test, and a parked claim re-reads nothing
    # while notifications flow: only the NOTIFY of the other process's pass can wake it.
    "TORCHYARD_REAPER_INTERVAL_S": "60",
    "TORCHYARD_CLAIM_RECHECK_INTERVAL_S": "5",
}


@pytest.fixture
def two_apis(pg_database: str, tmp_path: Path) -> Iterator[list[ApiProcess]]:
    _reset_pg(pg_database)
    data = tmp_path / "data"
    apis = [ApiProcess(data, pg_database, settings=TWO_PROCESSES, name=f"api{i}") for i in (1, 2)]
    apis[0].start().wait_ready()
    apis[1].start().wait_ready()
    try:
        yield apis
    finally:
        for api in apis:
            api.terminate()


def test_a_job_submitted_to_one_api_process_is_claimed_through_the_other(
    two_apis: list[ApiProcess], pg_database: str
) -> None:
    a, b = two_apis
    admin = httpx.Client(base_url=a.url, headers=auth(a.admin_token), timeout=30)
    worker_token = create_token(admin, "worker")
    user_token = create_token(admin, "user")
    train = insert_dataset(
        Settings(data_dir=a.data_dir, database_url=pg_database), token_id(admin, user_token)
    )
    on_b = httpx.Client(base_url=b.url, headers=auth(worker_token), timeout=30)
    register_node(on_b, worker_token, "b-node", units=1)
    got: dict[str, Any] = {}

    def claim() -> None:
        # Within 3 s: B's own re-checks and reaper would take 5 s and 60 s.
        got["r"] = on_b.post("/v1/worker/nodes/b-node/claim", params={"wait": 3})
        got["at"] = time.monotonic()

    waiter = threading.Thread(target=claim)
    waiter.start()
    time.sleep(0.5)  # parked on B
    user = httpx.Client(base_url=a.url, headers=auth(user_token), timeout=30)
    submitted = time.monotonic()
    r = user.post("/v1/jobs", json=job_spec(train, train))
    assert r.status_code == 201, r.text
    waiter.join(30)
    assert got["r"].status_code == 200, (got["r"].status_code, a.log()[-2000:], b.log()[-2000:])
    assert got["r"].json()["job_id"] == r.json()["id"]
    print(f"submitted on A, claimed through B {got['at'] - submitted:.3f} s later")

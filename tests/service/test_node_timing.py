"""The heartbeat load a cluster puts on the API: the interval and lease handed to nodes grow
with their number unless set, heartbeats have worker threads of their own, and a scheduling
pass writes wait reasons per reason, not per job."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.routes.workers import HEARTBEAT_THREADS, REGISTRATION_THREADS, Lanes
from service.config import Settings
from service.db.engine import Database
from service.db.models import Job
from service.services.node_timing import (
    MAX_CLAIM_WAIT_S,
    MAX_INTERVAL_S,
    NodeTiming,
    claim_wait_for,
    timing_for,
)
from service.services.scheduler import run_pass
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id


def _default_timing(**values: Any) -> Settings:
    # Neither TORCHYARD_HEARTBEAT_INTERVAL_S nor TORCHYARD_LEASE_TIMEOUT_S set.
    return Settings(**values)


def test_the_interval_grows_with_the_node_count() -> None:
    settings = _default_timing()
    assert timing_for(settings, 0) == (2.0, 15.0)
    assert timing_for(settings, 200) == (2.0, 15.0)  # 100 heartbeats a second
    assert timing_for(settings, 500) == (5.0, 20.0)
    assert timing_for(settings, 1000) == (10.0, 40.0)  # as Kubernetes node leases
    assert timing_for(settings, 100_000) == (MAX_INTERVAL_S, 4 * MAX_INTERVAL_S)
    interval, lease = timing_for(settings, 777)
    assert interval == 8.0 and lease == 32.0  # whole seconds, lease 4 intervals


def test_the_claim_wait_grows_with_the_interval_unless_set() -> None:
    settings = _default_timing()
    assert claim_wait_for(settings, 2.0) == 20.0  # up to 200 nodes: the setting's default
    assert claim_wait_for(settings, 5.0) == 25.0  # 500 nodes: 5 intervals
    assert claim_wait_for(settings, 10.0) == 50.0  # 1,000 nodes
    assert claim_wait_for(settings, MAX_INTERVAL_S) == MAX_CLAIM_WAIT_S
    timing = NodeTiming(settings)
    assert timing.update(1000).claim_poll_timeout_s == 50.0
    assert timing.update(10).claim_poll_timeout_s == 20.0  # shrinks at once: a shorter wait is safe
    explicit = Settings(claim_poll_timeout_s=7.0)
    assert claim_wait_for(explicit, 10.0) == 7.0
    assert NodeTiming(explicit).update(1000).claim_poll_timeout_s == 7.0


def test_explicit_timing_is_used_as_set() -> None:
    for values in ({"heartbeat_interval_s": 0.5}, {"lease_timeout_s": 3.0}):
        settings = Settings(**values)  # type: ignore[arg-type]
        assert timing_for(settings, 10_000) == (settings.heartbeat_interval_s, settings.lease_timeout_s)
        timing = NodeTiming(settings)
        assert timing.update(10_000) is timing.settings()
        assert timing.settings().heartbeat_interval_s == settings.heartbeat_interval_s


def test_a_shrinking_cluster_keeps_the_longer_lease_until_every_node_heard() -> None:
    now = [0.0]
    timing = NodeTiming(_default_timing(), clock=lambda: now[0])
    grown = timing.update(1000)
    assert (grown.heartbeat_interval_s, grown.lease_timeout_s) == (10.0, 40.0)
    # Most nodes gone: the short interval is handed out at once, but silence is judged
    # against the 40 s lease until two such leases have passed.
    shrunk = timing.update(10)
    assert (shrunk.heartbeat_interval_s, shrunk.lease_timeout_s) == (2.0, 40.0)
    now[0] = 79.0
    assert timing.update(10).lease_timeout_s == 40.0
    now[0] = 80.0
    assert timing.update(10).lease_timeout_s == 15.0
    # Growing again takes effect at once.
    assert timing.update(600).lease_timeout_s == 24.0


@pytest.fixture
def scaled(make_settings: Any) -> Iterator[TestClient]:
    """An app with the default timing and a budget of 1 heartbeat a second (so that a handful
    of nodes is a large cluster)."""
    settings: Settings = make_settings(heartbeats_per_s=1.0)
    with TestClient(create_app(settings)) as client:
        admin_token = (settings.data_dir / "admin.token").read_text().strip()
        client.headers.update(auth(admin_token))
        yield client


@pytest.mark.both_databases
def test_registration_and_heartbeats_hand_out_the_grown_interval(scaled: TestClient) -> None:
    worker = create_token(scaled, "worker")
    answers = []
    for i in range(6):
        r = scaled.post(
            "/v1/worker/nodes",
            json={"name": f"n{i}", "address": "127.0.0.1", "units": 1, "accelerator": "cpu"},
            headers=auth(worker),
        )
        assert r.status_code == 200, r.text
        body = r.json()
        answers.append((body["heartbeat_interval_s"], body["lease_timeout_s"], body["claim_poll_timeout_s"]))
    # 1 heartbeat a second for all: the interval grows with each node registered, and the
    # claim long-poll with it (5 intervals, never below the 20 s default).
    assert answers[0] == (2.0, 15.0, 20.0)
    assert answers[5] == (6.0, 24.0, 30.0)
    # The first node learns it at its next heartbeat (agents follow every answer).
    beat = scaled.post("/v1/worker/nodes/n0/heartbeat", json={"leases": []}, headers=auth(worker))
    assert beat.status_code == 200, beat.text
    timing = (
        beat.json()["heartbeat_interval_s"],
        beat.json()["lease_timeout_s"],
        beat.json()["claim_poll_timeout_s"],
    )
    assert timing == (6.0, 24.0, 30.0)
    # And a node silent for longer than the old 15 s lease but within the new one is ready.
    db: Database = scaled.app.state.db  # type: ignore[attr-defined]
    with db.transaction() as s:
        s.execute(
            sa.text(
                "UPDATE nodes SET last_heartbeat_at = last_heartbeat_at - interval '20 seconds' "
                "WHERE name = 'n1'"
            )
            if not db.is_sqlite
            else sa.text(
                "UPDATE nodes SET last_heartbeat_at = datetime(last_heartbeat_at, '-20 seconds') WHERE name = 'n1'"
            )
        )
    nodes = {n["name"]: n["status"] for n in scaled.get("/v1/cluster").json()["nodes"]}
    assert nodes["n1"] == "ready", nodes


@pytest.mark.both_databases
def test_a_heartbeat_does_not_wait_for_the_threads_other_requests_use(client: TestClient) -> None:
    """Every thread of the pool that other requests use is taken (a burst of claims and
    submissions, say): heartbeats are still answered, from threads of their own."""
    worker = create_token(client, "worker")
    register_node(client, worker, "n1", 1)
    portal = client.portal  # type: ignore[attr-defined]
    limiter = portal.call(anyio.to_thread.current_default_thread_limiter)
    borrowers = [object() for _ in range(int(limiter.total_tokens))]
    for b in borrowers:
        portal.call(limiter.acquire_on_behalf_of, b)
    try:
        results: dict[str, httpx.Response] = {}

        def call(key: str, method: str, path: str, **kwargs: Any) -> None:
            results[key] = client.request(method, path, headers=auth(worker), **kwargs)

        # A sync route needs a thread of the shared pool: it waits.
        blocked = threading.Thread(target=call, args=("datasets", "GET", "/v1/worker/datasets/none/archive"))
        blocked.start()
        beats = [
            threading.Thread(
                target=call,
                args=(f"beat{i}", "POST", "/v1/worker/nodes/n1/heartbeat"),
                kwargs={"json": {"leases": []}},
            )
            for i in range(2 * HEARTBEAT_THREADS)
        ]
        for t in beats:
            t.start()
        deadline = time.monotonic() + 15
        for t in beats:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        answered = [
            results[f"beat{i}"].status_code for i in range(2 * HEARTBEAT_THREADS) if f"beat{i}" in results
        ]
        assert answered == [200] * (2 * HEARTBEAT_THREADS)
        assert "datasets" not in results and blocked.is_alive()
    finally:
        for b in borrowers:
            portal.call(limiter.release_on_behalf_of, b)
    blocked.join(timeout=20)
    assert results["datasets"].status_code == 404


def test_registrations_take_threads_of_their_own_lane_and_heartbeats_go_on(client: TestClient) -> None:
    """When a whole cluster registers at once, registrations queue for their own few threads
    (here every one of them is taken): a registration waits, heartbeats of nodes already
    registered are answered meanwhile, and the registration goes through once a thread frees."""
    worker = create_token(client, "worker")
    register_node(client, worker, "n1", 1)
    portal = client.portal  # type: ignore[attr-defined]
    lanes: Lanes = client.app.state.lanes  # type: ignore[attr-defined]
    limiter = lanes.registrations
    assert limiter.total_tokens == REGISTRATION_THREADS
    borrowers = [object() for _ in range(REGISTRATION_THREADS)]
    for b in borrowers:
        portal.call(limiter.acquire_on_behalf_of, b)
    results: dict[str, httpx.Response] = {}

    def register() -> None:
        body = {"name": "n2", "address": "127.0.0.1", "units": 1, "accelerator": "cpu"}
        results["n2"] = client.post("/v1/worker/nodes", json=body, headers=auth(worker))

    waiting = threading.Thread(target=register)
    try:
        waiting.start()
        for _ in range(3):
            beat = client.post("/v1/worker/nodes/n1/heartbeat", json={"leases": []}, headers=auth(worker))
            assert beat.status_code == 200, beat.text
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and "n2" not in results
        assert portal.call(lambda: limiter.statistics().tasks_waiting) == 1
    finally:
        for b in borrowers:
            portal.call(limiter.release_on_behalf_of, b)
    waiting.join(timeout=20)
    assert results["n2"].status_code == 200, results["n2"].text
    names = {n["name"] for n in client.get("/v1/cluster").json()["nodes"]}
    assert names >= {"n1", "n2"}


@pytest.mark.both_databases
def test_a_pass_writes_wait_reasons_per_reason_not_per_job(client: TestClient, settings: Settings) -> None:
    """300 jobs of two shapes wait behind a job that does not fit yet: the first pass writes
    their reasons with one statement per distinct reason; the next pass writes nothing."""
    worker = create_token(client, "worker")
    register_node(client, worker, "n1", 2)
    register_node(client, worker, "n2", 2)
    user = create_token(client, "user")
    dataset = insert_dataset(settings, token_id(client, user))

    def submit(nodes: int, units: int, priority: int = 0) -> str:
        resources = {"node_count": nodes, "process_count_per_node": units}
        r = client.post(
            "/v1/jobs",
            json=job_spec(dataset, dataset, resources=resources, priority=priority),
            headers=auth(user),
        )
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    holder = submit(1, 2, priority=5)  # takes n1 whole
    deadline = time.monotonic() + 20
    while client.get(f"/v1/jobs/{holder}", headers=auth(user)).json()["status"] != "scheduled":
        assert time.monotonic() < deadline, "the first job was never placed"
        time.sleep(0.05)
    client.app.state.scheduling.stop()  # type: ignore[attr-defined]  # only this test's passes now
    blocker = submit(2, 2, priority=3)  # needs both nodes: first in line, waits
    db = Database(settings.sqlalchemy_url)
    with db.transaction() as s:
        row = s.execute(sa.select(Job.__table__).where(Job.id == blocker)).mappings().one()
        s.execute(
            sa.insert(Job.__table__),
            [
                {
                    **row,
                    "id": f"bulk{i:04d}",
                    "name": f"bulk-{i}",
                    "priority": 0,
                    "process_count_per_node": 1 + i % 2,
                    "node_count": 1,
                    "wait_reason": None,
                }
                for i in range(300)
            ],
        )
    updates: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE JOBS"):
            updates.append(statement)

    sa.event.listen(db.engine, "before_cursor_execute", record)
    try:
        run_pass(db, settings)
        first = len(updates)
        updates.clear()
        run_pass(db, settings)
        second = len(updates)
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", record)
    db.dispose()
    assert 1 <= first <= 3, first  # the blocker's own reason and one per shape behind it
    assert second == 0
    reasons = client.get("/v1/jobs", params={"limit": 200, "status": "queued"}, headers=auth(user)).json()[
        "items"
    ]
    behind = {j["reason"] for j in reasons if j["name"].startswith("bulk-")}
    assert behind and all("queued behind job" in r for r in behind), behind


@pytest.mark.both_databases
def test_a_heartbeat_and_a_claim_that_finds_nothing_take_one_transaction_each(make_settings: Any) -> None:
    """The hot worker routes check the token in the same transaction as their work, and a
    claim that finds nothing does not look again before its answer unless a pass may have
    placed work meanwhile: one transaction each (they took two and three)."""
    settings: Settings = make_settings(reaper_interval_s=60.0)  # no reaper transactions meanwhile
    with TestClient(create_app(settings)) as client:
        client.headers.update(auth((settings.data_dir / "admin.token").read_text().strip()))
        worker = create_token(client, "worker")
        register_node(client, worker, "n1", 1)
        client.app.state.scheduling.stop()  # type: ignore[attr-defined]
        db: Database = client.app.state.db  # type: ignore[attr-defined]
        engines = {db.engine, db.read_engine}
        begun: list[int] = []

        def count(_conn: Any) -> None:
            begun.append(1)

        for engine in engines:
            sa.event.listen(engine, "begin", count)
        try:
            counts = {}
            for what, call in (
                (
                    "heartbeat",
                    lambda: client.post(
                        "/v1/worker/nodes/n1/heartbeat", json={"leases": []}, headers=auth(worker)
                    ),
                ),
                (
                    "claim",
                    lambda: client.post(
                        "/v1/worker/nodes/n1/claim", params={"wait": 0}, headers=auth(worker)
                    ),
                ),
            ):
                tries = []
                for _ in range(3):
                    begun.clear()
                    r = call()
                    assert r.status_code in (200, 204), r.text
                    tries.append(len(begun))
                counts[what] = min(tries)
        finally:
            for engine in engines:
                sa.event.remove(engine, "begin", count)
    assert counts == {"heartbeat": 1, "claim": 1}

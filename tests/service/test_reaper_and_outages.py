"""Control-plane faults, the quick parts (SQLite and PostgreSQL): the reaper's grace period
after the API starts and after a database outage, leases that outlive an outage, submissions
while every worker restarts, /readyz and /healthz, and the agent's bounded report backlog.

The faults themselves (a database stopped, the API SIGKILLed, a real job training through
them) are caused for real in tests/service/test_database_faults.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job, Node
from service.db.types import utcnow
from service.services.scheduler import run_pass
from service.services.upkeep.listening import ListeningClock
from service.services.upkeep.upkeep_pass import run_upkeep_pass
from tests.conftest import free_port
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id
from tests.support.report_helpers import point, set_placement, start_running_job
from torchyard.contract.headers import LEASE_HEADER
from worker.agent.reporting import RunReporter
from worker.agent.run_files import RunFileReader

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


@pytest.fixture
def db(settings: Settings, client: TestClient) -> Any:
    database = Database(settings.sqlalchemy_url)
    yield database
    database.dispose()


def _silence(db: Database, settings: Settings, job: Any, seconds: float) -> None:
    """The job's nodes last heartbeated, and its leases expired, ``seconds`` ago."""
    past = utcnow() - timedelta(seconds=seconds)
    for placement_id in job.placement_ids:
        set_placement(settings, placement_id, lease_expires_at=past)
    with db.transaction() as s:
        s.execute(update(Node).where(Node.name.in_(job.node_names)).values(last_heartbeat_at=past))


def _job_status(db: Database, job_id: str) -> str:
    with db.read_session() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job.status


def test_nodes_get_a_full_lease_period_after_start_and_after_a_database_outage(
    client: TestClient, db: Database, settings: Settings
) -> None:

    job = start_running_job(settings, client, node_count=2, per_node=1)
    # Silent for twice the lease timeout: while the API was down, say.
    _silence(db, settings, job, 2 * settings.lease_timeout_s)

    # A replica that started a moment ago has not listened for a lease period yet.
    just_started = ListeningClock()
    assert just_started.grace_left(settings.lease_timeout_s, utcnow()) > 0
    result = run_upkeep_pass(db, settings, just_started)
    assert (result.lost_placements, result.lost_nodes) == (0, [])
    assert _job_status(db, job.job_id) == "running"

    # The node heartbeats during the grace period: its expired leases are renewed, not refused,
    # and its reports are taken.
    worker = auth(job.worker_token)
    r = client.post(
        f"/v1/worker/nodes/{job.node_names[0]}/heartbeat", json={"leases": [job.leases[0]]}, headers=worker
    )
    assert r.status_code == 200, r.text
    assert r.json()["stop"] == [] and [x["lease_token"] for x in r.json()["renewed"]] == [job.leases[0]]
    r = client.post(
        f"/v1/worker/jobs/{job.job_id}/reports",
        json={"metrics": [point("train.loss", 1.0, 1, 1)], "logs": []},
        headers={**worker, LEASE_HEADER: job.leases[1]},
    )
    assert r.status_code == 200, r.text

    # After a database outage the grace period starts again, from when it came back.
    listening = ListeningClock(since=utcnow() - timedelta(hours=1))
    listening.lost_hearing()
    assert listening.grace_left(settings.lease_timeout_s, utcnow()) == settings.lease_timeout_s
    assert run_upkeep_pass(db, settings, listening).lost_nodes == []
    listening.heard()
    assert listening.since > utcnow() - timedelta(seconds=5)
    assert run_upkeep_pass(db, settings, listening).lost_nodes == []

    # A replica that has listened for a full lease period judges silence as before: the node
    # that never spoke again is lost and the attempt fails with WorkerLostError (retryable:
    # the job waits in the queue for two nodes again).
    long_listening = ListeningClock(since=utcnow() - timedelta(seconds=2 * settings.lease_timeout_s))
    result = run_upkeep_pass(db, settings, long_listening)
    assert job.node_names[1] in result.lost_nodes and job.node_names[0] not in result.lost_nodes
    assert _job_status(db, job.job_id) == "queued"
    shown = client.get(f"/v1/jobs/{job.job_id}", headers=auth(job.user_token)).json()
    assert shown["attempts"][0]["end_reason"]["code"] == "WorkerLostError"
    assert shown["reason"].startswith("restarting after WorkerLostError"), shown["reason"]


def test_a_submission_while_every_worker_restarts_is_accepted_and_waits(
    client: TestClient, db: Database, settings: Settings
) -> None:
    me = token_id(client, client.headers["Authorization"].split()[1])
    data = insert_dataset(settings, me)
    worker = create_token(client, "worker")
    register_node(client, worker, "n1", units=2)
    register_node(client, worker, "n2", units=2)
    # Both agents are being upgraded: silent past the lease timeout (and marked lost), but
    # seen well within TORCHYARD_NODE_MEMORY_S.
    with db.transaction() as s:
        s.execute(
            update(Node).values(
                status="lost", last_heartbeat_at=utcnow() - timedelta(seconds=settings.lease_timeout_s + 30)
            )
        )
    assert client.get("/v1/cluster").json()["ready_nodes"] == 0

    r = client.post(
        "/v1/jobs", json=job_spec(data, data, resources={"node_count": 2, "process_count_per_node": 2})
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert run_pass(db, settings).scheduled == []
    shown = client.get(f"/v1/jobs/{job_id}").json()
    assert shown["status"] == "queued"
    assert shown["reason"] and "node" in shown["reason"], shown

    # What the cluster has never had is still refused, naming the limit.
    for resources, field in (
        ({"node_count": 3, "process_count_per_node": 1}, "resources.node_count"),
        ({"node_count": 1, "process_count_per_node": 3}, "resources.process_count_per_node"),
    ):
        r = client.post("/v1/jobs", json=job_spec(data, data, resources=resources))
        assert r.status_code == 422, r.text
        assert r.json()["code"] == "ResourceLimitError"
        assert [d["field"] for d in r.json()["details"]] == [field]
    assert (
        "the nodes seen in the last 600 s"
        in client.post(
            "/v1/jobs", json=job_spec(data, data, resources={"node_count": 3, "process_count_per_node": 1})
        ).json()["message"]
    )

    # The agents come back: the job is placed.
    register_node(client, worker, "n1", units=2)
    register_node(client, worker, "n2", units=2)
    assert job_id in run_pass(db, settings).scheduled or _job_status(db, job_id) == "scheduled"

    # A node last heard from longer ago than TORCHYARD_NODE_MEMORY_S no longer counts: n1,
    # seen just within it, still lets a one-node job wait; two nodes are more than that.
    now = utcnow()
    for name, ago in (("n1", settings.node_memory_s - 60), ("n2", settings.node_memory_s + 60)):
        with db.transaction() as s:
            s.execute(
                update(Node)
                .where(Node.name == name)
                .values(status="lost", last_heartbeat_at=now - timedelta(seconds=ago))
            )
    r = client.post(
        "/v1/jobs", json=job_spec(data, data, resources={"node_count": 1, "process_count_per_node": 2})
    )
    assert r.status_code == 201, r.text
    r = client.post(
        "/v1/jobs", json=job_spec(data, data, resources={"node_count": 2, "process_count_per_node": 1})
    )
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "ResourceLimitError"
    assert [(d["field"], d["limit"]) for d in r.json()["details"]] == [("resources.node_count", 1)]


def test_readyz_reports_the_database_and_healthz_never_touches_it(client: TestClient) -> None:
    r = client.get("/readyz")
    assert (r.status_code, r.json()) == (200, {"status": "ready", "database": "ok"})
    assert client.get("/healthz").json() == {"status": "ok"}
    # Neither needs a token.
    assert client.get("/readyz", headers={"Authorization": ""}).status_code == 200


def test_the_agent_bounds_unsent_logs_and_says_what_it_drops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rank_log = tmp_path / "stdout.log"
    agent_log = tmp_path / "agent.log"
    agent_log.write_text("")
    events = tmp_path / "events.jsonl"
    lines = [f"line {i:04d} " + "x" * 40 + "\n" for i in range(200)]
    rank_log.write_text("".join(lines))
    metric_lines = [
        f'{{"type": "metric", "name": "train.loss", "value": 1.0, "epoch": 1, "step": {i}, "rank": 0}}\n'
        for i in range(3000)
    ]
    events.write_text("".join(metric_lines))
    reader = RunFileReader(
        "job", tmp_path, lambda: [("rank-0", rank_log)], agent_log, "n1", max_log_backlog=2000
    )
    assert reader.backlog() == rank_log.stat().st_size

    with caplog.at_level(logging.WARNING, logger="worker.agent.reporting"):
        batches = [reader.collect(final=True) for _ in range(4)]
    shipped = "".join(c["data"] for b in batches for c in b.logs if c["stream"] == "rank-0")
    total = rank_log.stat().st_size
    dropped = total - 1000
    assert shipped.startswith(f"\n[torchyard agent: {dropped} bytes of this log were dropped here")
    # What is kept is the newest half of the bound, exactly.
    assert shipped.endswith("".join(lines)[-1000:]) and len(shipped.split("]\n", 1)[1]) == 1000
    assert reader.dropped_log_bytes == dropped
    assert f"report buffer full: dropping {dropped} unsent bytes of log stream rank-0" in caplog.text
    # Offsets of the stream stay contiguous: nothing the API holds is overwritten or skipped.
    chunks = [c for b in batches for c in b.logs if c["stream"] == "rank-0"]
    for before, after in itertools.pairwise(chunks):
        assert after["offset"] == before["offset"] + len(before["data"].encode())
    # Every metric point is kept, none twice.
    steps = [m["step"] for b in batches for m in b.metrics]
    assert sorted(steps) == list(range(3000))


def test_the_agent_says_in_its_log_when_the_report_buffer_is_full_and_what_it_drops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An API that refuses connections (nothing listens on the port): the first batch stays
    # in flight while the rank keeps writing, past the bound.
    rank_log = tmp_path / "stdout.log"
    rank_log.write_text("first line\n")
    agent_log = tmp_path / "agent.log"
    agent_log.write_text("")
    with httpx.Client(base_url=f"http://127.0.0.1:{free_port()}") as unreachable:
        reporter = RunReporter(
            unreachable,
            "job-1",
            "lease",
            tmp_path,
            lambda: [("rank-0", rank_log)],
            agent_log,
            "n1",
            interval=0.05,
            max_backoff=0.1,
            max_log_backlog=1000,
        )
        with caplog.at_level(logging.WARNING, logger="worker.agent.reporting"):
            reporter.start()
            deadline = time.monotonic() + 30
            while reporter.stats["retries"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert reporter.stats["retries"] >= 1, caplog.text
            assert "report failed" in caplog.text and "will retry" in caplog.text
            assert "report buffer full" not in caplog.text  # nothing over the bound yet
            with rank_log.open("a") as fh:
                fh.write("y" * 4999 + "\n")
            while "report buffer full" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
            retries = reporter.stats["retries"]
            while reporter.stats["retries"] < retries + 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not reporter.stop(timeout=0.2)  # the API never came back
    full = [r.getMessage() for r in caplog.records if "report buffer full" in r.getMessage()]
    # Said once, with what waits, the bound, and what goes: the oldest log bytes, never a point.
    assert full == [
        "job job-1: report buffer full: 5000 log bytes wait for the API (bound 1000 per stream); the "
        "oldest unsent log bytes of a stream over the bound are dropped when it is back, with a "
        "note in that stream; metric points are all kept"
    ], caplog.text


def test_a_placement_never_claimed_is_reported_so_when_its_node_falls_silent_in_the_same_pass(
    client: TestClient, db: Database, settings: Settings
) -> None:
    # A replica paused past both deadlines (the unclaimed placement's lease, then the
    # node's heartbeat) judges both in one pass: the placement's own, earlier cause is
    # the one reported, not the node's silence.
    job = start_running_job(settings, client, node_count=2, per_node=1)
    for placement_id in job.placement_ids:
        set_placement(settings, placement_id, status="assigned")
    _silence(db, settings, job, 2 * settings.lease_timeout_s)
    result = run_upkeep_pass(db, settings)
    assert sorted(result.lost_nodes) == sorted(job.node_names)
    shown = client.get(f"/v1/jobs/{job.job_id}", headers=auth(job.user_token)).json()
    reason = shown["attempts"][0]["end_reason"]
    assert reason["code"] == "WorkerLostError"
    assert reason["message"].endswith(f"did not claim its placement within {settings.lease_timeout_s:g} s"), (
        reason
    )


def _heard(db: Database, settings: Settings, job: Any, *, renewed_ago: float, node_after: float) -> None:
    """The job's lease was last renewed ``renewed_ago`` seconds ago, and its node last spoke
    ``node_after`` seconds after that renewal (in a heartbeat that did not list the lease)."""
    renewed = utcnow() - timedelta(seconds=renewed_ago)
    set_placement(
        settings, job.placement_ids[0], lease_expires_at=renewed + timedelta(seconds=settings.lease_timeout_s)
    )
    with db.transaction() as s:
        s.execute(
            update(Node)
            .where(Node.name == job.node_names[0])
            .values(last_heartbeat_at=renewed + timedelta(seconds=node_after))
        )


def test_a_lease_that_ran_out_with_its_nodes_last_heartbeat_is_judged_with_the_node(
    client: TestClient, db: Database, settings: Settings
) -> None:
    # An agent's heartbeat sent just before it claimed lands just after the claim, without the
    # new lease, and the node dies: the lease runs out a moment before the node is silent. The
    # reaper waits for the node, so the job is not put back on a node about to be lost.
    interval, timeout = settings.heartbeat_interval_s, settings.lease_timeout_s
    job = start_running_job(settings, client, node_count=1, per_node=1)
    _heard(db, settings, job, renewed_ago=timeout + interval / 4, node_after=interval / 2)
    result = run_upkeep_pass(db, settings, schedule=False)
    assert (result.lost_placements, result.lost_nodes) == (0, [])
    assert _job_status(db, job.job_id) == "running"

    # One heartbeat interval on, the node is silent: both go together, named as the node's.
    _heard(db, settings, job, renewed_ago=timeout + interval, node_after=interval / 2)
    result = run_upkeep_pass(db, settings, schedule=False)
    assert result.lost_nodes == job.node_names
    assert _job_status(db, job.job_id) == "queued"
    shown = client.get(f"/v1/jobs/{job.job_id}", headers=auth(job.user_token)).json()
    assert shown["attempts"][0]["end_reason"]["message"] == f"node {job.node_names[0]} stopped heartbeating"

    # A node that went on heartbeating without the lease (its agent let it go) loses the lease
    # as soon as it runs out, and stays ready.
    other = start_running_job(settings, client, node_count=1, per_node=1)
    _heard(db, settings, other, renewed_ago=timeout + interval / 4, node_after=timeout)
    result = run_upkeep_pass(db, settings, schedule=False)
    assert (result.lost_placements, result.lost_nodes) == (1, [])
    assert _job_status(db, other.job_id) == "queued"

"""Worker routes over HTTP: who may call them, claim payloads, lease fencing, status reports
driving the job, stop orders, the reaper, and the long-poll's wake-up latency.

No agent and no training here: the tests speak the agent's protocol themselves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job, Node, Placement
from tests.conftest import LiveServer, fast_leases
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


LEASE = "X-Torchyard-Lease"
LEASE_TIMEOUT_S = 3.0


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(
        **fast_leases(
            heartbeat_s=0.3,
            lease_s=LEASE_TIMEOUT_S,
            reaper_s=0.1,
            ports=(30300, 30399),
            claim_poll_timeout_s=10,
        )
    )
    return s


@dataclass
class Cluster:
    server: LiveServer
    admin: httpx.Client
    user: httpx.Client
    worker: httpx.Client
    train: str
    val: str
    beating: set[str]

    def submit(self, **resources: int) -> str:
        # No restarts unless a test asks: these tests check how an attempt's end fails the job.
        resources = {"node_count": 1, "max_restarts": 0, **resources}
        spec = job_spec(self.train, self.val, resources=resources)
        r = self.user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        assert r.json()["status"] == "queued"
        job_id: str = r.json()["id"]
        return job_id

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.user.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def claim(self, node: str, wait: float = 5) -> dict[str, Any]:
        r = self.worker.post(f"/v1/worker/nodes/{node}/claim", params={"wait": wait})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def status(self, lease: str, state: str, **extra: Any) -> httpx.Response:
        return self.worker.post(
            "/v1/worker/placements/status", json={"state": state, **extra}, headers={LEASE: lease}
        )

    def heartbeat(self, node: str, leases: list[str]) -> dict[str, Any]:
        r = self.worker.post(f"/v1/worker/nodes/{node}/heartbeat", json={"leases": leases})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def wait_for(self, job_id: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if predicate(job):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; job is {job['status']}: {job}")
            time.sleep(0.05)


@pytest.fixture
def cluster(live_server: LiveServer, settings: Settings) -> Iterator[Cluster]:
    admin = httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=30)
    user_token = create_token(admin, "user", "alice")
    worker_token = create_token(admin, "worker", "agents")
    uid = token_id(admin, user_token)
    train = insert_dataset(settings, uid, name="train")
    val = insert_dataset(settings, uid, name="val")
    user = httpx.Client(base_url=live_server.url, headers=auth(user_token), timeout=30)
    worker = httpx.Client(base_url=live_server.url, headers=auth(worker_token), timeout=30)
    for name in ("n1", "n2"):
        register_node(worker, worker_token, name, units=2)
    beating = {"n1", "n2"}
    done = threading.Event()

    def beat() -> None:
        # Keep the nodes alive (and nothing else: no leases are renewed here).
        while not done.wait(0.1):
            for name in list(beating):
                worker.post(f"/v1/worker/nodes/{name}/heartbeat", json={"leases": []})

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        yield Cluster(live_server, admin, user, worker, train, val, beating)
    finally:
        done.set()
        beater.join()
        for c in (admin, user, worker):
            c.close()


def test_worker_routes_refuse_user_and_admin_tokens(cluster: Cluster) -> None:
    for client in (cluster.user, cluster.admin):
        assert client.post("/v1/worker/nodes/n1/heartbeat", json={"leases": []}).status_code == 403
        assert client.post("/v1/worker/nodes/n1/claim").status_code == 403
        r = client.post("/v1/worker/placements/status", json={"state": "running"}, headers={LEASE: "x"})
        assert r.status_code == 403
        assert r.json()["code"] == "PermissionDeniedError"


def test_claim_payload_running_heartbeat_and_stale_leases(cluster: Cluster) -> None:
    job_id = cluster.submit(node_count=1, process_count_per_node=2)
    work = cluster.claim("n1")
    assert work["job_id"] == job_id
    assert work["node_rank"] == 0 and work["node_count"] == 1 and work["process_count_per_node"] == 2
    assert work["world_size"] == 2 and work["master_addr"] == "127.0.0.1"
    assert 30300 <= work["master_port"] <= 30399
    assert work["spec"]["model"]["architecture"] == "resnet18"
    assert work["spec"]["parameters"]["epochs"] == 5
    assert work["datasets"]["train"] == {
        "id": cluster.train,
        "sha256": "0" * 64,
        "classes": ["a", "b", "c"],
        "num_images": 9,
    }
    assert work["classes"] == ["a", "b", "c"] and work["init_from_job"] is None
    lease = work["lease_token"]
    assert cluster.job(job_id)["status"] == "scheduled"
    # Nothing more for this node: an immediate 204.
    assert cluster.worker.post("/v1/worker/nodes/n1/claim", params={"wait": 0}).status_code == 204

    r = cluster.status(lease, "running")
    assert r.status_code == 200, r.text
    assert r.json()["stop"] is False and r.json()["job_status"] == "running"
    job = cluster.job(job_id)
    assert job["status"] == "running" and job["nodes"] == ["n1"]
    assert job["attempts"][0]["status"] == "running"

    beat = cluster.heartbeat("n1", [lease, "not-a-lease"])
    assert [x["lease_token"] for x in beat["renewed"]] == [lease]
    assert beat["stop"] == [
        {"lease_token": "not-a-lease", "job_id": None, "reason": "stale", "message": "unknown lease token"}
    ]
    assert beat["heartbeat_interval_s"] == 0.3

    for headers in ({LEASE: "wrong"}, {}):
        r = cluster.worker.post("/v1/worker/placements/status", json={"state": "running"}, headers=headers)
        assert r.status_code == 409 and r.json()["code"] == "StaleLeaseError"
    # Another node's heartbeat cannot renew (or even see) this lease.
    assert cluster.heartbeat("n2", [lease])["stop"][0]["reason"] == "stale"

    # Node rank 0 may only succeed once the model was uploaded.
    r = cluster.status(lease, "succeeded", exit_code=0)
    assert r.status_code == 409 and r.json()["code"] == "ConflictError"
    db = Database(cluster.server.settings.sqlalchemy_url)
    try:
        with db.transaction() as s:
            s.get_one(Job, job_id).model_sha256 = "a" * 64
    finally:
        db.dispose()
    r = cluster.status(lease, "succeeded", exit_code=0)
    assert r.status_code == 200 and r.json()["job_status"] == "succeeded"
    assert cluster.job(job_id)["attempts"][0]["status"] == "succeeded"
    # The placement is done: its lease is stale now.
    r = cluster.status(lease, "succeeded", exit_code=0)
    assert r.status_code == 409 and r.json()["code"] == "StaleLeaseError"


def test_first_failure_wins_and_other_nodes_are_told_to_stop(cluster: Cluster) -> None:
    job_id = cluster.submit(node_count=2, process_count_per_node=1)
    claims = {node: cluster.claim(node) for node in ("n1", "n2")}
    node_of = {w["node_rank"]: node for node, w in claims.items()}
    works = {w["node_rank"]: w for w in claims.values()}
    assert set(works) == {0, 1}
    assert works[0]["master_port"] == works[1]["master_port"]
    for w in works.values():
        assert cluster.status(w["lease_token"], "running").status_code == 200
    failure = {
        "code": "RankFailedError",
        "message": "RuntimeError: boom",
        "rank": 1,
        "node": node_of[1],
        "traceback": "Traceback (most recent call last):\n  ...\nRuntimeError: boom",
    }
    r = cluster.status(works[1]["lease_token"], "failed", exit_code=1, failure=failure)
    assert r.status_code == 200 and r.json()["job_status"] == "failed"
    job = cluster.job(job_id)
    assert job["status"] == "failed"
    assert job["failure"] == failure
    assert job["attempts"][0]["status"] == "failed"

    other = works[0]["lease_token"]
    stop = cluster.heartbeat(node_of[0], [other])["stop"]
    assert [s["reason"] for s in stop] == ["attempt_ended"] and "boom" in stop[0]["message"]
    # A later failure does not replace the first.
    late = {"code": "RankFailedError", "message": "gloo: connection closed by peer", "rank": 0}
    r = cluster.status(other, "failed", exit_code=1, failure=late)
    assert r.status_code == 200
    assert cluster.job(job_id)["failure"] == failure


def test_cancel_reaches_heartbeat_then_cancelled(cluster: Cluster) -> None:
    job_id = cluster.submit(node_count=1, process_count_per_node=1)
    work = cluster.claim("n1")
    lease = work["lease_token"]
    cluster.status(lease, "running")
    r = cluster.user.post(f"/v1/jobs/{job_id}/cancel")
    assert r.json()["status"] == "cancelling"
    stop = cluster.heartbeat("n1", [lease])["stop"]
    assert stop == [
        {
            "lease_token": lease,
            "job_id": job_id,
            "reason": "cancelled",
            "message": "the job is being cancelled",
        }
    ]
    r = cluster.status(lease, "cancelled", exit_code=-15)
    assert r.status_code == 200 and r.json()["job_status"] == "cancelled"
    job = cluster.job(job_id)
    assert job["status"] == "cancelled" and job["attempts"][0]["status"] == "cancelled"


def test_cancel_of_an_unclaimed_placement_settles_without_the_agent(cluster: Cluster) -> None:
    job_id = cluster.submit(node_count=2, process_count_per_node=2)
    cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")  # placed by the reaper's pass
    cluster.user.post(f"/v1/jobs/{job_id}/cancel")
    job = cluster.wait_for(job_id, lambda j: j["status"] == "cancelled", timeout=5)
    assert all(p["status"] == "done" for p in job["attempts"][0]["placements"])
    # A cancelled job's placements are never handed out.
    assert cluster.worker.post("/v1/worker/nodes/n1/claim", params={"wait": 0}).status_code == 204


def test_silent_worker_fails_the_job_with_worker_lost(cluster: Cluster) -> None:
    job_id = cluster.submit(node_count=1, process_count_per_node=1)
    work = cluster.claim("n1")
    cluster.status(work["lease_token"], "running")
    started = time.monotonic()
    # n1 never heartbeats again; n2 keeps beating.
    cluster.beating.discard("n1")
    job = cluster.wait_for(job_id, lambda j: j["status"] == "failed", timeout=10)
    assert time.monotonic() - started < LEASE_TIMEOUT_S + 2
    assert job["failure"]["code"] == "WorkerLostError"
    assert job["failure"]["node"] == "n1"
    assert job["failure"]["message"] == "node n1 stopped heartbeating"
    deadline = time.monotonic() + 3
    while True:
        nodes = {n["name"]: n for n in cluster.user.get("/v1/cluster").json()["nodes"]}
        if nodes["n1"]["status"] == "lost" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert nodes["n1"]["status"] == "lost" and nodes["n2"]["status"] == "ready"
    assert nodes["n1"]["running_attempts"] == []
    r = cluster.status(work["lease_token"], "failed", exit_code=1)
    assert r.status_code == 409 and r.json()["code"] == "StaleLeaseError"
    # A lost node that speaks again is ready again.
    assert cluster.heartbeat("n1", [work["lease_token"]])["status"] == "ready"


def test_claim_long_poll_wakes_on_submission(cluster: Cluster) -> None:
    results: dict[str, Any] = {}

    def poll() -> None:
        r = cluster.worker.post("/v1/worker/nodes/n1/claim", params={"wait": 10})
        results["at"] = time.monotonic()
        results["response"] = r

    # Warm the submission path (the model list import): an unknown architecture is a 422.
    spec = job_spec(cluster.train, cluster.val, model={"architecture": "no-such-net"})
    assert cluster.user.post("/v1/jobs", json=spec).status_code == 422
    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)
    assert poller.is_alive()
    job_id = cluster.submit(node_count=1, process_count_per_node=1)
    # From the moment the job exists: the submission's own time (a loaded machine can stall
    # it for seconds) is not the claim's. Without a wake-up the claim would sleep out its wait.
    submitted = time.monotonic()
    poller.join(timeout=10)
    assert results["response"].status_code == 200, results
    assert results["response"].json()["job_id"] == job_id
    latency = results["at"] - submitted
    assert latency < 1.0, f"claim took {latency:.3f} s after the submission returned"


def test_claim_times_out_with_204_and_holds_no_connection(cluster: Cluster) -> None:
    started = time.monotonic()
    # Many concurrent long-polls on a small pool: the waits must not hold DB connections.
    codes: list[int] = []

    def poll() -> None:
        codes.append(cluster.worker.post("/v1/worker/nodes/n2/claim", params={"wait": 1}).status_code)

    threads = [threading.Thread(target=poll) for _ in range(60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [204] * 60
    assert time.monotonic() - started < 8
    db = Database(cluster.server.settings.sqlalchemy_url)
    try:
        with db.read_session() as s:
            node = s.scalars(select(Node).where(Node.name == "n2")).one()
            assert node.status == "ready"
            assert not list(s.scalars(select(Placement).where(Placement.node_id == node.id)))
    finally:
        db.dispose()


def test_unclaimed_placement_expires_and_a_restarted_agent_loses_its_placements(cluster: Cluster) -> None:
    # Placed on a node whose agent never claims it: lost when the lease runs out.
    job_id = cluster.submit(node_count=2, process_count_per_node=2)
    job = cluster.wait_for(job_id, lambda j: j["status"] == "failed", timeout=10)
    assert job["failure"]["code"] == "WorkerLostError"
    assert f"did not claim its placement within {LEASE_TIMEOUT_S:g} s" in job["failure"]["message"]

    # A node whose agent registers again (it restarted) loses what it ran at once.
    job_id = cluster.submit(node_count=1, process_count_per_node=1)
    job = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")
    node = job["nodes"][0]
    work = cluster.claim(node)
    cluster.status(work["lease_token"], "running")
    r = cluster.worker.post(
        "/v1/worker/nodes", json={"name": node, "address": "127.0.0.1", "units": 2, "accelerator": "cpu"}
    )
    assert r.status_code == 200
    job = cluster.job(job_id)
    assert job["status"] == "failed"
    assert job["failure"] == {
        "code": "WorkerLostError",
        "message": f"the worker agent on node {node} restarted",
        "rank": None,
        "node": node,
        "traceback": None,
    }

    # A placement the earlier agent never claimed has no process behind it: the agent that
    # registers again claims it, and the job runs with no restart counted.
    job_id = cluster.submit(node_count=1, process_count_per_node=1)
    job = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")
    node = job["nodes"][0]
    r = cluster.worker.post(
        "/v1/worker/nodes", json={"name": node, "address": "127.0.0.1", "units": 2, "accelerator": "cpu"}
    )
    assert r.status_code == 200
    assert cluster.job(job_id)["status"] == "scheduled"
    work = cluster.claim(node)
    assert work["job_id"] == job_id
    cluster.status(work["lease_token"], "running")
    job = cluster.job(job_id)
    assert job["status"] == "running" and job["restarts"] == 0 and len(job["attempts"]) == 1


def test_submission_wakes_a_waiting_claim_without_polling(make_settings: Any, settings: Settings) -> None:
    # No reaper pass and no database re-check within the test's horizon: only the
    # in-process wake-up can hand the job over quickly.
    quiet: Settings = make_settings(
        **fast_leases(
            heartbeat_s=0.3, lease_s=30, reaper_s=60, ports=(30300, 30399), claim_recheck_interval_s=5
        )
    )
    server = LiveServer(quiet).start()
    try:
        admin = httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=30)
        user_token = create_token(admin, "user", "bob")
        worker = httpx.Client(base_url=server.url, headers=auth(create_token(admin, "worker")), timeout=30)
        register_node(worker, worker.headers["Authorization"].split()[1], "solo", units=1)
        uid = token_id(admin, user_token)
        train, val = insert_dataset(quiet, uid), insert_dataset(quiet, uid)
        user = httpx.Client(base_url=server.url, headers=auth(user_token), timeout=30)
        # Warm the submission path (the model list import) first.
        first = user.post("/v1/jobs", json=job_spec(train, val)).json()["id"]
        assert worker.post("/v1/worker/nodes/solo/claim", params={"wait": 0}).json()["job_id"] == first
        latencies = []
        for _ in range(3):
            db = Database(quiet.sqlalchemy_url)
            with db.transaction() as s:  # free the node's unit again
                for p in s.scalars(select(Placement).where(Placement.status != "done")):
                    p.status = "done"
            db.dispose()
            got: dict[str, Any] = {}

            def poll(got: dict[str, Any] = got) -> None:
                r = worker.post("/v1/worker/nodes/solo/claim", params={"wait": 20})
                got["at"], got["r"] = time.monotonic(), r

            t = threading.Thread(target=poll)
            t.start()
            time.sleep(0.3)
            submitted = time.monotonic()
            job_id = user.post("/v1/jobs", json=job_spec(train, val)).json()["id"]
            t.join(20)
            assert got["r"].status_code == 200 and got["r"].json()["job_id"] == job_id
            latencies.append(got["at"] - submitted)
        assert max(latencies) < 1.0, latencies
    finally:
        server.stop()


def _node_status(cluster: Cluster, name: str) -> str:
    db = Database(cluster.server.settings.sqlalchemy_url)
    try:
        with db.read_session() as s:
            return str(s.scalars(select(Node.status).where(Node.name == name)).one())
    finally:
        db.dispose()


def test_a_parked_long_poll_does_not_revive_its_lost_node(cluster: Cluster) -> None:
    """An agent that froze (or died) with a claim long-poll parked at the API: when work
    wakes the poll up, that re-check is the API's, not a sign of life. The node stays lost
    and gets no work; only a request the agent makes afterwards revives it."""
    cluster.beating.discard("n1")
    results: dict[str, httpx.Response] = {}

    def poll() -> None:
        results["response"] = cluster.worker.post("/v1/worker/nodes/n1/claim", params={"wait": 8})

    poller = threading.Thread(target=poll)
    poller.start()  # its first check touches n1: the agent has just asked
    deadline = time.monotonic() + 4 * LEASE_TIMEOUT_S
    while _node_status(cluster, "n1") != "lost":
        assert time.monotonic() < deadline, "n1 was never declared lost"
        time.sleep(0.1)
    assert poller.is_alive()
    # Work arrives: the parked poll is woken and checks again.
    job_id = cluster.submit(node_count=1, process_count_per_node=1)
    job = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")
    assert job["nodes"] == ["n2"], job
    poller.join(timeout=15)
    assert results["response"].status_code == 204, results["response"].text
    assert _node_status(cluster, "n1") == "lost"
    # The agent's own next request is a sign of life again.
    assert cluster.worker.post("/v1/worker/nodes/n1/claim", params={"wait": 0}).status_code == 204
    assert _node_status(cluster, "n1") == "ready"

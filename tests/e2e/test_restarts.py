"""Restarts, preemption and drain over the real worker routes (docs/restarts.md), on SQLite and PostgreSQL.

The tests speak the agent's protocol themselves (claims, status reports, heartbeats, report
batches) against a live server: which failures put a job back to the queue, which are final,
what the job shows of its attempts, how stale leases of an old attempt are fenced off, drains
and preemptions, and metric points and logs across attempts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from service.config import Settings
from tests.conftest import LiveServer, fast_leases
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id
from torchyard.client import Client

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


LEASE = "X-Torchyard-Lease"
LEASE_TIMEOUT_S = 4.0


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(
        **fast_leases(
            heartbeat_s=0.3,
            lease_s=LEASE_TIMEOUT_S,
            reaper_s=0.1,
            ports=(30400, 30499),
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
    leases: dict[str, set[str]] = field(default_factory=dict)
    rounds: int = 0  # heartbeat rounds the beater has finished

    def silence(self, node: str) -> None:
        """Stop heartbeating ``node`` once a round that started now has renewed its leases, as
        an agent that dies between two heartbeats (its last one listed every lease it held)."""
        seen = self.rounds
        deadline = time.monotonic() + 5
        while self.rounds < seen + 2:
            assert time.monotonic() < deadline, "the beater stopped"
            time.sleep(0.02)
        self.beating.discard(node)

    def submit(self, **resources: Any) -> str:
        spec = job_spec(self.train, self.val, resources={"node_count": 1, **resources})
        r = self.user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        assert r.json()["resources"]["max_restarts"] == resources.get("max_restarts", 3)
        job_id: str = r.json()["id"]
        return job_id

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.user.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def wait_for(
        self, job_id: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 15
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if predicate(job):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; job is {job['status']}: {job}")
            time.sleep(0.05)

    def claim(self, node: str, wait: float = 5) -> dict[str, Any]:
        r = self.worker.post(f"/v1/worker/nodes/{node}/claim", params={"wait": wait})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        self.leases.setdefault(node, set()).add(body["lease_token"])
        return body

    def status(self, lease: str, state: str, **extra: Any) -> httpx.Response:
        return self.worker.post(
            "/v1/worker/placements/status", json={"state": state, **extra}, headers={LEASE: lease}
        )

    def run(self, node: str) -> dict[str, Any]:
        """Claim the node's placement and report its ranks running."""
        work = self.claim(node)
        assert self.status(work["lease_token"], "running").status_code == 200
        return work

    def fail(self, work: dict[str, Any], node: str, code: str, message: str) -> dict[str, Any]:
        failure = {"code": code, "message": message, "rank": 0, "node": node}
        r = self.status(work["lease_token"], "failed", exit_code=1, failure=failure)
        assert r.status_code == 200, r.text
        self.leases[node].discard(work["lease_token"])
        body: dict[str, Any] = r.json()
        return body

    def heartbeat(self, node: str, leases: list[str]) -> dict[str, Any]:
        r = self.worker.post(f"/v1/worker/nodes/{node}/heartbeat", json={"leases": leases})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def report(self, work: dict[str, Any], **batch: Any) -> httpx.Response:
        return self.worker.post(
            f"/v1/worker/jobs/{work['job_id']}/reports", json=batch, headers={LEASE: work["lease_token"]}
        )

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["name"]: n for n in self.user.get("/v1/cluster").json()["nodes"]}


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
    c = Cluster(live_server, admin, user, worker, train, val, beating)

    def beat() -> None:
        # Keep the beating nodes and the leases they hold alive, as agents do.
        while not done.wait(0.2):
            for name in list(beating):
                leases = sorted(c.leases.get(name, set()))
                worker.post(f"/v1/worker/nodes/{name}/heartbeat", json={"leases": leases})
            c.rounds += 1

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        yield c
    finally:
        done.set()
        beater.join()
        for client in (admin, user, worker):
            client.close()


def _messages(job: dict[str, Any]) -> list[str]:
    return [h["message"] or "" for h in job["history"]]


def test_a_lost_node_restarts_the_job_elsewhere_and_fences_the_old_attempt(cluster: Cluster) -> None:
    job_id = cluster.submit(max_restarts=2)
    job = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")
    lost = job["nodes"][0]
    other = ({"n1", "n2"} - {lost}).pop()
    old = cluster.run(lost)
    assert (old["attempt_number"], old["restarts"]) == (1, 0)

    # The node goes silent: attempt 1 ends with WorkerLostError, the job is queued again and
    # placed on the node that is left.
    cluster.silence(lost)
    job = cluster.wait_for(job_id, lambda j: j["restarts"] == 1 and j["status"] == "scheduled")
    reason = f"restarting after WorkerLostError on node {lost} (restart 1 of 2)"
    assert reason in _messages(job)
    assert [h["status"] for h in job["history"]] == ["queued", "scheduled", "running", "queued", "scheduled"]
    assert job["nodes"] == [other] and job["failure"] is None
    new = cluster.run(other)
    assert (new["attempt_number"], new["restarts"]) == (2, 1)

    # The old attempt's lease is fenced off: its writes get 409 and its node is told to stop.
    point = {"name": "train.loss", "value": 1.0, "epoch": 1, "step": 1, "rank": 0, "time": _now()}
    for r in (
        cluster.report(old, metrics=[point]),
        cluster.report(old, logs=[{"stream": "rank-0", "offset": 0, "data": "stale\n"}]),
        cluster.status(old["lease_token"], "running"),
    ):
        assert r.status_code == 409 and r.json()["code"] == "StaleLeaseError", r.text
    stop = cluster.heartbeat(lost, [old["lease_token"]])["stop"]
    assert [(s["lease_token"], s["reason"]) for s in stop] == [(old["lease_token"], "stale")]
    assert cluster.report(new, metrics=[point]).status_code == 200

    # A failure that is not retryable is final, whatever restarts are left.
    answer = cluster.fail(new, other, "TrainingDivergedError", "the loss is NaN at epoch 1")
    assert answer["job_status"] == "failed"
    job = cluster.job(job_id)
    assert job["status"] == "failed" and job["restarts"] == 1
    assert job["failure"]["code"] == "TrainingDivergedError"
    attempts = job["attempts"]
    assert [(a["number"], a["status"], a["nodes"]) for a in attempts] == [
        (1, "failed", [lost]),
        (2, "failed", [other]),
    ]
    # Silence and the lease run out together: either may be the one the reaper saw first.
    assert attempts[0]["end_reason"]["code"] == "WorkerLostError"
    assert attempts[0]["end_reason"]["message"].startswith(f"node {lost} "), attempts[0]["end_reason"]
    assert attempts[1]["end_reason"]["code"] == "TrainingDivergedError"
    assert all(a["started_at"] and a["finished_at"] for a in attempts)
    # The list shows the same.
    listed = {j["id"]: j for j in cluster.user.get("/v1/jobs").json()["items"]}[job_id]
    assert listed["restarts"] == 1 and [a["nodes"] for a in listed["attempts"]] == [[lost], [other]]


def test_retry_table_limits_and_repeated_failures(cluster: Cluster) -> None:
    # A retryable failure requeues; the same code and message on the next attempt is final.
    job_id = cluster.submit(max_restarts=3)
    node = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")["nodes"][0]
    answer = cluster.fail(cluster.run(node), node, "RankKilledError", "rank 0 was killed by SIGKILL")
    assert answer["job_status"] in ("queued", "scheduled")  # the pass after it may place it at once
    job = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")
    assert job["restarts"] == 1 and job["failure"] is None
    assert f"restarting after RankKilledError on node {node} (restart 1 of 3)" in _messages(job)
    node = job["nodes"][0]
    work = cluster.run(node)
    assert (work["attempt_number"], work["restarts"]) == (2, 1)
    answer = cluster.fail(work, node, "RankKilledError", "rank 0 was killed by SIGKILL")
    assert answer["job_status"] == "failed"
    job = cluster.job(job_id)
    assert job["restarts"] == 1 and job["failure"]["code"] == "RankKilledError"
    assert [a["status"] for a in job["attempts"]] == ["failed", "failed"]

    # A different message on the next attempt is a new failure: restarted again.
    job_id = cluster.submit(max_restarts=3)
    node = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")["nodes"][0]
    cluster.fail(cluster.run(node), node, "CommunicationError", "gloo: connection reset by peer 1")
    node = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")["nodes"][0]
    cluster.fail(cluster.run(node), node, "HangError", "no step finished for 600 s on ranks 0, 1")
    job = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")
    assert job["restarts"] == 2
    cluster.user.post(f"/v1/jobs/{job_id}/cancel")
    cluster.wait_for(job_id, lambda j: j["status"] == "cancelled")

    # max_restarts 0: the first retryable failure is final.
    job_id = cluster.submit(max_restarts=0)
    node = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")["nodes"][0]
    answer = cluster.fail(cluster.run(node), node, "CommunicationError", "gloo: connection reset by peer")
    assert answer["job_status"] == "failed"
    job = cluster.job(job_id)
    assert job["restarts"] == 0 and job["failure"]["code"] == "CommunicationError"
    assert len(job["attempts"]) == 1


def test_cancel_while_requeued_and_the_other_node_is_stopped(cluster: Cluster) -> None:
    # 2 nodes x 2 units: while n2's share of attempt 1 still holds its units, attempt 2
    # cannot be placed, so the job waits with the restart in its reason.
    job_id = cluster.submit(node_count=2, process_count_per_node=2)
    cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")
    works = {node: cluster.run(node) for node in ("n1", "n2")}
    cluster.fail(works["n1"], "n1", "RankKilledError", "rank 0 was killed by SIGKILL")
    job = cluster.wait_for(job_id, lambda j: j["status"] == "queued" and "waiting" in (j["reason"] or ""))
    assert job["reason"].startswith("restarting after RankKilledError on node n1 (restart 1 of 3); waiting")
    stop = cluster.heartbeat("n2", [works["n2"]["lease_token"]])["stop"]
    assert [s["reason"] for s in stop] == ["attempt_ended"]

    r = cluster.user.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    # The old attempt's node reports its ranks stopped: accepted, nothing else changes.
    assert cluster.status(works["n2"]["lease_token"], "cancelled", exit_code=-15).status_code == 200
    job = cluster.job(job_id)
    assert job["status"] == "cancelled" and job["restarts"] == 1 and len(job["attempts"]) == 1
    assert cluster.worker.post("/v1/worker/nodes/n1/claim", params={"wait": 0}).status_code == 204


def test_drain_preempts_without_counting_a_restart(cluster: Cluster) -> None:
    # Only admins drain; unknown nodes are 404.
    assert cluster.user.post("/v1/cluster/nodes/n1/drain").status_code == 403
    assert cluster.worker.post("/v1/cluster/nodes/n1/drain").status_code == 403
    r = cluster.admin.post("/v1/cluster/nodes/no-such-node/drain")
    assert r.status_code == 404 and r.json()["code"] == "NotFoundError"

    job_id = cluster.submit(process_count_per_node=2)
    node = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")["nodes"][0]
    other = ({"n1", "n2"} - {node}).pop()
    work = cluster.run(node)
    r = cluster.admin.post(f"/v1/cluster/nodes/{node}/drain")
    assert r.status_code == 200, r.text
    assert r.json() == {"name": node, "status": "draining", "drained_by": "admin", "preempted_jobs": [job_id]}
    assert cluster.nodes()[node]["status"] == "draining"

    # The node is told to checkpoint and stop; it reports preempted.
    stop = cluster.heartbeat(node, [work["lease_token"]])["stop"]
    assert [(s["lease_token"], s["reason"]) for s in stop] == [(work["lease_token"], "preempted")]
    r = cluster.status(work["lease_token"], "preempted", exit_code=0)
    assert r.status_code == 200, r.text
    cluster.leases[node].discard(work["lease_token"])
    job = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")
    assert job["restarts"] == 0 and job["nodes"] == [other]
    assert "preempted" in _messages(job)
    first = job["attempts"][0]
    assert first["status"] == "preempted" and first["end_reason"]["code"] == "preempted"
    assert cluster.nodes()[node]["status"] == "drained"

    # The agent of the other node gets SIGTERM and drains its own node: attempt 2 was not
    # claimed yet, so it is preempted at once; with both nodes drained the job waits.
    r = cluster.user.post(f"/v1/worker/nodes/{other}/drain")
    assert r.status_code == 403
    r = cluster.worker.post(f"/v1/worker/nodes/{other}/drain")
    assert r.status_code == 200 and r.json()["status"] == "drained", r.text
    job = cluster.wait_for(job_id, lambda j: j["status"] == "queued" and "waiting" in (j["reason"] or ""))
    assert job["reason"].startswith("preempted; waiting for 1 ready node")
    assert job["restarts"] == 0 and [a["status"] for a in job["attempts"]] == ["preempted", "preempted"]
    assert cluster.worker.post(f"/v1/worker/nodes/{other}/claim", params={"wait": 0}).status_code == 204

    # Undrain: ready again, and the job is placed there.
    r = cluster.admin.post(f"/v1/cluster/nodes/{node}/undrain")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    job = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")
    assert job["nodes"] == [node] and job["restarts"] == 0
    assert cluster.nodes()[node]["status"] == "ready"


def test_metrics_and_logs_across_attempts(cluster: Cluster) -> None:
    job_id = cluster.submit(max_restarts=1)
    node = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")["nodes"][0]
    first = cluster.run(node)

    def points(*epochs: int) -> list[dict[str, Any]]:
        return [
            {"name": "val.loss", "value": 1.0 / e, "epoch": e, "step": 10 * e, "rank": 0, "time": _now()}
            for e in epochs
        ]

    assert cluster.report(first, metrics=points(1, 2)).status_code == 200
    assert cluster.report(first, logs=[{"stream": "rank-0", "offset": 0, "data": "attempt one\n"}])
    cluster.fail(first, node, "RankKilledError", "rank 0 was killed by SIGKILL")
    node = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")["nodes"][0]
    second = cluster.run(node)
    # Resumed from epoch 1's checkpoint: epoch 2 is redone, then epoch 3.
    assert cluster.report(second, metrics=points(2, 3)).status_code == 200
    r = cluster.report(second, logs=[{"stream": "rank-0", "offset": 0, "data": "attempt two\n"}])
    assert r.status_code == 200
    cluster.fail(second, node, "TrainingDivergedError", "the loss is NaN")

    history = cluster.user.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
    assert [(p["epoch"], p["attempt"]) for p in history] == [(1, 1), (2, 2), (3, 2)]
    everything = cluster.user.get(f"/v1/jobs/{job_id}/metrics", params={"include_superseded": "true"})
    assert [(p["epoch"], p["attempt"]) for p in everything.json()["items"]] == [
        (1, 1),
        (2, 1),
        (2, 2),
        (3, 2),
    ]

    r = cluster.user.get(f"/v1/jobs/{job_id}/logs")
    assert r.text == "attempt two\n" and r.headers["X-Log-Attempt"] == "2"
    r = cluster.user.get(f"/v1/jobs/{job_id}/logs", params={"attempt": 1})
    assert r.text == "attempt one\n" and r.headers["X-Log-Attempt"] == "1"
    assert cluster.user.get(f"/v1/jobs/{job_id}/logs", params={"attempt": 7}).status_code == 404

    # The events stream shows the restart as a status event.
    with Client(cluster.server.url, cluster.server.admin_token) as client:
        events = list(client.events(job_id, metrics=False, logs=False, timeout=30))
    requeued = [e.data for e in events if e.kind == "status" and e.data.get("requeued")]
    assert [e["message"] for e in requeued] == [
        f"restarting after RankKilledError on node {first_node(events)} (restart 1 of 1)"
    ]


def first_node(events: list[Any]) -> str:
    """The node named by the first placement's status event ("attempt 1 placed on n1")."""
    placed = next(e.data["message"] for e in events if e.kind == "status" and e.data["status"] == "scheduled")
    return str(placed.rsplit(" ", 1)[-1])


def _now() -> str:
    return datetime.now(UTC).isoformat()


def test_cli_submit_flags_show_attempts_and_node_drain(cluster: Cluster) -> None:
    user_token = cluster.user.headers["Authorization"].removeprefix("Bearer ")
    env = {**os.environ, "TORCHYARD_URL": cluster.server.url, "TORCHYARD_TOKEN": user_token}

    def cli(*args: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "torchyard.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    train, val = cluster.train, cluster.val
    out = cli(
        "submit", "--arch", "resnet18", "--train", train, "--val", val,
        "--max-restarts", "5", "--hang-timeout", "60",
    )  # fmt: skip
    job_id = out.strip().splitlines()[-1]
    assert (
        cluster.job(job_id)["resources"] | {"max_restarts": 5, "hang_timeout_s": 60}
        == cluster.job(job_id)["resources"]
    )
    node = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")["nodes"][0]
    cluster.fail(cluster.run(node), node, "RankKilledError", "rank 0 was killed by SIGKILL")
    node = cluster.wait_for(job_id, lambda j: j["status"] == "scheduled")["nodes"][0]
    cluster.run(node)  # claimed: the heartbeats keep its lease while the CLI runs

    shown = cli("show", job_id)
    assert "restarts:    1 of 5" in shown
    assert "#1  failed     on " in shown and "RankKilledError: rank 0 was killed by SIGKILL" in shown
    assert f"#2  running    on {node}" in shown

    admin = ("--token", cluster.server.admin_token)
    assert cli("node", "drain", "n1", *admin).startswith("node n1 ")
    assert cluster.nodes()["n1"]["status"] in ("draining", "drained")
    assert cli("node", "undrain", "n1", *admin).strip() == "node n1 ready"
    assert cluster.nodes()["n1"]["status"] == "ready"

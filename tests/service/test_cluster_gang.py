"""Gang scheduling through the worker protocol over HTTP (no agent, no training).

Three 1-unit nodes, two 2-node jobs: the second waits with its reason and holds nothing
(no partial placement that could deadlock), then gets both of its nodes at once as soon
as the first job frees them; an agent already long-polling for work receives it at once.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job
from tests.conftest import LiveServer, fast_leases
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


LEASE = "X-Torchyard-Lease"
NODES = ("n1", "n2", "n3")


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(**fast_leases(heartbeat_s=0.3, ports=(30400, 30499), claim_poll_timeout_s=20))
    return s


class Agents:
    """Three pretend agents: they heartbeat (renewing the leases they hold) from a thread."""

    def __init__(self, server: LiveServer, worker_token: str) -> None:
        self.client = httpx.Client(base_url=server.url, headers=auth(worker_token), timeout=30)
        self.leases: dict[str, set[str]] = {n: set() for n in NODES}
        self.stops: dict[str, list[dict[str, Any]]] = {n: [] for n in NODES}
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> Agents:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.client.close()

    def _beat(self) -> None:
        while not self._done.wait(0.2):
            for node in NODES:
                with self._lock:
                    leases = sorted(self.leases[node])
                r = self.client.post(f"/v1/worker/nodes/{node}/heartbeat", json={"leases": leases})
                if r.status_code == 200:
                    with self._lock:
                        self.stops[node].extend(r.json()["stop"])

    def claim(self, node: str, wait: float) -> dict[str, Any] | None:
        r = self.client.post(f"/v1/worker/nodes/{node}/claim", params={"wait": wait})
        if r.status_code == 204:
            return None
        assert r.status_code == 200, r.text
        work: dict[str, Any] = r.json()
        with self._lock:
            self.leases[node].add(work["lease_token"])
        return work

    def report(self, node: str, work: dict[str, Any], state: str, **extra: Any) -> dict[str, Any]:
        r = self.client.post(
            "/v1/worker/placements/status",
            json={"state": state, **extra},
            headers={LEASE: work["lease_token"]},
        )
        assert r.status_code == 200, r.text
        if state != "running":
            with self._lock:
                self.leases[node].discard(work["lease_token"])
        body: dict[str, Any] = r.json()
        return body


def test_two_gang_jobs_on_three_nodes_one_after_the_other(
    live_server: LiveServer, settings: Settings
) -> None:
    server = live_server
    admin = httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=30)
    user_token = create_token(admin, "user", "ana")
    worker_token = create_token(admin, "worker", "agents")
    uid = token_id(admin, user_token)
    train, val = insert_dataset(settings, uid), insert_dataset(settings, uid)
    user = httpx.Client(base_url=server.url, headers=auth(user_token), timeout=30)
    for i, node in enumerate(NODES):
        register_node(admin, worker_token, node, units=1, address=f"192.0.2.{i + 1}")

    def submit(name: str) -> str:
        spec = job_spec(train, val, name=name, resources={"node_count": 2, "process_count_per_node": 1})
        r = user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        return job_id

    with Agents(server, worker_token) as agents:
        first, second = submit("first"), submit("second")
        claims: dict[str, dict[str, Any] | None] = {}
        claimed_at: dict[str, float] = {}

        def poll(node: str) -> None:
            claims[node] = agents.claim(node, wait=15)
            claimed_at[node] = time.monotonic()

        pollers = {n: threading.Thread(target=poll, args=(n,)) for n in NODES}
        for t in pollers.values():
            t.start()
        # Two nodes get the first job at once; the third keeps waiting.
        deadline = time.monotonic() + 10
        while len(claims) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(claims) == 2, claims
        first_nodes = sorted(claims)
        idle = next(n for n in NODES if n not in claims)
        works = {n: claims[n] for n in first_nodes}
        assert all(w is not None and w["job_id"] == first for w in works.values())
        assert sorted(w["node_rank"] for w in works.values() if w) == [0, 1]
        for node, work in works.items():
            assert work is not None
            assert agents.report(node, work, "running")["job_status"] == "running"

        # The second job waits with its reason and holds nothing: not the idle node either.
        job2 = user.get(f"/v1/jobs/{second}").json()
        assert job2["status"] == "queued"
        assert job2["reason"] == "waiting for 2 nodes with 1 free unit; 1 available"
        assert job2["attempts"] == []
        view = {n["name"]: n for n in user.get("/v1/cluster").json()["nodes"]}
        assert (view[idle]["free_units"], view[idle]["attempts"]) == (1, [])
        assert all(view[n]["attempts"][0]["job_id"] == first for n in first_nodes)
        time.sleep(0.5)  # a few reaper passes: still nothing for the second job
        assert user.get(f"/v1/jobs/{second}").json()["attempts"] == []
        assert pollers[idle].is_alive()

        # The first job finishes: rank 1's node first, then rank 0 after its model upload.
        by_rank = {w["node_rank"]: (n, w) for n, w in works.items() if w}
        node1, work1 = by_rank[1]
        freed = time.monotonic()
        agents.report(node1, work1, "succeeded", exit_code=0)
        # One node is free beside the idle one: the second job is placed on both at once,
        # and the idle node's long-poll, waiting all along, receives its share.
        pollers[idle].join(timeout=10)
        assert claims[idle] is not None and claims[idle]["job_id"] == second  # type: ignore[index]
        assert claimed_at[idle] - freed < 1.0
        again = agents.claim(node1, wait=5)
        assert again is not None and again["job_id"] == second
        assert {claims[idle]["node_rank"], again["node_rank"]} == {0, 1}  # type: ignore[index]
        job2 = user.get(f"/v1/jobs/{second}").json()
        assert job2["status"] == "scheduled" and job2["reason"] is None
        assert sorted(job2["nodes"]) == sorted([idle, node1])

        node0, work0 = by_rank[0]
        db = Database(settings.sqlalchemy_url)
        try:
            with db.transaction() as s:
                s.get_one(Job, first).model_sha256 = "a" * 64  # as the model upload would
        finally:
            db.dispose()
        assert agents.report(node0, work0, "succeeded", exit_code=0)["job_status"] == "succeeded"
        assert user.get(f"/v1/jobs/{first}").json()["status"] == "succeeded"
        # Nothing left for the first job's rank-0 node: the second runs on the other two.
        assert agents.claim(node0, wait=0) is None
    admin.close()
    user.close()


def test_cancel_of_a_two_node_job_stops_every_node(live_server: LiveServer, settings: Settings) -> None:
    admin = httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=30)
    user_token = create_token(admin, "user", "ana")
    worker_token = create_token(admin, "worker", "agents")
    uid = token_id(admin, user_token)
    train, val = insert_dataset(settings, uid), insert_dataset(settings, uid)
    user = httpx.Client(base_url=live_server.url, headers=auth(user_token), timeout=30)
    for node in NODES:
        register_node(admin, worker_token, node, units=1)
    spec = job_spec(train, val, resources={"node_count": 2, "process_count_per_node": 1})
    job_id = user.post("/v1/jobs", json=spec).json()["id"]
    with Agents(live_server, worker_token) as agents:
        works = {}
        for node in NODES:
            work = agents.claim(node, wait=0)
            if work is not None:
                works[node] = work
                agents.report(node, work, "running")
        assert len(works) == 2
        assert user.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelling"
        # Every node of the job is told, through its heartbeat, to stop its ranks.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(agents.stops[n] for n in works):
            time.sleep(0.05)
        for node, work in works.items():
            orders = [o for o in agents.stops[node] if o["lease_token"] == work["lease_token"]]
            assert orders and orders[0]["reason"] == "cancelled", agents.stops[node]
        # The job is cancelled once both nodes have stopped, not before.
        first, second = list(works)
        assert agents.report(first, works[first], "cancelled", exit_code=-15)["job_status"] == "cancelling"
        assert agents.report(second, works[second], "cancelled", exit_code=-15)["job_status"] == "cancelled"
        job = user.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "cancelled"
        assert [p["status"] for p in job["attempts"][0]["placements"]] == ["done", "done"]
    admin.close()
    user.close()

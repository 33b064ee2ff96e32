"""Restarting a worker agent process (not its machine) while its ranks train.

What torchyard does (docs/operations.md): the ranks are tied to their agent's life (the
launch guard asks the kernel to stop torchrun when the agent dies), so none trains on
unsupervised; the new agent sweeps whatever its predecessor left, registers again, and
the API ends the attempt with ``WorkerLostError`` ("the worker agent on node n1
restarted"), a retryable failure: with restarts enabled the job goes back to the queue
and resumes from its latest checkpoint. Re-attaching the new agent to running ranks is
not done. The test shows both halves: the old ranks stop, and the job succeeds on the same
node from the checkpoint its first attempt stored.

Every agent restarted at once (an agent upgrade): a job submitted while their nodes are
marked lost is accepted when it fits the nodes seen within ``TORCHYARD_NODE_MEMORY_S`` and
waits, with its reason (a larger one is a 422); it runs once the agents are back.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from tests.conftest import LiveServer, fast_leases
from tests.support.factories import auth, job_spec
from tests.support.worker_fixtures import (
    FINAL,
    checkpoint_epoch,
    start_agent,
    upload_digits,
    user_client,
    wait_for_job,
    wait_for_node,
    wait_until_gone,
    worker_token,
)
from torchyard.contract.errors import is_retryable

pytestmark = pytest.mark.slow

EPOCHS = 4


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(**fast_leases(ports=(24000, 24999)))
    return s


def test_a_restarted_agent_stops_its_predecessors_ranks_and_the_job_resumes_from_its_checkpoint(
    live_server: LiveServer, settings: Settings, tmp_path: Path
) -> None:
    admin = httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=60)
    user = user_client(admin, live_server.url)
    token = worker_token(admin)
    train, val = upload_digits(user, tmp_path / "digits", per_class=10, size=16)
    agent = start_agent(live_server.url, token, "n1", tmp_path / "n1", slots=1)
    restarted = None
    try:
        wait_for_node(user, "n1", timeout=300)
        spec = job_spec(
            train,
            val,
            parameters={
                "epochs": EPOCHS,
                "patience": EPOCHS,
                "image_size": 16,
                "batch_size": 16,
                "augmentation": "none",
            },
            resources={"node_count": 1, "process_count_per_node": 1, "max_restarts": 1},
        )
        r = user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        # Epoch 1's checkpoint is stored by the API before the agent goes.
        wait_for_job(
            user,
            job_id,
            lambda j: j["status"] in FINAL or checkpoint_epoch(settings.sqlalchemy_url, job_id) >= 1,
            timeout=300,
            agents=[agent],
        )
        assert checkpoint_epoch(settings.sqlalchemy_url, job_id) >= 1, agent.log_text()[-3000:]
        run_dir = next((tmp_path / "n1" / "runs").glob(f"{job_id}-a1-*"))

        agent.kill()  # the agent process only: its machine and its work directory stay
        restarted = start_agent(live_server.url, token, "n1", tmp_path / "n1", slots=1)
        # Nothing of the old run trains on unsupervised.
        assert wait_until_gone(str(run_dir)) == []
        job = wait_for_job(user, job_id, timeout=300, agents=[restarted])
        assert job["status"] == "succeeded", job
        assert job["restarts"] == 1
        assert [(a["number"], a["status"], a["nodes"]) for a in job["attempts"]] == [
            (1, "failed", ["n1"]),
            (2, "succeeded", ["n1"]),
        ]
        first = job["attempts"][0]
        assert first["end_reason"]["code"] == "WorkerLostError", first
        assert is_retryable("WorkerLostError")
        # Whichever the API saw first: the new agent registering, or the lease running out
        # while it started (torch takes seconds to import on a busy machine).
        assert first["end_reason"]["message"] in (
            "the worker agent on node n1 restarted",
            "node n1 stopped heartbeating",
        ), first

        # Attempt 2, on the same node, resumed from the checkpoint: its rank 0 says so, and
        # the epochs the checkpoint held were reported by attempt 1 only.
        r = user.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0})
        assert r.status_code == 200, r.text
        resumed = re.search(r"resuming after epoch (\d+)", r.text)
        assert resumed, r.text[-3000:]
        done = int(resumed.group(1))
        assert 1 <= done < EPOCHS
        r = user.get(
            f"/v1/jobs/{job_id}/metrics",
            params={"name": "val.top1", "include_superseded": "true", "limit": 10000},
        )
        assert r.status_code == 200, r.text
        by_attempt: dict[int, list[int]] = {}
        for p in r.json()["items"]:
            by_attempt.setdefault(p["attempt"], []).append(p["epoch"])
        assert sorted(by_attempt[2]) == list(range(done + 1, EPOCHS + 1)), by_attempt
        assert set(range(1, done + 1)) <= set(by_attempt[1]), by_attempt
        # The node is back and serves again.
        assert wait_for_node(user, "n1")["status"] == "ready"
    finally:
        agent.kill()
        if restarted is not None:
            restarted.discard()
        user.close()
        admin.close()


def _wait_for_lost(user: httpx.Client, names: set[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        nodes = {n["name"]: n["status"] for n in user.get("/v1/cluster").json()["nodes"]}
        if all(nodes.get(name) == "lost" for name in names):
            return
        time.sleep(0.1)
    raise AssertionError(f"nodes {sorted(names)} not marked lost within {timeout} s: {nodes}")


def test_a_job_submitted_while_every_agent_restarts_waits_for_them_and_succeeds(
    live_server: LiveServer, tmp_path: Path
) -> None:
    admin = httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=60)
    user = user_client(admin, live_server.url)
    token = worker_token(admin)
    train, val = upload_digits(user, tmp_path / "digits", per_class=10, size=16)
    names = ("n1", "n2")
    agents = [start_agent(live_server.url, token, name, tmp_path / name, slots=1) for name in names]
    try:
        for name in names:
            wait_for_node(user, name, timeout=300)
        # An agent upgrade: both agents go at once, and the API marks their nodes lost.
        for agent in agents:
            agent.kill()
        _wait_for_lost(user, set(names))
        assert user.get("/v1/cluster").json()["ready_nodes"] == 0

        def spec(node_count: int) -> dict[str, Any]:
            return job_spec(
                train,
                val,
                parameters={"epochs": 1, "image_size": 16, "batch_size": 16, "augmentation": "none"},
                resources={"node_count": node_count, "process_count_per_node": 1, "max_restarts": 0},
            )

        # A job the cluster had a moment ago is accepted and waits, saying why.
        r = user.post("/v1/jobs", json=spec(2))
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        # The next scheduling pass gives the reason.
        job = wait_for_job(
            user, job_id, lambda j: j["reason"] is not None or j["status"] != "queued", timeout=30
        )
        assert job["status"] == "queued", job
        assert job["reason"] and "node" in job["reason"], job
        # One larger than it has ever had is refused, naming the limit.
        r = user.post("/v1/jobs", json=spec(3))
        assert r.status_code == 422, r.text
        assert r.json()["code"] == "ResourceLimitError"
        assert [d["field"] for d in r.json()["details"]] == ["resources.node_count"]

        # The agents come back (same work directories): the job is placed on both and succeeds.
        agents += [start_agent(live_server.url, token, name, tmp_path / name, slots=1) for name in names]
        job = wait_for_job(user, job_id, timeout=300, agents=agents[2:])
        assert job["status"] == "succeeded", job
        assert len(job["attempts"]) == 1 and sorted(job["nodes"]) == list(names), job
    finally:
        for agent in agents:
            agent.discard()
        user.close()
        admin.close()

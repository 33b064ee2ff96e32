"""Restarting a worker agent process (not its machine) while its ranks train.

What torchyard does (docs/operations.md): the ranks are tied to their agent's life (the
launch guard asks the kernel to stop torchrun when the agent dies), so none trains on
unsupervised; the new agent sweeps whatever its predecessor left, registers again, and
the API ends the attempt with ``WorkerLostError`` ("the worker agent on node n1
restarted"), a retryable failure: with restarts enabled the job goes back to the queue
and resumes from its latest checkpoint. Re-attaching the new agent to running ranks is
not done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from tests.conftest import LiveServer
from tests.factories import auth, job_spec
from tests.worker_fixtures import (
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


@pytest.fixture
def db_url(sqlite_url: str) -> str:
    return sqlite_url


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(
        heartbeat_interval_s=0.5,
        lease_timeout_s=3.0,
        reaper_interval_s=0.2,
        master_port_min=24000,
        master_port_max=24999,
    )
    return s


def test_a_restarted_agent_stops_its_predecessors_ranks_and_the_attempt_is_lost(
    live_server: LiveServer, tmp_path: Path
) -> None:
    admin = httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=60)
    user = user_client(admin, live_server.url)
    token = worker_token(admin)
    train, val = upload_digits(user, tmp_path / "digits", per_class=10, size=16)
    agent = start_agent(live_server.url, token, "n1", tmp_path / "n1", slots=1)
    restarted = None
    try:
        wait_for_node(user, "n1")
        spec = job_spec(
            train,
            val,
            parameters={"epochs": 50, "patience": 50, "image_size": 16, "augmentation": "none"},
            resources={"node_count": 1, "process_count_per_node": 1, "max_restarts": 0},
        )
        r = user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        wait_for_job(user, job_id, lambda j: (j.get("progress") or {}).get("step", 0) >= 1, agents=[agent])
        run_dir = next((tmp_path / "n1" / "runs").glob(f"{job_id}-*"))

        agent.kill()  # the agent process only: its machine and its work directory stay
        restarted = start_agent(live_server.url, token, "n1", tmp_path / "n1", slots=1)
        job = wait_for_job(
            user, job_id, lambda j: j["attempts"][0]["status"] != "running", agents=[restarted]
        )
        first = job["attempts"][0]
        assert first["failure_code"] == "WorkerLostError", first
        # Whichever the API saw first: the new agent registering, or the lease running out
        # while it started (torch takes seconds to import on a busy machine).
        assert first["failure_message"] in (
            "the worker agent on node n1 restarted",
            "node n1 stopped heartbeating",
        ), first
        assert is_retryable("WorkerLostError")
        # Nothing of the old run trains on unsupervised.
        assert wait_until_gone(str(run_dir)) == []
        # The node is back and serves again.
        assert wait_for_node(user, "n1")["status"] == "ready"
    finally:
        agent.kill()
        if restarted is not None:
            restarted.stop(timeout=30)

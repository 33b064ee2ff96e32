"""Restarts with real processes: uvicorn + ``torchyard worker`` agents + torchrun + the trainer,
the lost agent on SQLite (the embedded default), the frozen one on PostgreSQL (a server's
row locks under the writes of two attempts). The restart protocol itself runs on both
databases in tests/e2e/test_restarts.py and tests/service/test_scheduler_leases.py, with
simulated agents: here each case runs once, for what only real processes show.

An agent SIGKILLed mid-job loses its attempt (``WorkerLostError``); the job goes back to
the queue and a second agent runs attempt 2 to success. An agent frozen (SIGSTOP) past the
lease timeout, its job restarted elsewhere, then thawed (SIGCONT): its ranks are stopped
and its writes refused, so the two attempts never both write.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, Metric
from tests.conftest import LiveServer, fast_leases
from tests.support.factories import auth, job_spec
from tests.support.worker_fixtures import (
    AgentProcess,
    processes_mentioning,
    start_agent,
    torchrun_and_rank_up,
    upload_digits,
    user_client,
    wait_for_job,
    wait_for_node,
    wait_until_gone,
    worker_token,
)

pytestmark = pytest.mark.slow

LEASE_TIMEOUT_S = 10.0  # generous: a busy machine must not lose the surviving agent
PARAMETERS = {
    "epochs": 1,
    "batch_size": 16,
    "image_size": 16,
    "augmentation": "none",
    "learning_rate": 0.05,
    "print_frequency": 2,
}


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(**fast_leases(lease_s=LEASE_TIMEOUT_S, ports=(23000, 23499)))
    return s


@dataclass
class Env:
    server: LiveServer
    user: httpx.Client
    token: str
    train: str
    val: str
    tmp: Path
    agents: list[AgentProcess]

    def agent(self, name: str) -> AgentProcess:
        agent = start_agent(self.server.url, self.token, name, self.tmp / name, slots=1, grace_period=5)
        self.agents.append(agent)
        wait_for_node(self.user, name, timeout=300)
        return agent

    def submit(self, **parameters: Any) -> str:
        spec = job_spec(
            self.train,
            self.val,
            parameters={**PARAMETERS, **parameters},
            resources={"node_count": 1, "process_count_per_node": 1, "max_restarts": 2},
        )
        r = self.user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        return job_id

    def wait(self, job_id: str, predicate: Any = None, timeout: float = 600) -> dict[str, Any]:
        if predicate is None:
            return wait_for_job(self.user, job_id, timeout=timeout, agents=self.agents)
        return wait_for_job(self.user, job_id, predicate, timeout=timeout, agents=self.agents)


@pytest.fixture
def env(live_server: LiveServer, tmp_path: Path) -> Iterator[Env]:
    admin = httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=60)
    user = user_client(admin, live_server.url)
    token = worker_token(admin)
    train, val = upload_digits(user, tmp_path / "digits", per_class=10, size=16)
    e = Env(live_server, user, token, train, val, tmp_path, [])
    try:
        yield e
    finally:
        for agent in e.agents:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.process.pid, signal.SIGCONT)
            agent.discard()
        user.close()
        admin.close()


def _run_dir(agent: AgentProcess, job_id: str) -> Path:
    runs = list((agent.work_dir / "runs").glob(f"{job_id}-*"))
    assert len(runs) == 1, runs
    return runs[0]


def _ranks_started(directory: Path, agent: AgentProcess) -> list[int]:
    """Pids of the run's processes, once torchrun and its rank are both up.

    Generous: on a busy 2-core machine a rank's start (importing torch) has taken most of a
    minute while other tests trained beside it.
    """
    deadline = time.monotonic() + 180
    while not torchrun_and_rank_up(found := processes_mentioning(str(directory))):
        if time.monotonic() >= deadline:
            logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in directory.rglob("*.log"))
            raise AssertionError(f"{found}\n{agent.log_text()[-3000:]}\n{logs}")
        time.sleep(0.2)
    return [pid for pid, _ in found]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_sigkilled_agent_restarts_the_job_on_another_agent(env: Env) -> None:
    first = env.agent("node-a")
    job_id = env.submit(epochs=3)  # still training while node-b registers, on a busy machine too
    env.wait(job_id, lambda j: j["status"] == "running")
    _ranks_started(_run_dir(first, job_id), first)
    env.agent("node-b")  # joins once the job runs on node-a
    first.kill()

    job = env.wait(job_id)
    assert job["status"] == "succeeded", job
    assert job["restarts"] == 1
    assert "restarting after WorkerLostError on node node-a (restart 1 of 2)" in [
        h["message"] for h in job["history"]
    ]
    attempts = [(a["number"], a["status"], a["nodes"]) for a in job["attempts"]]
    assert attempts == [(1, "failed", ["node-a"]), (2, "succeeded", ["node-b"])]
    assert job["attempts"][0]["end_reason"]["code"] == "WorkerLostError"
    assert job["nodes"] == ["node-b"] and job["model_sha256"]
    # Every epoch's validation point is in the default history once, from the attempt that counts.
    val = env.user.get(f"/v1/jobs/{job_id}/metrics", params={"name": "val.top1"}).json()["items"]
    assert [(p["epoch"], p["attempt"]) for p in val] == [(1, 2), (2, 2), (3, 2)]


@pytest.mark.parametrize("db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_a_frozen_agent_that_comes_back_is_fenced_off(env: Env, settings: Settings) -> None:
    frozen = env.agent("node-a")
    job_id = env.submit(epochs=3)
    env.wait(job_id, lambda j: j["status"] == "running")
    directory = _run_dir(frozen, job_id)
    pids = _ranks_started(directory, frozen)
    env.agent("node-b")
    # The whole node freezes (a suspended VM): the agent and every process of its run.
    for pid in [frozen.process.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        job = env.wait(job_id, lambda j: j["restarts"] == 1 and j["status"] == "running")
        assert job["nodes"] == ["node-b"]
        assert job["attempts"][0]["end_reason"]["code"] == "WorkerLostError"
        db = Database(settings.sqlalchemy_url)
        try:
            with db.read_session() as s:
                first = s.scalars(
                    select(Attempt.id).where(Attempt.job_id == job_id, Attempt.number == 1)
                ).one()
                stored_before = s.scalar(
                    select(func.count()).select_from(Metric).where(Metric.attempt_id == first)
                )
        finally:
            db.dispose()
    finally:
        # The node thaws, its ranks still running and its reporter holding unsent batches.
        for pid in [*pids, frozen.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    # Its heartbeat gets a stale stop order: its ranks are stopped.
    assert wait_until_gone(str(directory), timeout=30) == []
    assert frozen.alive()
    # Nothing it sent with its old lease was stored.
    db = Database(settings.sqlalchemy_url)
    try:
        with db.read_session() as s:
            stored_after = s.scalar(
                select(func.count()).select_from(Metric).where(Metric.attempt_id == first)
            )
    finally:
        db.dispose()
    assert stored_after == stored_before
    assert "stopping the ranks (stale" in frozen.log_text()
    # Attempt 2 is untouched by all this; cancelling it ends the test sooner than training would.
    env.user.post(f"/v1/jobs/{job_id}/cancel")
    job = env.wait(job_id)
    assert job["status"] == "cancelled", job
    assert [(a["number"], a["status"], a["nodes"]) for a in job["attempts"]] == [
        (1, "failed", ["node-a"]),
        (2, "cancelled", ["node-b"]),
    ]

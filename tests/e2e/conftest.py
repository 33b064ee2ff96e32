"""Fixtures of the end-to-end tests: a live API with fast leases, the digits uploaded through
it, and real ``torchyard worker`` agents started on demand (killed, not drained, at the end)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer, fast_leases
from tests.support.factories import auth, job_spec
from tests.support.ui_browser import chromium_fixture, open_ui_fixture  # noqa: F401 - fixtures of the UI tests
from tests.support.worker_fixtures import (
    AgentProcess,
    start_agent,
    upload_digits,
    user_client,
    wait_for_job,
    wait_for_node,
    worker_token,
)

# Heartbeats every 0.5 s: a lease of 6 s outlasts the stalls of a machine whose every core is
# busy (at 3 s a hang test's agent was once taken for lost with its ranks stopped, not lost).
LEASE_TIMEOUT_S = 6.0


@dataclass
class Env:
    server: LiveServer
    user: httpx.Client
    token: str
    train: str
    val: str
    tmp: Path
    agents: list[AgentProcess]

    def agent(self, name: str, *, slots: int = 2, **kw: Any) -> AgentProcess:
        agent = start_agent(self.server.url, self.token, name, self.tmp / name, slots=slots, **kw)
        self.agents.append(agent)
        wait_for_node(self.user, name)
        return agent

    def submit(self, **overrides: Any) -> str:
        parameters = {
            "epochs": 2,
            "batch_size": 16,
            "image_size": 32,
            "augmentation": "light",
            "learning_rate": 0.05,
            "print_frequency": 2,
        }
        parameters.update(overrides.pop("parameters", {}))
        spec = job_spec(
            self.train,
            self.val,
            parameters=parameters,
            resources=overrides.pop("resources", {"node_count": 1, "process_count_per_node": 2}),
            **overrides,
        )
        r = self.user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        return job_id

    def wait(self, job_id: str, predicate: Any = None, timeout: float = 180) -> dict[str, Any]:
        if predicate is None:
            return wait_for_job(self.user, job_id, timeout=timeout, agents=self.agents)
        return wait_for_job(self.user, job_id, predicate, timeout=timeout, agents=self.agents)


@pytest.fixture
def env(make_settings: Any, tmp_path: Path) -> Iterator[Env]:
    """A live API (heartbeat 0.5 s, lease 6 s), a user, a worker token and the digits uploaded;
    ``env.agent(name)`` starts an agent and waits for its node."""
    live_server = LiveServer(
        make_settings(**fast_leases(lease_s=LEASE_TIMEOUT_S, ports=(31000, 31999)))
    ).start()
    admin = httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=60)
    user = user_client(admin, live_server.url)
    token = worker_token(admin)
    train, val = upload_digits(user, tmp_path / "digits", per_class=30)
    e = Env(live_server, user, token, train, val, tmp_path, [])
    try:
        yield e
    finally:
        for agent in e.agents:
            agent.discard()
        user.close()
        admin.close()
        live_server.stop()


def run_dir(agent: AgentProcess, job_id: str) -> Path:
    runs = list((agent.work_dir / "runs").glob(f"{job_id}-*"))
    assert len(runs) == 1, runs
    return runs[0]

"""Teams end to end (docs/teams.md): ``torchyard serve`` as a process, a real agent, real training.

Team vision, which owns nothing, borrows speech's idle units for a training job. Speech then
submits a job within its quota: the scheduling pass preempts vision's job to give the units
back; the API is killed and started again in the middle of that reclaim; the preempted job
checkpoints, speech's job runs, and vision's job resumes exactly where it stopped (the same
validation metrics as the same job run without interruption), its preemption not counted as
a restart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api_process import ApiProcess
from tests.support.factories import auth
from tests.support.worker_fixtures import (
    AgentProcess,
    start_agent,
    upload_digits,
    wait_for_job,
    wait_for_node,
    worker_token,
)

pytestmark = pytest.mark.slow

SETTINGS = {
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5",
    "TORCHYARD_LEASE_TIMEOUT_S": "8",
    "TORCHYARD_REAPER_INTERVAL_S": "0.2",
    "TORCHYARD_MASTER_PORT_MIN": "27600",
    "TORCHYARD_MASTER_PORT_MAX": "27699",
    "TORCHYARD_RECLAIM_MIN_RUN_S": "0",
    "TORCHYARD_ENV": "local",
}


def _client(api: ApiProcess, token: str) -> httpx.Client:
    return httpx.Client(base_url=api.url, headers=auth(token), timeout=60)


def _token(admin: httpx.Client, name: str, user: str) -> str:
    r = admin.post("/v1/tokens", json={"name": name, "role": "user", "user": user})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


@pytest.fixture
def api(tmp_path: Path) -> Iterator[ApiProcess]:
    process = ApiProcess(tmp_path / "data", None, settings=SETTINGS).start().wait_ready()
    yield process
    process.terminate()


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.1)


def _val_history(client: httpx.Client, job_id: str) -> dict[tuple[str, int], float]:
    history: dict[tuple[str, int], float] = {}
    for name in ("val.top1", "val.loss"):
        r = client.get(f"/v1/jobs/{job_id}/metrics", params={"name": name})
        assert r.status_code == 200, r.text
        history.update({(name, p["epoch"]): p["value"] for p in r.json()["items"]})
    return history


def test_a_team_takes_back_its_quota_across_an_api_restart_and_the_borrower_resumes_exactly(
    api: ApiProcess, tmp_path: Path
) -> None:
    admin = _client(api, api.admin_token)
    assert (
        admin.post(
            "/v1/teams", json={"name": "speech", "quotas": [{"pool": "default", "nominal": 2}]}
        ).status_code
        == 201
    )
    assert (
        admin.post(
            "/v1/teams", json={"name": "vision", "quotas": [{"pool": "default", "nominal": 0}]}
        ).status_code
        == 201
    )
    assert admin.post("/v1/users", json={"name": "alice", "teams": ["vision"]}).status_code == 201
    assert admin.post("/v1/users", json={"name": "bob", "teams": ["speech"]}).status_code == 201
    alice = _client(api, _token(admin, "alice-laptop", "alice"))
    bob = _client(api, _token(admin, "bob-laptop", "bob"))
    train, val = upload_digits(alice, tmp_path / "digits", per_class=10, size=16)
    bob_train, bob_val = upload_digits(bob, tmp_path / "digits-bob", per_class=10, size=16)
    # Rank 0 of every job on this agent waits half-way through epoch 2 while a marker file
    # exists, so that the reclaim lands mid-epoch however fast or slow the machine is.
    agent: AgentProcess = start_agent(
        api.url,
        worker_token(admin),
        "n1",
        tmp_path / "n1",
        slots=2,
        env={"TORCHYARD_PREEMPT_GRACE_S": "60", "TORCHYARD_TEST_PAUSE_AT": "train:2"},
    )
    agents = [agent]
    try:
        wait_for_node(alice, "n1", timeout=240)

        def spec(name: str, train_id: str, val_id: str, epochs: int) -> dict[str, Any]:
            return {
                "name": name,
                "model": {"architecture": "squeezenet1_1"},
                "train_dataset": train_id,
                "validation_dataset": val_id,
                "parameters": {"epochs": epochs, "batch_size": 16, "image_size": 32, "print_frequency": 1},
                "resources": {"node_count": 1, "process_count_per_node": 2},
            }

        r = alice.post("/v1/jobs", json=spec("borrower", train, val, 2))
        assert r.status_code == 201, r.text
        borrower = r.json()["id"]
        assert r.json()["team"] == "vision"
        wait_for_job(alice, borrower, lambda j: j["status"] == "running", timeout=300, agents=agents)
        (run,) = sorted((agent.work_dir / "runs").glob(f"{borrower}-a1-*"))
        _wait_file(run / "paused-train-2", timeout=300)
        team = alice.get("/v1/teams/vision").json()
        assert team["usage"][0]["borrowed"] == 2

        # Speech wants its 2 units: vision's job is asked to stop, speech's waits for them.
        r = bob.post("/v1/jobs", json=spec("owner", bob_train, bob_val, 1))
        assert r.status_code == 201, r.text
        owner = r.json()["id"]
        job = wait_for_job(
            bob, owner, lambda j: "reclaiming 2" in (j.get("reason") or ""), timeout=60, agents=agents
        )
        assert "preempting 'borrower'" in job["reason"]
        queue = bob.get("/v1/queue").json()["items"]
        assert [(q["id"], q["team"]) for q in queue] == [(owner, "speech")], "bob sees his team's jobs only"

        # The API dies in the middle of the reclaim and comes back: nothing of it is lost.
        api.kill()
        api.start().wait_ready()
        (run / "paused-train-2").unlink()

        done = wait_for_job(bob, owner, timeout=400, agents=agents)
        assert done["status"] == "succeeded", done
        finished = wait_for_job(alice, borrower, timeout=400, agents=agents)
        assert finished["status"] == "succeeded", finished
        assert [a["status"] for a in finished["attempts"]] == ["preempted", "succeeded"]
        assert finished["restarts"] == 0
        history = [h["message"] for h in finished["history"]]
        assert any("preempted" in (m or "") for m in history), history
        first = finished["attempts"][0]
        assert "team speech took back its quota" in str(first.get("end_reason") or first), first
        # Bob cannot see vision's job; alice cannot see speech's.
        assert bob.get(f"/v1/jobs/{borrower}").status_code == 404
        assert alice.get(f"/v1/jobs/{owner}").status_code == 404

        # The same job without interruption: the same validation metrics, each epoch once.
        r = alice.post("/v1/jobs", json=spec("reference", train, val, 2))
        reference = r.json()["id"]
        wait_for_job(alice, reference, lambda j: j["status"] == "running", timeout=300, agents=agents)
        (ref_run,) = sorted((agent.work_dir / "runs").glob(f"{reference}-a1-*"))
        _wait_file(ref_run / "paused-train-2", timeout=300)
        (ref_run / "paused-train-2").unlink()
        assert wait_for_job(alice, reference, timeout=400, agents=agents)["status"] == "succeeded"
        got, want = _val_history(alice, borrower), _val_history(alice, reference)
        assert sorted(got) == sorted(want) and len(want) == 4
        for key, value in want.items():
            assert got[key] == (value if key[0] == "val.top1" else pytest.approx(value, abs=1e-6)), key
    finally:
        for a in agents:
            a.discard()
        alice.close()
        bob.close()
        admin.close()

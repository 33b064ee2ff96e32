"""A job with two attempts, made through the real worker HTTP protocol (no agent, no
training): attempt 1 reports epochs 1 to 12 and a log line, then fails with a retryable
``RankKilledError``, so the service restarts the job; attempt 2 redoes epochs 6 to 12 (as
a resume from epoch 5's checkpoint does), reports epochs 13 and 14 and its own log line,
and fails with ``TrainingDivergedError``, which is not retried.

Works with an in-process ``TestClient`` and with an ``httpx.Client`` on a live server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from service.config import Settings
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id

LEASE = "X-Torchyard-Lease"
# val.loss of each attempt's epochs: attempt 2's epochs 6 to 12 supersede attempt 1's,
# whose values there are negative so that a chart showing them would stand out.
FIRST = {e: (1.0 / e if e < 6 else -100.0 - e) for e in range(1, 13)}
SECOND = {e: 10.0 + e for e in range(6, 15)}


@dataclass(frozen=True)
class RestartedJob:
    job_id: str
    user_token: str
    node: str


def _points(values: dict[int, float]) -> list[dict[str, Any]]:
    now = datetime.now(UTC).isoformat()
    return [
        {"name": "val.loss", "value": v, "epoch": e, "step": 10 * e, "rank": 0, "time": now}
        for e, v in values.items()
    ]


def _wait_scheduled(client: Any, user: dict[str, str], job_id: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}", headers=user).json()
        if job["status"] == "scheduled":
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"job not scheduled: {job}")
        time.sleep(0.05)


def _run_attempt(
    client: Any, worker: dict[str, str], node: str, job_id: str, metrics: dict[int, float], log: str
) -> str:
    r = client.post(f"/v1/worker/nodes/{node}/claim", params={"wait": 5}, headers=worker)
    assert r.status_code == 200, r.text
    work = r.json()
    assert work["job_id"] == job_id
    lease = {**worker, LEASE: work["lease_token"]}
    r = client.post("/v1/worker/placements/status", json={"state": "running"}, headers=lease)
    assert r.status_code == 200, r.text
    r = client.post(
        f"/v1/worker/jobs/{job_id}/reports",
        json={"metrics": _points(metrics), "logs": [{"stream": "rank-0", "offset": 0, "data": log}]},
        headers=lease,
    )
    assert r.status_code == 200, r.text
    lease_token: str = work["lease_token"]
    return lease_token


def _fail(client: Any, worker: dict[str, str], lease_token: str, node: str, code: str, message: str) -> None:
    failure = {"code": code, "message": message, "rank": 0, "node": node}
    r = client.post(
        "/v1/worker/placements/status",
        json={"state": "failed", "exit_code": 1, "failure": failure},
        headers={**worker, LEASE: lease_token},
    )
    assert r.status_code == 200, r.text


def restarted_job(client: Any, settings: Settings, node: str = "cpu-r") -> RestartedJob:
    """``client`` is signed in as admin. The job ends failed after one restart."""
    user_token = create_token(client, "user", "rita")
    worker_token = create_token(client, "worker", "agents")
    register_node(client, worker_token, node, units=1)
    uid = token_id(client, user_token)
    train = insert_dataset(settings, uid, name="train")
    val = insert_dataset(settings, uid, name="val")
    user, worker = auth(user_token), auth(worker_token)
    spec = job_spec(train, val, name="restarted", resources={"node_count": 1, "max_restarts": 2})
    r = client.post("/v1/jobs", json=spec, headers=user)
    assert r.status_code == 201, r.text
    job_id: str = r.json()["id"]

    _wait_scheduled(client, user, job_id)
    lease = _run_attempt(client, worker, node, job_id, FIRST, "attempt one\n")
    _fail(client, worker, lease, node, "RankKilledError", "rank 0 was killed by SIGKILL")
    _wait_scheduled(client, user, job_id)
    lease = _run_attempt(client, worker, node, job_id, SECOND, "attempt two\n")
    _fail(client, worker, lease, node, "TrainingDivergedError", "the loss is NaN")
    job = client.get(f"/v1/jobs/{job_id}", headers=user).json()
    assert job["status"] == "failed" and job["restarts"] == 1, job
    return RestartedJob(job_id, user_token, node)

"""Control-plane faults caused for real while a real job trains (docs/restarts.md, last bullet).

A private PostgreSQL server (started and stopped by the test), ``torchyard serve`` as a
subprocess, a real ``torchyard worker`` agent, torchrun and the trainer on digits. While
the job trains and clients poll and follow its events:

1. the database is stopped: requests get 503 ``ServiceUnavailableError`` with
   ``Retry-After`` (never a 500, never a hang), ``/readyz`` says so, ``/healthz`` stays
   up; started again, everything resumes by itself;
2. the API is SIGKILLed and started again while its database is still down (``serve``
   waits for it), the whole outage longer than the lease timeout;

and the job still succeeds, with every metric point and log byte the trainer wrote
stored exactly once, and the events follower missing and doubling nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api_process import ApiProcess, SseFollower
from tests.support.factories import auth, job_spec
from tests.support.private_pg import PrivatePostgres, private_pg, wait_until  # noqa: F401 - fixture
from tests.support.worker_fixtures import (
    AgentProcess,
    start_agent,
    upload_digits,
    user_client,
    wait_for_job,
    wait_for_node,
    worker_token,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

LEASE_TIMEOUT_S = 3.0
# Longer than the lease timeout: before, this killed every running job.
OUTAGE_S = 3 * LEASE_TIMEOUT_S
# The API's waits on its database (the defaults, named so the bound below follows them): a new
# connection, and a free pooled connection. A stopped server refuses or drops connections at
# once, so no statement runs into the statement timeout here.
CONNECT_TIMEOUT_S = 3.0
POOL_TIMEOUT_S = 5.0
# The longest any client request may take, the database down or not: a wait for a pooled
# connection, then for a new connection, plus time for a loaded 2-core machine.
LONGEST_REQUEST_S = POOL_TIMEOUT_S + CONNECT_TIMEOUT_S + 2.0
SETTINGS = {
    "TORCHYARD_DATABASE_CONNECT_TIMEOUT_S": str(CONNECT_TIMEOUT_S),
    "TORCHYARD_DATABASE_POOL_TIMEOUT_S": str(POOL_TIMEOUT_S),
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5",
    "TORCHYARD_LEASE_TIMEOUT_S": str(LEASE_TIMEOUT_S),
    "TORCHYARD_REAPER_INTERVAL_S": "0.2",
    "TORCHYARD_MASTER_PORT_MIN": "27000",
    "TORCHYARD_MASTER_PORT_MAX": "27999",
    "TORCHYARD_RETRY_AFTER_S": "1",
}


@dataclass
class Poller:
    """A user polling a job: every answer's status, how long each request took (answered or
    not), and any request that hung."""

    url: str
    token: str
    job_id: str
    codes: Counter[int] = field(default_factory=Counter)
    unavailable: list[httpx.Response] = field(default_factory=list)
    refused: int = 0
    hung: int = 0
    durations: list[tuple[float, str, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, headers=auth(self.token), timeout=15) as http:
            while not self.stop.wait(0.1):
                for path in (f"/v1/jobs/{self.job_id}", f"/v1/jobs/{self.job_id}/metrics", "/v1/cluster"):
                    started = time.monotonic()
                    try:
                        r = http.get(path)
                    except httpx.TimeoutException:
                        self.durations.append((time.monotonic() - started, path, "timed out"))
                        self.hung += 1
                        continue
                    except httpx.TransportError as exc:
                        self.durations.append((time.monotonic() - started, path, type(exc).__name__))
                        self.refused += 1  # the API is down
                        continue
                    self.durations.append((time.monotonic() - started, path, str(r.status_code)))
                    self.codes[r.status_code] += 1
                    if r.status_code == 503:
                        self.unavailable.append(r)


def _all_metrics(user: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": 1000}
        if after is not None:
            params["after"] = after
        body = user.get(f"/v1/jobs/{job_id}/metrics", params=params).json()
        items += body["items"]
        if not body["items"] or body.get("next_after") in (None, after):
            return items
        after = body["next_after"]


def _log_bytes(user: httpx.Client, job_id: str, stream: str) -> bytes:
    data = b""
    offset = 0
    while True:
        r = user.get(f"/v1/jobs/{job_id}/logs", params={"stream": stream, "offset": offset})
        assert r.status_code == 200, r.text
        data += r.content
        nxt = int(r.headers["X-Next-Offset"])
        if nxt == offset:
            return data
        offset = nxt


def _written_metrics(run_dir: Path) -> Counter[tuple[str, int, int, int]]:
    written: Counter[tuple[str, int, int, int]] = Counter()
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("type") == "metric":
            written[(event["name"], event["epoch"], event["step"], event.get("rank", 0))] += 1
    # Each rank's system metrics (docs/operations.md), written beside the events.
    for path in sorted(run_dir.glob("sys-rank-*.jsonl")):
        for line in path.read_text().splitlines():
            point = json.loads(line)
            written[(point["name"], point["epoch"], point["step"], point.get("rank", 0))] += 1
    return written


def test_a_job_trains_through_a_database_outage_and_an_api_sigkill(
    private_pg: PrivatePostgres,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    db_url = private_pg.create_database("torchyard")
    api = ApiProcess(tmp_path / "data", db_url, settings=SETTINGS).start().wait_ready()
    admin = httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=30)
    user = user_client(admin, api.url)
    token = user.headers["Authorization"].split()[1]
    train, val = upload_digits(user, tmp_path / "digits", per_class=10, size=16)
    agent: AgentProcess = start_agent(api.url, worker_token(admin), "n1", tmp_path / "n1", slots=1)
    try:
        wait_for_node(user, "n1")
        spec = job_spec(
            train,
            val,
            parameters={
                "epochs": 3,
                "patience": 3,
                "batch_size": 16,
                "image_size": 16,
                "augmentation": "none",
                "print_frequency": 1,
            },
            resources={"node_count": 1, "process_count_per_node": 1},
        )
        r = user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        wait_for_job(
            user, job_id, lambda j: ((j.get("progress") or {}).get("step") or 0) >= 1, agents=[agent]
        )
        follower = SseFollower([api.url], token, job_id).start()
        poller = Poller(api.url, token, job_id)
        polling = threading.Thread(target=poller.run, daemon=True)
        polling.start()

        # One unbroken outage, begun while the job trains: the database goes away (the API
        # answers 503), the API is SIGKILLed too, and starts again while its database is
        # still down (it waits for it). Longer than the lease timeout throughout: before,
        # this failed the job with WorkerLostError. Whether the job trains on through it or
        # finishes during it, its agent waits it out.
        assert wait_for_job(user, job_id, lambda j: True)["status"] == "running"
        private_pg.stop()
        wait_until(lambda: len(poller.unavailable) >= 5, "503 answers while the database is down", 30)
        ready = httpx.get(f"{api.url}/readyz", timeout=15)
        assert ready.status_code == 503 and ready.json()["code"] == "ServiceUnavailableError"
        assert httpx.get(f"{api.url}/healthz", timeout=15).json() == {"status": "ok"}
        submitted = user.post("/v1/jobs", json=spec)
        assert submitted.status_code == 503 and submitted.headers["Retry-After"] == "1", submitted.text
        time.sleep(OUTAGE_S)
        api.kill()
        api.start()
        time.sleep(OUTAGE_S)
        assert api.alive(), api.log()[-4000:]
        private_pg.start()
        api.wait_ready(timeout=120)

        job = wait_for_job(user, job_id, timeout=300, agents=[agent])
        poller.stop.set()
        polling.join(30)
        follower.thread.join(60)
        stored_points = _all_metrics(user, job_id)
        rank0_log = _log_bytes(user, job_id, "rank-0")
    finally:
        agent.discard()
        api.terminate()
    assert job["status"] == "succeeded", (job, agent.log_text()[-4000:])
    assert len(job["attempts"]) == 1 and job["failure"] is None

    # Clients: 503 with Retry-After and the JSON error body, never a 500 or a hang.
    assert poller.codes[500] == 0 and poller.hung == 0, poller.codes
    longest = max(poller.durations)
    assert longest[0] < LONGEST_REQUEST_S, (
        f"a request took {longest[0]:.1f} s ({longest[1]} -> {longest[2]}), longer than the "
        f"{LONGEST_REQUEST_S:g} s that the database pool and connect timeouts allow"
    )
    assert poller.codes[200] > 0 and poller.refused > 0
    for answer in poller.unavailable:
        assert answer.headers["Retry-After"] == "1"
        assert answer.json()["code"] == "ServiceUnavailableError"
    assert set(poller.codes) <= {200, 503}, poller.codes
    assert "Traceback" not in api.log(), api.log()[-4000:]

    # Every metric point the trainer wrote, stored once.
    run_dir = next((tmp_path / "n1" / "runs").glob(f"{job_id}-*"))
    written = _written_metrics(run_dir)
    stored = Counter((p["name"], p["epoch"], p["step"], p["rank"]) for p in stored_points)
    assert stored == written and max(stored.values()) == 1
    # Every log byte of rank 0, once: the stream is as long as what the rank wrote.
    rank_files = list((run_dir / "torchrun-logs").glob("**/attempt_*/0/std*.log"))
    assert rank_files
    assert len(rank0_log) == sum(p.stat().st_size for p in rank_files)

    # The events follower reconnected through both faults and missed or doubled nothing.
    assert follower.done and follower.reconnects >= 1
    seen = Counter((m["name"], m["epoch"], m["step"], m["rank"]) for m in follower.of_kind("metric"))
    assert seen == stored
    log_seqs = [m["seq"] for m in follower.of_kind("log")]
    assert len(log_seqs) == len(set(log_seqs))
    print(
        f"\npolls: {dict(poller.codes)}, refused while down: {poller.refused}, "
        f"SSE reconnects: {follower.reconnects}, metric points: {sum(stored.values())}, "
        f"longest request: {longest[0]:.2f} s"
    )

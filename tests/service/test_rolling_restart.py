"""Rolling restarts: two API replicas on one PostgreSQL, behind nothing but the clients'
retries, restarted one at a time (SIGTERM, start, ready) while a 2-node job runs, users
poll it and follow its events with ``Last-Event-ID``: no job fails, no event is lost or
doubled, no request gets a 500.

The two nodes are scripted agents over the real worker routes (as in tests/support/fake_agent.py): they
report metric points and log lines as fast as the API takes them, and retry every call
on the other replica when one does not answer, the way real agents retry.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import _reset_pg
from tests.support.api_process import ApiProcess, SseFollower
from tests.support.factories import auth, insert_dataset, job_spec
from tests.support.fake_agent import LEASE, now
from tests.support.worker_fixtures import user_client, worker_token

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SETTINGS = {
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "1",
    # The default: nothing here waits for a lease to run out.
    "TORCHYARD_LEASE_TIMEOUT_S": "15",
    "TORCHYARD_REAPER_INTERVAL_S": "0.2",
    "TORCHYARD_CLAIM_POLL_TIMEOUT_S": "2",
}
POINTS_PER_NODE = 40


class FailoverAgent:
    """One scripted node that sends every call to one replica, and to the next one when the
    first refuses the connection or answers 503."""

    def __init__(self, urls: list[str], token: str, name: str) -> None:
        self.urls = urls
        self.turn = itertools.cycle(range(len(urls)))
        self.current = next(self.turn)
        self.headers = auth(token)
        self.name = name
        self.leases: list[str] = []
        self.failovers = 0
        self.stop = threading.Event()

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        deadline = time.monotonic() + 120
        headers = {**self.headers, **kw.pop("headers", {})}
        while True:
            url = self.urls[self.current]
            try:
                r = httpx.request(method, url + path, headers=headers, timeout=30, **kw)
                if r.status_code != 503:
                    return r
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{method} {path}: no replica answered"
            self.current = next(self.turn)
            self.failovers += 1
            time.sleep(0.1)

    def heartbeats(self) -> None:
        while not self.stop.wait(1.0):
            self.call("POST", f"/v1/worker/nodes/{self.name}/heartbeat", json={"leases": self.leases})

    def run(self, sent: dict[str, Any]) -> None:
        r = self.call(
            "POST",
            "/v1/worker/nodes",
            json={"name": self.name, "address": "127.0.0.1", "units": 1, "accelerator": "cpu"},
        )
        assert r.status_code == 200, r.text
        beat = threading.Thread(target=self.heartbeats, daemon=True)
        beat.start()
        while True:
            r = self.call("POST", f"/v1/worker/nodes/{self.name}/claim", params={"wait": 2})
            if r.status_code == 200:
                break
            assert r.status_code == 204, r.text
        placement = r.json()
        lease = {LEASE: placement["lease_token"]}
        self.leases.append(placement["lease_token"])
        rank = placement["node_rank"]
        assert self.call(
            "POST", "/v1/worker/placements/status", json={"state": "running"}, headers=lease
        ).is_success
        sent["started"].set()
        offset = 0
        for step in range(POINTS_PER_NODE):
            text = f"node {self.name} step {step}\n"
            batch = {
                "metrics": [
                    {
                        "name": "train.loss",
                        "value": 1.0 / (step + 1),
                        "epoch": 0,
                        "step": step,
                        "rank": rank,
                        "time": now(),
                    }
                ],
                "logs": [{"stream": f"rank-{rank}", "offset": offset, "data": text}],
            }
            r = self.call("POST", f"/v1/worker/jobs/{placement['job_id']}/reports", json=batch, headers=lease)
            assert r.status_code == 200, r.text
            offset += len(text)
            sent["logs"][f"rank-{rank}"] += text
            time.sleep(0.15)
        sent["done"].wait(300)
        if rank == 0:
            sha = sent["upload"](self, placement)
            assert sha
        r = self.call(
            "POST", "/v1/worker/placements/status", json={"state": "succeeded", "exit_code": 0}, headers=lease
        )
        assert r.status_code == 200, r.text
        self.stop.set()


def _upload(agent: FailoverAgent, placement: dict[str, Any]) -> str:
    import tempfile

    import torch
    import torchvision

    from torchyard.contract.model_archive import SHA256_HEADER, pack_model_dir
    from torchyard.modeldir import write_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=3)
        folder = write_model_dir(
            Path(tmp) / "model",
            model,
            {"architecture": "mobilenet_v3_small", "classes": ["a", "b", "c"], "image_size": 32},
            {"best": {"val.top1": 0.5}},
        )
        archive = Path(tmp) / "model.tar.gz"
        sha, _size = pack_model_dir(folder, archive)
        r = agent.call(
            "PUT",
            f"/v1/worker/jobs/{placement['job_id']}/model",
            content=archive.read_bytes(),
            headers={LEASE: placement["lease_token"], SHA256_HEADER: sha, "Content-Type": "application/gzip"},
        )
        assert r.status_code == 200, r.text
        return sha


def _poll(urls: list[str], token: str, job_id: str, codes: Counter[int], stop: threading.Event) -> None:
    """A user polling the job on one replica, then the other (0: the connection was refused)."""
    for url in itertools.cycle(urls):
        if stop.is_set():
            return
        try:
            codes[httpx.get(f"{url}/v1/jobs/{job_id}", headers=auth(token), timeout=15).status_code] += 1
        except httpx.TransportError:
            codes[0] += 1
        time.sleep(0.05)


def _final_state(url: str, token: str, job_id: str, streams: list[str]) -> tuple[Any, Any, dict[str, str]]:
    with httpx.Client(base_url=url, headers=auth(token), timeout=30) as http:
        deadline = time.monotonic() + 60
        while (job := http.get(f"/v1/jobs/{job_id}").json())["status"] not in (
            "succeeded",
            "failed",
            "cancelled",
        ):
            assert time.monotonic() < deadline, job
            time.sleep(0.2)
        points = http.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1000}).json()["items"]
        logs = {s: http.get(f"/v1/jobs/{job_id}/logs", params={"stream": s}).text for s in streams}
    return job, points, logs


@pytest.fixture
def replicas(pg_database: str, tmp_path: Path) -> Iterator[list[ApiProcess]]:
    _reset_pg(pg_database)
    data = tmp_path / "data"  # shared by both, as on a shared volume
    apis = [ApiProcess(data, pg_database, settings=SETTINGS, name=f"api{i}") for i in (1, 2)]
    apis[0].start().wait_ready()
    apis[1].start().wait_ready()
    try:
        yield apis
    finally:
        for api in apis:
            api.terminate()


def test_rolling_restart_of_two_replicas_loses_nothing(replicas: list[ApiProcess], pg_database: str) -> None:
    a, b = replicas
    urls = [a.url, b.url]
    admin = httpx.Client(base_url=a.url, headers=auth(a.admin_token), timeout=30)
    user = user_client(admin, a.url)
    user_token = user.headers["Authorization"].split()[1]
    token = worker_token(admin)
    owner = user.get("/v1/whoami").json()["id"]
    from service.config import Settings

    dataset = insert_dataset(
        Settings(data_dir=a.data_dir, database_url=pg_database), owner, classes=["a", "b", "c"]
    )
    sent: dict[str, Any] = {
        "logs": Counter(),
        "started": threading.Event(),
        "done": threading.Event(),
        "upload": _upload,
    }
    sent["logs"] = {"rank-0": "", "rank-1": ""}
    nodes = [FailoverAgent(urls, token, "n1"), FailoverAgent([b.url, a.url], token, "n2")]
    threads = [threading.Thread(target=n.run, args=(sent,), daemon=True) for n in nodes]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while user.get("/v1/cluster").json()["ready_nodes"] < 2:
        assert time.monotonic() < deadline, "the nodes did not register"
        time.sleep(0.1)
    r = user.post(
        "/v1/jobs", json=job_spec(dataset, dataset, resources={"node_count": 2, "process_count_per_node": 1})
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert sent["started"].wait(60)
    follower = SseFollower(urls, user_token, job_id).start()
    codes: Counter[int] = Counter()
    polling_stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(urls, user_token, job_id, codes, polling_stop), daemon=True)
    poller.start()

    # One replica at a time: stopped, started again, ready, then the other.
    for api in (a, b):
        api.terminate()
        time.sleep(1)
        api.start().wait_ready()
    sent["done"].set()
    for t in threads:
        t.join(180)
    job, points, logs = _final_state(b.url, user_token, job_id, list(sent["logs"]))
    follower.thread.join(60)
    polling_stop.set()
    poller.join(30)

    assert job["status"] == "succeeded" and len(job["attempts"]) == 1, job
    # The restarts were real: the agents and the follower had to go elsewhere.
    assert a.starts == b.starts == 2 and codes[0] > 0
    assert codes[500] == 0 and set(codes) <= {0, 200, 503}, codes
    # Every point and log byte stored once.
    assert Counter((p["rank"], p["step"]) for p in points) == Counter(
        (rank, step) for rank in (0, 1) for step in range(POINTS_PER_NODE)
    )
    assert logs == sent["logs"]
    # The follower saw each metric point and log chunk exactly once, and the final status.
    assert follower.done
    seen = Counter((m["rank"], m["step"]) for m in follower.of_kind("metric"))
    assert seen == Counter((p["rank"], p["step"]) for p in points)
    followed: dict[str, str] = {"rank-0": "", "rank-1": ""}
    for chunk in follower.of_kind("log"):
        if chunk["stream"] in followed:
            followed[str(chunk["stream"])] += str(chunk["text"])
    assert followed == sent["logs"]
    statuses = [s["status"] for s in follower.of_kind("status")]
    assert statuses == ["queued", "scheduled", "running", "succeeded"], statuses

"""Time from a node's death to training resumed elsewhere (docs/restarts.md, issue goal: at most
2 x the lease timeout + start-up).

A real API (uvicorn on loopback, SQLite unless ``--database-url`` names a PostgreSQL) and
two real ``torchyard worker`` agents (1 CPU slot each). A job (resnet18 at 32 px, digits,
1 process) starts on the first agent; once its first training step is reported, the
agent is SIGKILLed (torchrun and the rank die with it). From the job's history and
metrics, relative to the kill:

* attempt 1 ends (``WorkerLostError``, the job back in the queue): the lease timeout;
* attempt 2 placed on the second agent, its ranks started (``running``);
* attempt 2's first training step (process start-up, imports, data, first step).

Usage::

    python bench/bench_restart.py --runs 3 --lease-timeout 5
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from bench_queue_latency import api_server, upload_digits

from service.config import Settings


def _iso(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def _agent(url: str, token: str, name: str, tmp: Path) -> subprocess.Popen[bytes]:
    log = open(tmp / f"agent-{name}.log", "ab")  # noqa: SIM115 - lives as long as the agent
    return subprocess.Popen(
        [sys.executable, "-m", "torchyard.cli", "worker", "--api", url, "--name", name,
         "--cpu", "--slots", "1", "--work-dir", str(tmp / name)],
        env={**os.environ, "TORCHYARD_TOKEN": token}, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def _wait(admin: httpx.Client, job_id: str, predicate: Any, timeout: float = 900) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job: dict[str, Any] = admin.get(f"/v1/jobs/{job_id}").json()
        if predicate(job):
            return job
        time.sleep(0.1)
    raise RuntimeError(f"job {job_id} timed out")


def _wait_ready(admin: httpx.Client, name: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if any(
            n["name"] == name and n["status"] == "ready" for n in admin.get("/v1/cluster").json()["nodes"]
        ):
            return
        time.sleep(0.1)
    raise RuntimeError(f"agent {name} did not register")


def _first_step(admin: httpx.Client, job_id: str, attempt: int) -> float | None:
    points = admin.get(
        f"/v1/jobs/{job_id}/metrics", params={"name": "train.loss", "include_superseded": "true"}
    ).json()["items"]
    times = [_iso(p["time"]) for p in points if p["attempt"] == attempt]
    return min(times) if times else None


def one_run(
    url: str, admin: httpx.Client, token: str, train: str, val: str, tmp: Path, n: int
) -> dict[str, float]:
    victim = _agent(url, token, f"victim-{n}", tmp)
    _wait_ready(admin, f"victim-{n}")
    spec = {
        "name": f"restart-{n}",
        "model": {"architecture": "resnet18"},
        "train_dataset": train,
        "validation_dataset": val,
        "parameters": {"epochs": 3, "batch_size": 16, "image_size": 32, "print_frequency": 1},
        "resources": {"node_count": 1, "process_count_per_node": 1, "max_restarts": 1},
    }
    r = admin.post("/v1/jobs", json=spec)
    r.raise_for_status()
    job_id = r.json()["id"]
    rescuer = _agent(url, token, f"rescuer-{n}", tmp)
    _wait(admin, job_id, lambda j: _first_step(admin, job_id, 1) is not None)
    _wait_ready(admin, f"rescuer-{n}")
    killed = datetime.now(UTC).timestamp()
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    job = _wait(admin, job_id, lambda j: _first_step(admin, job_id, 2) is not None or j["status"] == "failed")
    if job["status"] == "failed":
        raise RuntimeError(f"job {job_id} failed: {job['failure']}")
    history = job["history"]
    requeued = next(_iso(h["at"]) for h in history if h["status"] == "queued" and h["message"] != "submitted")
    running = [_iso(h["at"]) for h in history if h["status"] == "running"][-1]
    resumed = _first_step(admin, job_id, 2)
    assert resumed is not None
    admin.post(f"/v1/jobs/{job_id}/cancel")
    _wait(admin, job_id, lambda j: j["status"] == "cancelled")
    rescuer.send_signal(signal.SIGTERM)
    rescuer.wait(60)
    return {"requeued": requeued - killed, "running": running - killed, "resumed": resumed - killed}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lease-timeout", type=float, default=5.0, help="TORCHYARD_LEASE_TIMEOUT_S")
    parser.add_argument("--database-url", default=None, help="default: SQLite in a temporary directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ty-restart-") as tmp_name:
        tmp = Path(tmp_name)
        settings = Settings(
            data_dir=tmp / "data",
            database_url=args.database_url,
            lease_timeout_s=args.lease_timeout,
            heartbeat_interval_s=min(1.0, args.lease_timeout / 5),
            reaper_interval_s=0.2,
        )
        with api_server(settings) as url:
            admin_token = settings.admin_token_path.read_text().strip()
            admin = httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=120
            )
            r = admin.post("/v1/tokens", json={"name": "bench-worker", "role": "worker"})
            r.raise_for_status()
            token = r.json()["token"]
            train, val = upload_digits(admin, tmp / "digits", per_class=20)
            print(f"database: {settings.sqlalchemy_url.split('@')[-1]}  cpus: {os.cpu_count()}  "
                  f"lease timeout: {args.lease_timeout:g} s  load: {os.getloadavg()[0]:.1f}")  # fmt: skip
            runs = [one_run(url, admin, token, train, val, tmp, n) for n in range(args.runs)]
    for key, what in (
        ("requeued", "kill -> attempt 1 ended, job requeued"),
        ("running", "kill -> attempt 2 ranks started elsewhere"),
        ("resumed", "kill -> attempt 2 first training step"),
    ):
        values = [r[key] for r in runs]
        print(f"{what:<45} median {statistics.median(values):6.1f} s   max {max(values):6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

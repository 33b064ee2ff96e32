"""Queue latency: how fast a submitted job reaches an idle worker (bench/RESULTS.md).

Two measurements, both against a real API (uvicorn on loopback, SQLite unless
``--database-url`` names a PostgreSQL):

* ``protocol``: a client that speaks the worker protocol long-polls ``claim``; the
  bench submits jobs one at a time and times submit → claim answered, and submit →
  ``running`` acknowledged (the "running" status report returns). No training: this
  is the scheduler, the long-poll wake-up and the database alone.
* ``agent``: a real ``torchyard worker`` with torchrun and the trainer (1 process,
  resnet18 at 32 px, 1 epoch of digits). Times, from the job's own history and
  metrics: queued → scheduled, queued → running (torchrun launched), and queued →
  the first training step's metric (process start-up, imports, data, first step).

Usage::

    python bench/bench_queue_latency.py                 # both, 50 protocol samples, 3 agent runs
    python bench/bench_queue_latency.py --mode protocol --samples 200

Measured on a 2-core CPU-only machine shared with other test runs (load average 5-8,
so every figure is inflated by CPU contention), uvicorn in the bench process:

==========================================  ========  ========  ========
what                                         p50       p90       p99
==========================================  ========  ========  ========
protocol, SQLite: submit -> claim answered   56 ms     107 ms    177 ms
protocol, SQLite: submit -> running acked    85 ms     134 ms    225 ms
protocol, PostgreSQL: submit -> claim        115 ms    211 ms    1.0 s
protocol, PostgreSQL: submit -> running      156 ms    269 ms    1.0 s
agent (3 runs): queued -> scheduled          116 ms    176 ms (max)
agent: queued -> running (torchrun started)  544 ms    1.7 s (max, first run downloads the datasets)
agent: queued -> first training step         38.8 s    55.7 s (max)
agent: queued -> succeeded (1 epoch)         102 s     135 s (max)
==========================================  ========  ========  ========

The wake-up itself is immediate (no polling delay); what remains is the submission
request, one scheduling pass and one claim transaction. From "running" to the first
step is process start-up: torchrun and each rank import torch and torchvision, which
on this overloaded machine took tens of seconds (a few seconds on an idle one).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from service.api.app import create_app
from service.config import Settings

LEASE = "X-Torchyard-Lease"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def api_server(settings: Settings) -> Iterator[str]:
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def _tar_gz(folder: Path, out: Path) -> Path:
    import tarfile

    with tarfile.open(out, "w:gz") as tf:
        for path in sorted(folder.rglob("*")):
            tf.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return out


def upload_digits(client: httpx.Client, root: Path, per_class: int) -> tuple[str, str]:
    from torchyard.sample_data import write_digits

    ids = []
    for folder in write_digits(root, per_class=per_class, size=32):
        archive = _tar_gz(folder, root / f"{folder.name}.tar.gz")
        with open(archive, "rb") as fh:
            r = client.post("/v1/datasets", data={"name": folder.name}, files={"file": (archive.name, fh)})
        r.raise_for_status()
        ids.append(r.json()["id"])
    return ids[0], ids[1]


def _spec(train: str, val: str, **parameters: Any) -> dict[str, Any]:
    return {
        "name": "latency",
        "model": {"architecture": "resnet18"},
        "train_dataset": train,
        "validation_dataset": val,
        "parameters": {"epochs": 1, "image_size": 32, "augmentation": "none", **parameters},
        "resources": {"node_count": 1, "process_count_per_node": 1},
    }


def _summary(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    p = lambda q: ms[min(len(ms) - 1, round(q * (len(ms) - 1)))]  # noqa: E731
    return (
        f"{name:<34} n={len(ms):<4} p50 {p(0.5):8.1f} ms  p90 {p(0.9):8.1f} ms  "
        f"p99 {p(0.99):8.1f} ms  max {ms[-1]:8.1f} ms  mean {statistics.fmean(ms):8.1f} ms"
    )


def bench_protocol(
    url: str, admin: httpx.Client, worker_token: str, train: str, val: str, samples: int
) -> None:
    worker = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {worker_token}"}, timeout=60)
    worker.post(
        "/v1/worker/nodes", json={"name": "bench-node", "address": "127.0.0.1", "units": 1024}
    ).raise_for_status()
    claimed: dict[str, float] = {}
    running: dict[str, float] = {}
    stop = threading.Event()

    def agent() -> None:
        while not stop.is_set():
            r = worker.post("/v1/worker/nodes/bench-node/claim", params={"wait": 5})
            if r.status_code != 200:
                continue
            work = r.json()
            claimed[work["job_id"]] = time.perf_counter()
            worker.post(
                "/v1/worker/placements/status",
                json={"state": "running"},
                headers={LEASE: work["lease_token"]},
            ).raise_for_status()
            running[work["job_id"]] = time.perf_counter()

    def beat() -> None:
        while not stop.wait(1.0):
            worker.post("/v1/worker/nodes/bench-node/heartbeat", json={"leases": []})

    threads = [threading.Thread(target=agent, daemon=True), threading.Thread(target=beat, daemon=True)]
    for t in threads:
        t.start()
    to_claim: list[float] = []
    to_running: list[float] = []
    # Warm the submission path (the model list import): an unknown architecture is a 422.
    warm = _spec(train, val)
    warm["model"] = {"architecture": "no-such-net"}
    admin.post("/v1/jobs", json=warm)
    time.sleep(0.5)
    for _ in range(samples):
        start = time.perf_counter()
        r = admin.post("/v1/jobs", json=_spec(train, val))
        r.raise_for_status()
        job_id = r.json()["id"]
        deadline = time.monotonic() + 10
        while job_id not in running and time.monotonic() < deadline:
            time.sleep(0.001)
        if job_id not in running:
            raise RuntimeError(f"job {job_id} was not claimed within 10 s")
        to_claim.append(claimed[job_id] - start)
        to_running.append(running[job_id] - start)
        time.sleep(0.05)  # let the poller go back to waiting
    stop.set()
    print(_summary("submit -> claim answered", to_claim))
    print(_summary("submit -> running acknowledged", to_running))


def _iso(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def bench_agent(
    url: str, admin: httpx.Client, worker_token: str, train: str, val: str, runs: int, tmp: Path
) -> None:
    env = {**os.environ, "TORCHYARD_TOKEN": worker_token}
    log_path = tmp / "agent.log"
    with open(log_path, "ab") as log:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchyard.cli",
                "worker",
                "--api",
                url,
                "--name",
                "bench-agent",
                "--cpu",
                "--slots",
                "1",
                "--work-dir",
                str(tmp / "worker"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            nodes = admin.get("/v1/cluster").json()["nodes"]
            if any(n["name"] == "bench-agent" and n["status"] == "ready" for n in nodes):
                break
            time.sleep(0.1)
        time.sleep(8)  # the agent warms its imports right after registering
        scheduled, started, first_step, total = [], [], [], []
        for _ in range(runs):
            r = admin.post("/v1/jobs", json=_spec(train, val, print_frequency=1))
            r.raise_for_status()
            job_id = r.json()["id"]
            while True:
                job = admin.get(f"/v1/jobs/{job_id}").json()
                if job["status"] in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(0.2)
            if job["status"] != "succeeded":
                raise RuntimeError(f"job {job_id} {job['status']}: {job['failure']}")
            at = {h["status"]: _iso(h["at"]) for h in job["history"]}
            metrics = admin.get(
                f"/v1/jobs/{job_id}/metrics", params={"name": "train.loss", "limit": 1}
            ).json()
            scheduled.append(at["scheduled"] - at["queued"])
            started.append(at["running"] - at["queued"])
            first_step.append(_iso(metrics["items"][0]["time"]) - at["queued"])
            total.append(at["succeeded"] - at["queued"])
        print(_summary("queued -> scheduled (agent)", scheduled))
        print(_summary("queued -> running (torchrun up)", started))
        print(_summary("queued -> first training step", first_step))
        print(_summary("queued -> succeeded (1 epoch)", total))
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["protocol", "agent", "both"], default="both")
    parser.add_argument("--samples", type=int, default=50, help="protocol samples")
    parser.add_argument("--runs", type=int, default=3, help="agent runs")
    parser.add_argument("--database-url", default=None, help="default: SQLite in a temporary directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ty-latency-") as tmp_name:
        tmp = Path(tmp_name)
        settings = Settings(data_dir=tmp / "data", database_url=args.database_url)
        with api_server(settings) as url:
            token = settings.admin_token_path.read_text().strip()
            admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120)
            r = admin.post("/v1/tokens", json={"name": "bench-worker", "role": "worker"})
            r.raise_for_status()
            worker_token = r.json()["token"]
            train, val = upload_digits(admin, tmp / "digits", per_class=20)
            print(f"database: {settings.sqlalchemy_url.split('@')[-1]}  cpus: {os.cpu_count()}")
            if args.mode in ("protocol", "both"):
                bench_protocol(url, admin, worker_token, train, val, args.samples)
            if args.mode in ("agent", "both"):
                bench_agent(url, admin, worker_token, train, val, args.runs, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
